"""configs/tiny.py with latent thought vectors: the same decoder plus cross-attention to 8 latent vectors in its top
block, in the efficient form of LatentConfig's defaults (an encoder's proposal refined by 2 inner steps, every row
trained on continuation; `ltm info --config configs/tiny_ltm.py` prints its training FLOPs against the plain
decoder's). init_logvar is -1 rather than the default -5: with 8 latent vectors of 128 dims per 128-byte window (8
latent dimensions per byte), a posterior starting at variance e^-5 costs ~16 nats/byte of KL that 2 inner steps
cannot win back, so the ELBO would measure the start point rather than the model (see docs/latent-thoughts.md)."""

import dataclasses
import pathlib

from ltm_jax.config import Config, LatentConfig, load_config


def get_config() -> Config:
  tiny = load_config(pathlib.Path(__file__).with_name("tiny.py"))
  # `make demo` trains it: 400 steps (1.6 M bytes) keep the demo near 5 minutes on 2 CPU cores.
  return dataclasses.replace(
      tiny, name="tiny_ltm",
      train=dataclasses.replace(tiny.train, steps=400, warmup_steps=50, eval_every=100, checkpoint_every=200),
      latent=LatentConfig(enabled=True, init_logvar=-1.0))
