"""Latent thoughts near the published LTM setting, for one GPU: an attention decoder (8 layers, d_model 512) whose
256-token sliding window is a quarter of its 1024-token sequences, reading 8 latent vectors per layer inferred by 16
inner steps (lr 0.3), trained on continuation. The data is the Python-source corpus that `ltm build-corpus --out
runs/corpus-py` writes (about 113 MB). `configs/ltm_paper_plain.py` is the same decoder without latents, and
`benchmarks/latent_recipe.py` trains the two at equal tokens in pieces that each fit a time limit."""

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ltm_paper",
      model=ModelConfig(d_model=512, n_layers=8, n_heads=8, layer_pattern="A", window=256, max_seq_len=1024,
                        dtype="bfloat16"),
      data=DataConfig(source="runs/corpus-py"),
      train=TrainConfig(steps=6000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=500, eval_every=500,
                        eval_batches=8, checkpoint_every=500, log_every=50),
      latent=LatentConfig(enabled=True, n_per_layer=8, inner_steps=16, inner_lr=0.3, continuation_fraction=1.0),
  )
