"""configs/ltm_window.py without latent thought vectors: the same windowed decoder (same parameters, same data and
schedule), the baseline that the latent model has to beat on continuation perplexity."""

import dataclasses
import pathlib

from ltm_jax.config import Config, load_config


def get_config() -> Config:
  ltm = load_config(pathlib.Path(__file__).with_name("ltm_window.py"))
  return dataclasses.replace(ltm, name="ltm_window_plain",
                             latent=dataclasses.replace(ltm.latent, enabled=False))
