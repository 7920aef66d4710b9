"""A 125M-class RWKV-7 (x070) model for one or more GPUs, bfloat16 compute: 12 RWKV-7 layers of d_model 768 (12 heads
of 64 x 64 state, head size 64), each with RWKV-7's channel mix (hidden 4 x 768), ln0 and the low-rank widths of the
official x070 0.1B model (decay 64, iclr 64, value residual 32, gate 128). Batch and sequence as configs/base_125m.py,
its attention counterpart. Compiled for one H100 without remat (benchmarks/step_budget.py), its 64 x 2048 step
needs 76 GiB of temporaries even after XLA's own rematerialization, and 54 GiB at 32 x 2048: on one 80 GB GPU run it
with train.grad_accum=2 (two micro-batches of 32) or a remat policy. Point `data.source` at your own text or .bin
tokens for anything beyond a smoke test.
The residual stream is bfloat16 too (model.residual_dtype; the library's default is float32): its adds and norms
move half the bytes; in a small RWKV-7 run on the CPU (8 layers, d_model 128, 400 steps) it trained as the float32
stream did, within seed noise (benchmarks/results/rwkv7-bf16-residual-train-cpu.json; docs/kernels.md).
The loss takes the whole [B, T, vocab] logits at once (model.loss_chunk=0): with the byte vocabulary (259 ids,
padded to 384) they are 201 MB float32 at 64 x 2048, and chunking them cost launches and a recomputation for
nothing (deviceless sm_90a step budget, predicted at 32 x 2048: 179.9 -> 178.8 ms; docs/kernels.md). With a large
vocabulary set model.loss_chunk (e.g. 256) to hold [B, loss_chunk, vocab] at a time."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="base_125m_rwkv7",
      model=ModelConfig(d_model=768, n_layers=12, n_heads=12, layer_pattern="W", max_seq_len=2048,
                        rwkv7_head_size=64, rwkv7_decay_lora=64, rwkv7_iclr_lora=64, rwkv7_value_lora=32,
                        rwkv7_gate_lora=128, ln0=True, dtype="bfloat16",
                        residual_dtype="bfloat16", loss_chunk=0),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=50_000, batch_size=64, seq_len=2048, lr=6e-4, warmup_steps=2000, eval_every=1000,
                        checkpoint_every=2000, log_every=50),
  )
