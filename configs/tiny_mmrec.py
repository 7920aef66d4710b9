"""MM-Rec on the CPU demo's scale: four `D` blocks (the MDI recurrence, then attention to a ring of the last 16
summaries of 16-byte segments), the SwiGLU width trimmed so the parameter count matches configs/tiny.py."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="tiny_mmrec",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="D", mlp_dim=168, mmrec_slots=16,
                        mmrec_segment=16, max_seq_len=1024),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=900, batch_size=32, seq_len=128, lr=4e-3, warmup_steps=100, eval_every=150,
                        eval_batches=16, checkpoint_every=300, log_every=50),
  )
