"""configs/tiny.py with latent thought vectors: the same decoder plus cross-attention to z in every block.

init_logvar is -1 rather than the default -5: with 2 x 4 latent vectors of 128 dims per 128-token window (8 latent
dimensions per token), a posterior starting at variance e^-5 costs ~16 nats/token of KL that 8 inner steps cannot
win back, so the ELBO would measure the start point rather than the model (see docs/latent-thoughts.md)."""

import dataclasses
import pathlib

from ltm_jax.config import Config, LatentConfig, load_config


def get_config() -> Config:
  tiny = load_config(pathlib.Path(__file__).with_name("tiny.py"))
  return dataclasses.replace(
      tiny, name="tiny_ltm",
      latent=LatentConfig(enabled=True, n_per_layer=2, inner_steps=8, inner_lr=0.3, init_logvar=-1.0))
