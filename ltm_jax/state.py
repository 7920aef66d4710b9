"""The train state: what a training run updates, checkpoints and restores."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from ltm_jax import loss_scale as loss_scale_lib
from ltm_jax import model as model_lib
from ltm_jax.config import Config


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data (checkpoint-friendly); reserved for stochastic training (latents, dropout).
  # The dynamic loss scale of float16 compute. Every state carries one (left untouched by other dtypes), so switching
  # model.dtype on resume keeps the checkpoint's structure.
  loss_scale: loss_scale_lib.LossScale


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(init key, training key) of a run with `seed`: split from one root key, so the parameters' initialisation and
  the training randomness (latent inference's starting points and noise) never draw from the same key."""
  init_key, train_key = jax.random.split(jax.random.key(seed))
  return init_key, train_key


def create_train_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  """Step 0 of training `params` (initialised from `run_keys(seed)[0]`, or converted) with the training key of
  `seed`. A restored checkpoint carries its own key, so a resumed run continues the stream it started with."""
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                    jax.random.key_data(run_keys(seed)[1]), loss_scale_lib.initial())


def init_train_state(cfg: Config, optimizer: optax.GradientTransformation) -> TrainState:
  """Step 0 of a fresh run of `cfg`: `LM(cfg.model, cfg.latent)`'s parameters initialised from the init key of
  cfg.train.seed."""
  seed = cfg.train.seed
  return create_train_state(model_lib.init_params(cfg.model, run_keys(seed)[0], cfg.latent), optimizer, seed)


def abstract_train_state(cfg: Config, optimizer: optax.GradientTransformation) -> TrainState:
  """ShapeDtypeStructs of `init_train_state(cfg, optimizer)`, computing nothing: the template a checkpoint of `cfg`
  is restored into."""
  return jax.eval_shape(lambda: init_train_state(cfg, optimizer))
