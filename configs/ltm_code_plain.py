"""configs/ltm_code.py without latent thought vectors: the same windowed decoder on the same corpus and schedule."""

import dataclasses
import pathlib

from ltm_jax.config import Config, load_config


def get_config() -> Config:
  ltm = load_config(pathlib.Path(__file__).with_name("ltm_code.py"))
  return dataclasses.replace(ltm, name="ltm_code_plain", latent=dataclasses.replace(ltm.latent, enabled=False))
