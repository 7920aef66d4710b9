"""A small GPU model (~27M parameters): hybrid of three RWKV-4 layers per attention layer, sliding-window attention.
Point `data.source` at your own text or .bin tokens for anything beyond a smoke test: the embedded corpus is ~1.8 MB."""

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="small",
      model=ModelConfig(d_model=512, n_layers=8, n_heads=8, layer_pattern="RRRA", window=512, max_seq_len=4096,
                        dtype="bfloat16"),
      data=DataConfig(source="embedded"),
      train=TrainConfig(steps=20_000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=1000, eval_every=1000,
                        checkpoint_every=2000, log_every=50),
  )
