"""The jitted train and eval steps. A train step averages gradients over `grad_accum` micro-batches."""

from __future__ import annotations

import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data (checkpoint-friendly); reserved for stochastic training (latents, dropout).


def create_train_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                    jax.random.key_data(jax.random.key(seed)))


def token_nll(model: nn.Module, params, batch, latents=None) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood [B, T] (float32) and the number of tokens."""
  nll = latent_lib.token_nll(model, params, batch["inputs"], batch["targets"], latents)
  return nll, jnp.asarray(nll.size, jnp.float32)


def _posterior_sample(model: nn.Module, params, batch, key: jax.Array):
  """Fits q(z|x) on the batch (the fast, inner loop) and draws z from it with fresh noise.

  Returns z (a constant for the caller's gradient: `infer` stops gradients) and per-token metrics of the fit."""
  fit_key, sample_key = jax.random.split(key)
  fitted, eps = latent_lib.infer(model, params, batch["inputs"], batch["targets"], fit_key)
  tokens = batch["targets"].size
  z = fitted.posterior.sample(jax.random.normal(sample_key, eps.shape, eps.dtype))
  metrics = {
      "kl": fitted.kl[-1].sum() / tokens,
      "inner_elbo_start": (fitted.nll[0] + fitted.kl[0]).sum() / tokens,
      "inner_elbo_end": (fitted.nll[-1] + fitted.kl[-1]).sum() / tokens,
  }
  return z, metrics


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum: int):
  """Returns jitted `step(state, batch) -> (state, metrics)`; batch leaves are [B, T] with B % grad_accum == 0.

  With latents (model.latent enabled) each micro-batch first fits its posterior in the inner loop (fast learning),
  then the decoder takes one gradient of the NLL given z sampled from it, z held constant (slow learning). `loss` is
  that NLL per token; `kl` (per token) is logged beside it, so loss + kl is the training ELBO per token."""
  latent = model_lib.uses_latents(getattr(model, "latent", None))

  def loss(params, micro, z):
    nll, _ = token_nll(model, params, micro, z)
    return nll.mean()

  def step(state: TrainState, batch):
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def accumulate(grads_sum, xs):
      mb, index = xs
      z, extra = None, {}
      if latent is not None:
        z, extra = _posterior_sample(model, state.params, mb, jax.random.fold_in(step_key, index))
      value, grads = jax.value_and_grad(loss)(state.params, mb, z)
      return jax.tree.map(jnp.add, grads_sum, grads), {"loss": value, **extra}

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, micro_metrics = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(grad_accum)))
    grads = jax.tree.map(lambda g: g / grad_accum, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v.mean() for k, v in micro_metrics.items()}
    metrics.update(grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(step, donate_argnums=0)


def make_eval_step(model: nn.Module, seed: int = 0):
  """Returns jitted `eval_step(params, batch, index) -> {"nll": sum, "kl": sum, "tokens": count}`.

  With latents, z is fitted on each sequence by the inner loop and sampled from the posterior, so nll + kl is a
  (single-sample) ELBO: an upper bound on the sequence's negative log-likelihood. Without, kl is 0 and nll exact."""
  latent = model_lib.uses_latents(getattr(model, "latent", None))

  def eval_step(params, batch, index):
    z, kl = None, jnp.zeros((), jnp.float32)
    if latent is not None:
      z, extra = _posterior_sample(model, params, batch, jax.random.fold_in(jax.random.key(seed), index))
      kl = extra["kl"] * batch["targets"].size
    nll, count = token_nll(model, params, batch, z)
    return {"nll": nll.sum(), "kl": kl, "tokens": count}

  return jax.jit(eval_step)


def evaluate(eval_step, params, batches, bytes_per_token: float | None) -> dict[str, float]:
  """Validation loss (nats/token) and bits per byte over fixed batches.

  val_loss = (NLL + KL) / tokens: exact for the plain decoder (KL = 0), the ELBO bound for a latent model, so the two
  are compared on the same footing. val_nll and val_kl give its parts."""
  totals = {"nll": 0.0, "kl": 0.0, "tokens": 0.0}
  for index, batch in enumerate(batches):
    for k, v in eval_step(params, batch, index).items():
      totals[k] += float(v)
  count = totals["tokens"]
  val_loss = (totals["nll"] + totals["kl"]) / count
  metrics = {"val_loss": val_loss, "val_nll": totals["nll"] / count, "val_kl": totals["kl"] / count,
             "val_tokens": int(count)}
  if bytes_per_token:
    metrics["val_bpb"] = val_loss / math.log(2) / bytes_per_token
  return metrics
