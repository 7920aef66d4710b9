"""A 350M-class attention model (24 layers, d_model 1024, GQA 16/4) for GPUs, bfloat16 compute; 4 micro-batches per
step keep activations of the 64 x 2048-token batch within one 80 GB GPU.
The residual stream is bfloat16 too (model.residual_dtype; the library's default is float32): its adds and norms
move half the bytes; in a small RWKV-7 run on the CPU (8 layers, d_model 128, 400 steps) it trained as the float32
stream did, within seed noise (benchmarks/results/rwkv7-bf16-residual-train-cpu.json; docs/kernels.md).
The loss takes the whole [B, T, vocab] logits at once (model.loss_chunk=0): with the byte vocabulary (259 ids,
padded to 384) they are 50 MB float32 for each 16 x 2048 micro-batch, and chunking them costs launches and a
recomputation for nothing (as predicted for base_125m, docs/kernels.md). With a large vocabulary set
model.loss_chunk (e.g. 256) to hold [B, loss_chunk, vocab] at a time."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="base_350m",
      model=ModelConfig(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=4, mlp_dim=3840, layer_pattern="A",
                        max_seq_len=2048, dtype="bfloat16",
                        residual_dtype="bfloat16", loss_chunk=0),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=100_000, batch_size=64, seq_len=2048, grad_accum=4, lr=3e-4, warmup_steps=2000,
                        eval_every=1000, checkpoint_every=2000, log_every=50),
  )
