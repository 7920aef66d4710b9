"""The jitted train and eval steps. A train step averages gradients over `grad_accum` micro-batches."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.train import loss_scale as loss_scale_lib

if TYPE_CHECKING:
  from ltm_jax.parallel import Layout


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data (checkpoint-friendly); reserved for stochastic training (latents, dropout).
  # The dynamic loss scale of float16 compute. Every state carries one (left untouched by other dtypes), so switching
  # model.dtype on resume keeps the checkpoint's structure.
  loss_scale: loss_scale_lib.LossScale


def create_train_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                    jax.random.key_data(jax.random.key(seed)), loss_scale_lib.initial())


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
                    grad_accum: int, layout: Layout | None = None):
  """Returns jitted `step(state, batch) -> (state, metrics)`; batch leaves are [B, T] with B % grad_accum == 0.

  With latents (model.latent enabled) each micro-batch first fits its posterior in the inner loop (fast learning),
  then the decoder takes one gradient of the NLL given z sampled from it, z held constant (slow learning). `loss` is
  that NLL per token; `kl` (per token) is logged beside it, so loss + kl is the training ELBO per token.

  With a `layout` (ltm_jax.parallel) the step is compiled for its mesh: state and batch arrive and leave in the
  layout's shardings (the state donated), every micro-batch is split like the batch, gradients are laid out like the
  parameters (so FSDP reduce-scatters them), and metrics come back replicated."""
  latent = model_lib.uses_latents(getattr(model, "latent", None))
  # float16 gradients underflow: differentiate the loss times a dynamic scale, unscale in float32, and skip the
  # update (halving the scale) when a gradient overflows.
  scaled = model.cfg.dtype == "float16"

  def loss(params, micro, z, scale):
    nll, _ = token_nll(model, params, micro, z)
    value = nll.mean()
    return (loss_scale_lib.scale_loss(scale, value) if scaled else value), value

  def step(state: TrainState, batch):
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
    # Each micro-batch split over the batch axes like the whole batch (a no-op without a layout's rules).
    micro = nn.with_logical_constraint(micro, (None, "batch", "length"))
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def accumulate(grads_sum, xs):
      mb, index = xs
      z, extra = None, {}
      if latent is not None:
        z, extra = _posterior_sample(model, state.params, mb, jax.random.fold_in(step_key, index))
      (_, value), grads = jax.value_and_grad(loss, has_aux=True)(state.params, mb, z, state.loss_scale)
      return jax.tree.map(jnp.add, grads_sum, grads), {"loss": value, **extra}

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, micro_metrics = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(grad_accum)))
    grads = jax.tree.map(lambda g: g / grad_accum, grads)
    if scaled:
      grads = loss_scale_lib.unscale(state.loss_scale, grads)
    if layout is not None:
      grads = jax.lax.with_sharding_constraint(grads, layout.state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v.mean() for k, v in micro_metrics.items()}
    grad_norm, loss_scale = optax.tree.norm(grads), state.loss_scale
    if scaled:
      finite = loss_scale_lib.all_finite(grads)
      params, opt_state = loss_scale_lib.select(finite, (params, opt_state), (state.params, state.opt_state))
      loss_scale = loss_scale_lib.update(state.loss_scale, finite)
      # A skipped step is routine under loss scaling, not a divergence: log it instead of an infinite norm.
      metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.float32))
      grad_norm = jnp.where(finite, grad_norm, 0.0)
    metrics.update(grad_norm=grad_norm, lr=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale), metrics

  if layout is None:
    return jax.jit(step, donate_argnums=0)
  return layout.jit(step, in_shardings=(layout.state, layout.batch),
                    out_shardings=(layout.state, layout.replicated), donate_argnums=0)


def make_eval_step(model: nn.Module, seed: int = 0, layout: Layout | None = None):
  """Returns jitted `eval_step(params, batch, index) -> {"nll": sum, "kl": sum, "tokens": count}` (with a `layout`:
  compiled for its mesh, params and batch as placed, sums replicated).

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

  if layout is None:
    return jax.jit(eval_step)
  return layout.jit(eval_step, out_shardings=layout.replicated)


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
