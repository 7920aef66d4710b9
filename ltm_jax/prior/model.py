"""A trained latent prior: the DiT's EMA weights, the standardisation of z, and sampling from it.

The DiT works on standardised latents x = (z - mean) / std (per coordinate, the aggregate posterior's moments), so
a sample is z = mean + std * x_{t_min}. Its checkpoints live in WORKDIR/prior/checkpoints (`train.train_prior`).
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.config import Config, PriorConfig
from ltm_jax.errors import CheckpointError, ConfigError
from ltm_jax.prior import samplers
from ltm_jax.prior.diffusion import Denoiser, nll_bound, schedule_of
from ltm_jax.prior.dit import DiT
from ltm_jax.prior.optimizer import make_optimizer


def folder_of(workdir: str | pathlib.Path) -> pathlib.Path:
  return pathlib.Path(workdir) / "prior"


class PriorState(NamedTuple):
  """What a prior checkpoint holds. mean, std: float32 [latent layers, n_per_layer, d_model]."""
  params: Any
  ema: Any
  opt_state: Any
  step: jax.Array
  mean: jax.Array
  std: jax.Array


def denoiser(cfg: PriorConfig, params) -> Denoiser:
  """eps_theta(x_t [B, *latent_shape], t [B]) of the DiT with `params`, on standardised latents."""
  model = DiT(cfg)
  return lambda x, t: model.apply({"params": params}, x, t)


@functools.partial(jax.jit, static_argnums=(0, 1))  # One program: flax's eager init compiles op by op.
def init_params(cfg: PriorConfig, latent_shape: tuple[int, int, int], key: jax.Array):
  x = jnp.ones((1, *latent_shape), jnp.float32)
  return DiT(cfg).init(key, x, jnp.ones((1,), jnp.float32))["params"]


class LatentPrior:
  """p(z) learned by diffusion: `sample(batch, key)` draws z [batch, latent layers, n_per_layer, d_model]."""

  def __init__(self, cfg: PriorConfig, params, mean: jax.Array, std: jax.Array, step: int = 0):
    self.cfg, self.params, self.step = cfg, params, step
    self.mean, self.std = jnp.asarray(mean, jnp.float32), jnp.asarray(std, jnp.float32)
    self.latent_shape = tuple(self.mean.shape)

  def sample(self, batch: int, key: jax.Array, sampler: str | None = None, steps: int | None = None) -> jax.Array:
    """z [batch, *latent_shape] float32 from `sampler` ("dpm++" or "ddpm"; default prior.sampler) in `steps`
    denoiser evaluations (default prior.sampler_steps)."""
    sampler = self.cfg.sampler if sampler is None else sampler
    steps = self.cfg.sampler_steps if steps is None else steps
    samplers.check(sampler, steps)
    return _sample(self.cfg, self.params, self.mean, self.std, key, batch, sampler, int(steps))

  def nll_bound(self, z: jax.Array, key: jax.Array, samples: int = 16) -> jax.Array:
    """An upper bound [B] on -log p(z) in nats for z [B, *latent_shape] (`diffusion.nll_bound` on the standardised
    latents plus the log-determinant of the standardisation), estimated without bias with `samples` times per z. With
    it, E_q[log q(z) + bound(z)] bounds KL(q || p) from above, so an ELBO with the learned prior is still a bound."""
    return _nll_bound(self.cfg, self.params, self.mean, self.std, jnp.asarray(z, jnp.float32), key, samples)


@functools.partial(jax.jit, static_argnames=("cfg", "samples"))
def _nll_bound(cfg, params, mean, std, z, key, samples):
  bound = nll_bound(denoiser(cfg, params), (z - mean) / std, key, schedule_of(cfg), samples)
  return bound + jnp.sum(jnp.log(std))


@functools.partial(jax.jit, static_argnames=("cfg", "batch", "sampler", "steps"))
def _sample(cfg, params, mean, std, key, batch, sampler, steps):
  noise_key, sampler_key = jax.random.split(key)
  x_T = jax.random.normal(noise_key, (batch, *mean.shape), jnp.float32)
  x = samplers.sample(sampler, denoiser(cfg, params), x_T, schedule_of(cfg), steps, sampler_key)
  return mean + std * x


def abstract_state(cfg: PriorConfig, latent_shape: tuple[int, int, int], optimizer) -> PriorState:
  def build():
    params = init_params(cfg, latent_shape, jax.random.key(0))
    zeros = jnp.zeros(latent_shape, jnp.float32)
    return PriorState(params, params, optimizer.init(params), jnp.zeros((), jnp.int32), zeros, zeros)
  return jax.eval_shape(build)


def decoder_latent_shape(decoder: Config) -> tuple[int, int, int]:
  """[latent layers, n_per_layer, d_model]: one sequence's z for `decoder` (only its latent-reading blocks)."""
  return model_lib.latent_shape(decoder.model, decoder.latent, 1)[1:]


def load_prior(workdir: str | pathlib.Path, decoder: Config, step: int | None = None) -> LatentPrior:
  """The prior trained in WORKDIR/prior for `decoder` (the workdir's latent model), at `step` (default: newest
  readable). CheckpointError when there is none or it was trained for latents of another shape."""
  from ltm_jax.train.checkpoint import Checkpointer
  folder = folder_of(workdir)
  if not (folder / "checkpoints").is_dir():
    raise CheckpointError(f"{workdir} has no trained prior (no {folder / 'checkpoints'}); run `ltm fit-prior` and "
                          "`ltm train-prior` first")
  expected = decoder_latent_shape(decoder)
  checkpointer = Checkpointer(folder, read_only=True)

  def read(at: int):
    saved = checkpointer.saved_config(at)
    data = checkpointer.restore_data(at)
    shape = tuple(data["latent_shape"])
    if shape != expected:
      raise CheckpointError(f"the prior in {folder} was trained for latents of shape {list(shape)}, but this "
                            f"decoder's are {list(expected)}; train a prior for this decoder")
    state, _ = checkpointer.restore(at, abstract_state(saved.prior, shape, make_optimizer(saved.prior)))
    return saved, state

  try:
    if step is None:
      step, (saved, state), _ = checkpointer.newest_readable(read)
    else:
      saved, state = read(step)
  finally:
    checkpointer.close()
  return LatentPrior(saved.prior, state.ema, state.mean, state.std, step)


def prior_config(saved: Config, overrides) -> Config:
  """`saved` with `overrides`, which may only name prior.* keys."""
  bad = [o for o in overrides if not o.strip().startswith("prior.")]
  if bad:
    raise ConfigError(f"only prior.* keys can be set for the prior, got {', '.join(bad)}")
  return config_lib.validate(config_lib.apply_overrides(saved, overrides))
