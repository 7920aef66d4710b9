"""The memory itself: a bias-free MLP whose weights are the state, M(x) = W_L^T silu(... silu(W_1^T x)), one per
head; depth 1 is a linear map. Its per-token gradient on ||M(k) - v||^2 is a sum of rank-one terms, one per layer,
which is what lets the chunked backend write a chunk's updates as matrix products."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply(weights: tuple[jax.Array, ...], x: jax.Array) -> jax.Array:
  """M(x) for weights ([..., d_0, d_1], [..., d_1, d_2], ...) and x [..., n, d_0] or [d_0] -> [..., n, d_L]."""
  for layer, w in enumerate(weights):
    x = x @ w
    if layer < len(weights) - 1:
      x = jax.nn.silu(x)
  return x


def silu_grad(u: jax.Array) -> jax.Array:
  s = jax.nn.sigmoid(u)
  return s * (1 + u * (1 - s))


def outer_factors(weights: tuple[jax.Array, ...], k: jax.Array, v: jax.Array):
  """The gradient of sum_t ||M(k_t) - v_t||^2 per token, as factors: for every layer l, (inputs [..., n, d_{l-1}],
  deltas [..., n, d_l]) with d loss_t / d W_l = outer(inputs[t], deltas[t]). k [..., n, d_0], v [..., n, d_L]."""
  inputs, pre = [], []
  x = k
  for layer, w in enumerate(weights):
    inputs.append(x)
    u = x @ w
    pre.append(u)
    x = jax.nn.silu(u) if layer < len(weights) - 1 else u
  delta = 2 * (x - v)
  deltas = [delta]
  for layer in range(len(weights) - 1, 0, -1):
    delta = (delta @ jnp.swapaxes(weights[layer], -1, -2)) * silu_grad(pre[layer - 1])
    deltas.append(delta)
  return tuple(zip(inputs, reversed(deltas)))
