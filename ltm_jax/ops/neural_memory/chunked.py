"""Chunked backend of the neural memory op: the parallel form, where a chunk's gradients are all taken at the
weights the chunk starts with, so its updates are matrix products.

Within a chunk (tokens 1..C, W_0 and S_0 the weights and momentum entering it, mu_t the update mask), unrolling
S_t = eta_t S_{t-1} - theta_t g_t and W_t = (1 - alpha_t) W_{t-1} + mu_t S_t gives, for every layer of the memory,

  W_t = B_t W_0 + gamma_t S_0 - sum_{s<=t} D[t, s] a_s d_s^T,      S_C = P_C S_0 - sum_s E[C, s] theta_s a_s d_s^T,

with g_s = a_s d_s^T the rank-one gradient of token s at W_0 (layer input a_s, output delta d_s), P_t and B_t the
cumulative products of eta and (1 - alpha) from the chunk start, E[t, s] = prod_{s<r<=t} eta_r,
F[t, u] = prod_{u<r<=t} (1 - alpha_r), gamma = (F mu) P and D = (F mu) E theta. Reading a query through W_t then needs
no per-token weights: a layer maps x_t to B_t x_t W_0 + gamma_t x_t S_0 - sum_s D[t, s] (x_t . a_s) d_s, an
attention-like product over the chunk. The pairwise products E and F come from sums of logarithms over each span
(never a ratio of two cumulative products), so they stay in [0, 1] whatever the gates. With chunk 1 this is the
per-token recurrence exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ltm_jax.ops.neural_memory import mlp


def _span_products(log_gate: jax.Array) -> jax.Array:
  """[..., C] log-gates -> [..., C, C] with [t, s] = prod_{s<r<=t} gate_r for s <= t, 0 above the diagonal."""
  size = log_gate.shape[-1]
  rows = jnp.arange(size)
  strictly_after = rows[:, None] > rows[None, :]
  spans = jnp.cumsum(jnp.where(strictly_after, log_gate[..., :, None], 0), axis=-2)
  return jnp.where(rows[:, None] >= rows[None, :], jnp.exp(spans), 0)


def _chunk(weights, momentum, anchor, q, k, v, eta, theta, alpha, update):
  """One chunk: weights, momentum, anchor (where the gradients are taken) tuples of [B, H, d_in, d_out]; q, k, v
  [B, H, C, N]; eta, theta, alpha, update [B, H, C] (update 0 or 1). Returns the state after it and y [B, H, C, N]."""
  tiny = jnp.finfo(q.dtype).tiny  # Gates of exactly 0 would make log-space sums -inf; tiny products round to 0.
  log_eta = jnp.log(jnp.maximum(eta, tiny))
  log_keep = jnp.log(jnp.maximum(1 - alpha, tiny))
  carried = jnp.exp(jnp.cumsum(log_eta, axis=-1))  # P_t.
  kept = jnp.exp(jnp.cumsum(log_keep, axis=-1))  # B_t.
  momentum_span = _span_products(log_eta)  # E.
  applied = _span_products(log_keep) * update[..., None, :]  # F mu.
  gamma = jnp.einsum("...tu,...u->...t", applied, carried)
  mix = (applied @ momentum_span) * theta[..., None, :]  # D.
  factors = mlp.outer_factors(anchor, k, v)
  transpose = lambda a: jnp.swapaxes(a, -1, -2)

  x = q
  for layer, (w, s, (a, d)) in enumerate(zip(weights, momentum, factors)):
    x = kept[..., None] * (x @ w) + gamma[..., None] * (x @ s) - (mix * (x @ transpose(a))) @ d
    if layer < len(weights) - 1:
      x = jax.nn.silu(x)

  # The state after the chunk's last token: the formulas above at t = C, the sums over s as one product each.
  scalar = lambda c: c[..., None, None]
  summed = lambda a, coeffs, d: transpose(a) @ (coeffs[..., None] * d)  # sum_s coeffs[s] outer(a_s, d_s).
  last_step = momentum_span[..., -1, :] * theta
  new_weights = tuple(scalar(kept[..., -1]) * w + scalar(gamma[..., -1]) * s - summed(a, mix[..., -1, :], d)
                      for w, s, (a, d) in zip(weights, momentum, factors))
  new_momentum = tuple(scalar(carried[..., -1]) * s - summed(a, last_step, d) for s, (a, d) in zip(momentum, factors))
  return new_weights, new_momentum, x


def _grid(update: jax.Array, phase: jax.Array, chunk: int):
  """Where each row's tokens go on a grid of whole chunks, so that every row's chunks start at its own boundaries.

  A row's valid tokens (update [B, T] True) keep their order and are placed contiguously from the first grid index
  at or after its padding that is = phase (mod chunk); the rest of the grid is masked. The grid has room for a
  partial chunk at either end, one chunk more than the tokens need at most.
  Returns (source [B, L]: the input index each grid slot reads, or -1 for a masked slot; first [B]; count [B])."""
  batch, length = update.shape
  count = jnp.sum(update, axis=1, dtype=jnp.int32)
  order = jnp.argsort(~update, axis=1, stable=True)  # Valid tokens first, in order.
  pad = length - count
  first = pad + (phase - pad) % chunk
  grid_length = -(-(length + chunk - 1) // chunk) * chunk
  slot = jnp.arange(grid_length)[None, :] - first[:, None]  # The slot's rank among the row's valid tokens.
  inside = (slot >= 0) & (slot < count[:, None])
  source = jnp.where(inside, jnp.take_along_axis(order, jnp.clip(slot, 0, length - 1), axis=1), -1)
  return source, first, count


def neural_memory(q, k, v, eta, theta, alpha, update, weights, momentum, anchor, phase, *, chunk: int):
  """See `ltm_jax.ops.neural_memory.neural_memory`; inputs already in the compute dtype.

  q, k, v: [B, T, H, N]; eta, theta, alpha: [B, T, H]; update: [B, T] bool; weights, momentum, anchor: tuples of
  [B, H, d_in, d_out]; phase: [B] int32. Returns (y, weights, momentum, anchor, phase).
  """
  batch, length, heads, _ = q.shape
  source, first, count = _grid(update, phase, chunk)
  on_grid = source >= 0
  gather = lambda x: jnp.take_along_axis(x, jnp.maximum(source, 0).reshape(source.shape + (1,) * (x.ndim - 2)),
                                         axis=1)
  # Masked slots leave the state as it is: no gradient step, momentum carried, nothing forgotten, nothing applied.
  masked = lambda x, value: jnp.where(on_grid.reshape(on_grid.shape + (1,) * (x.ndim - 2)), gather(x), value)
  q, k, v, theta, alpha = (masked(x, 0) for x in (q, k, v, theta, alpha))
  eta = masked(eta, 1)
  slot_update = jnp.broadcast_to(on_grid[..., None], eta.shape).astype(q.dtype)  # [B, L, H]
  n_chunks = source.shape[1] // chunk

  def chunked(x):  # [B, L, H, ...] -> [n_chunks, B, H, C, ...]
    x = x.reshape((batch, n_chunks, chunk, heads) + x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

  per_row = lambda keep, new, old: tuple(jnp.where(keep[:, None, None, None], n, o) for n, o in zip(new, old))
  start_chunk, next_chunk = first // chunk, (first + count) // chunk

  def body(carry, inputs):
    w, s, next_anchor = carry
    index, *chunk_inputs = inputs
    # The chunk holding a row's first valid token continues the chunk the state is in, anchored where it started
    # (at phase 0 that is the incoming weights themselves, which is where the gradient must flow).
    a = per_row((index == start_chunk) & (phase > 0), anchor, w)
    next_anchor = per_row(index == next_chunk, a, next_anchor)
    w, s, y = _chunk(w, s, a, *chunk_inputs)
    return (w, s, next_anchor), y

  inputs = (jnp.arange(n_chunks),) + tuple(map(chunked, (q, k, v, eta, theta, alpha, slot_update)))
  (weights, momentum, next_anchor), y = lax.scan(body, (weights, momentum, anchor), inputs)
  y = jnp.moveaxis(y, 0, 1)  # [B, n_chunks, H, C, N]
  y = jnp.swapaxes(y, 2, 3).reshape(batch, n_chunks * chunk, heads, y.shape[-1])
  # Back to the input order: token i of a row sits at grid slot first + (its rank among the valid tokens).
  rank = jnp.cumsum(update, axis=1, dtype=jnp.int32) - 1
  y = jnp.take_along_axis(y, (first[:, None] + jnp.maximum(rank, 0))[..., None, None], axis=1)
  end = first + count
  next_anchor = per_row(end % chunk == 0, weights, next_anchor)
  return y, weights, momentum, next_anchor, end % chunk
