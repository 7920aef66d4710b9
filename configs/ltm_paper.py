"""Latent thoughts at GPU scale: an attention decoder (8 layers, d_model 512) whose 256-token sliding window is a
quarter of its 1024-token sequences, reading 64 latent vectors in its top block (the efficient latent step: the seven
blocks below run once per train step, the inner loop through one block), proposed by an encoder and refined by 2
inner steps, trained on continuation. The published LTM setting (8 vectors in every block, 16 inner steps from the
prior, about 7x the training FLOPs of the plain twin) is `latent.top_layers=null latent.n_per_layer=8
latent.encoder=false latent.inner_steps=16 latent.inner_lr=0.3`. The data is the Python-source corpus that `ltm build-corpus --out
runs/corpus-py` writes (about 113 MB). `configs/ltm_paper_plain.py` is the same decoder without latents, and
`benchmarks/latent.py recipe` trains the two at equal tokens in pieces that each fit a time limit."""

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ltm_paper",
      model=ModelConfig(d_model=512, n_layers=8, n_heads=8, layer_pattern="A", window=256, max_seq_len=1024,
                        dtype="bfloat16"),
      data=DataConfig(source="runs/corpus-py"),
      train=TrainConfig(steps=6000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=500, eval_every=500,
                        eval_batches=8, checkpoint_every=500, log_every=50),
      latent=LatentConfig(enabled=True, n_per_layer=64, top_layers=1, inner_steps=2, inner_lr=0.1,
                          continuation_fraction=1.0, encoder=True),
  )
