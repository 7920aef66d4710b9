"""configs/ltm_window.py's windowed decoder (4 attention layers, 32-token window over 512-byte sequences: a logit
sees 125 bytes) on a corpus large enough to train it for long: the Python source of a pinned set of packages
(`ltm build-corpus --out runs/corpus-py`, about 107 MB of training text). Source code has structure far beyond a
window (names defined far above their use), which only z can carry to the decoder here. 2500 steps of 16 x 512 bytes
are 20.5 M tokens, five times what the embedded corpus allowed. `configs/ltm_code_plain.py` is the decoder without
latents.

The efficient latent step: z (8 vectors) is read by the top block only, so the three blocks below run once per
train step and the inner loop runs through one block; semi-amortised inference (an encoder's proposal refined by 2
inner steps) and continuation training. `ltm info` prints its training FLOPs against the plain twin's."""

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig


def get_config() -> Config:
  return Config(
      name="ltm_code",
      model=ModelConfig(d_model=128, n_layers=4, n_heads=4, layer_pattern="A", window=32, max_seq_len=512),
      data=DataConfig(source="runs/corpus-py"),
      train=TrainConfig(steps=2500, batch_size=16, seq_len=512, lr=4e-3, warmup_steps=100, eval_every=250,
                        eval_batches=4, checkpoint_every=250, log_every=50),
      latent=LatentConfig(enabled=True, n_per_layer=8, top_layers=1, inner_steps=2, inner_lr=0.1,
                          continuation_fraction=1.0, encoder=True),
  )
