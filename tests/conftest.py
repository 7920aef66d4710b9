"""Shared fixtures: a micro configuration that compiles in seconds on 2 CPU cores."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import pytest

from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Ops called outside a model get IEEE float32 matmuls too (a model sets model.matmul_precision itself): the float32
# tolerances against float64 references assume it, and on GPU XLA's default would be TF32.
jax.config.update("jax_default_matmul_precision", "highest")


def micro_config(**model_overrides) -> Config:
  """A 2-layer hybrid (RWKV-4 + attention) with d_model 32 and short sequences."""
  model = dataclasses.replace(
      ModelConfig(d_model=32, n_layers=2, n_heads=4, layer_pattern="RA", max_seq_len=128), **model_overrides)
  train = TrainConfig(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=2,
                      checkpoint_every=6, log_every=3, async_checkpoint=True)
  return validate(Config(name="micro", model=model, data=DataConfig(worker_threads=1, prefetch=2), train=train))


@pytest.fixture
def micro() -> Config:
  return micro_config()
