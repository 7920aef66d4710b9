"""configs/small.py with RWKV-7 in place of RWKV-4 (~28M parameters): three RWKV-7 (x070) layers per sliding-window
attention layer, head size 64 (8 heads of 64 x 64 state), official LoRA widths and initialisation, ln0 as the
official models. Point `data.source` at your own text or .bin tokens for anything beyond a smoke test.
The residual stream is bfloat16 too (model.residual_dtype; the library's default is float32): its adds and norms
move half the bytes; in a small RWKV-7 run on the CPU (8 layers, d_model 128, 400 steps) it trained as the float32
stream did, within seed noise (benchmarks/results/rwkv7-bf16-residual-train-cpu.json; docs/kernels.md).
The loss takes the whole [B, T, vocab] logits at once (model.loss_chunk=0): with the byte vocabulary (259 ids,
padded to 384) they are 50 MB float32 at 32 x 1024, and chunking them cost launches and a recomputation for
nothing (deviceless sm_90a step budget, predicted: 34.31 -> 33.84 ms; docs/kernels.md). With a large vocabulary
set model.loss_chunk (e.g. 256) to hold [B, loss_chunk, vocab] at a time."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="small_rwkv7",
      model=ModelConfig(d_model=512, n_layers=8, n_heads=8, layer_pattern="WWWA", window=512, max_seq_len=4096,
                        rwkv7_head_size=64, ln0=True, dtype="bfloat16",
                        residual_dtype="bfloat16", loss_chunk=0),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=20_000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=1000, eval_every=1000,
                        checkpoint_every=2000, log_every=50),
  )
