"""The jitted train and eval steps. A train step averages gradients over `grad_accum` micro-batches."""

from __future__ import annotations

import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer updates applied so far.
  params: Any
  opt_state: Any
  rng: jax.Array  # uint32 key data (checkpoint-friendly); reserved for stochastic training (latents, dropout).


def create_train_state(params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                    jax.random.key_data(jax.random.key(seed)))


def token_nll(model: nn.Module, params, batch) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood [B, T] (float32) and the number of tokens."""
  logits, _ = model.apply({"params": params}, batch["inputs"])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return nll, jnp.asarray(nll.size, jnp.float32)


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum: int):
  """Returns jitted `step(state, batch) -> (state, metrics)`; batch leaves are [B, T] with B % grad_accum == 0."""

  def loss(params, micro):
    nll, _ = token_nll(model, params, micro)
    return nll.mean()

  def step(state: TrainState, batch):
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

    def accumulate(grads_sum, mb):
      value, grads = jax.value_and_grad(loss)(state.params, mb)
      return jax.tree.map(jnp.add, grads_sum, grads), value

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, losses = jax.lax.scan(accumulate, zeros, micro)
    grads = jax.tree.map(lambda g: g / grad_accum, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": losses.mean(), "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step)}
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(step, donate_argnums=0)


def make_eval_step(model: nn.Module):
  """Returns jitted `eval_step(params, batch) -> (nll_sum, token_count)`."""

  def eval_step(params, batch):
    nll, count = token_nll(model, params, batch)
    return nll.sum(), count

  return jax.jit(eval_step)


def evaluate(eval_step, params, batches, bytes_per_token: float | None) -> dict[str, float]:
  """Mean validation NLL (nats/token) and bits per byte over fixed batches."""
  nll_sum, count = 0.0, 0.0
  for batch in batches:
    s, c = eval_step(params, batch)
    nll_sum, count = nll_sum + float(s), count + float(c)
  val_loss = nll_sum / count
  metrics = {"val_loss": val_loss, "val_tokens": int(count)}
  if bytes_per_token:
    metrics["val_bpb"] = val_loss / math.log(2) / bytes_per_token
  return metrics
