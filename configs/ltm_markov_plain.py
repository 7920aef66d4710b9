"""configs/ltm_markov.py without latent thought vectors: the same windowed decoder on the same documents, the
baseline the latent model has to beat on the second halves."""

import dataclasses
import pathlib

from ltm_jax.config import Config, load_config


def get_config() -> Config:
  ltm = load_config(pathlib.Path(__file__).with_name("ltm_markov.py"))
  return dataclasses.replace(ltm, name="ltm_markov_plain", latent=dataclasses.replace(ltm.latent, enabled=False))
