"""Titans on the CPU demo's scale: `MA` x 2 (a neural-memory layer then attention, then plain attention), every
attention layer windowed to 32 bytes, the SwiGLU width trimmed so the parameter count matches configs/tiny.py."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="tiny_titans",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="MA", window=32, mlp_dim=288,
                        memory_depth=1, memory_chunk=16, max_seq_len=1024),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=900, batch_size=32, seq_len=128, lr=4e-3, warmup_steps=100, eval_every=150,
                        eval_batches=16, checkpoint_every=300, log_every=50),
  )
