"""The CPU demo: a small hybrid (RWKV-4 + attention) byte-level LM on the embedded corpus, ~5 minutes on 2 cores."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="tiny",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="RA", max_seq_len=1024),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=900, batch_size=32, seq_len=128, lr=4e-3, warmup_steps=100, eval_every=150,
                        eval_batches=16, checkpoint_every=300, log_every=50),
  )
