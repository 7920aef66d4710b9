"""Per-token reference of the neural memory op: online gradient descent with momentum and forgetting.

One token at a time, with autodiff doing the memory's gradient, taken at the weights its chunk started with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ltm_jax.ops.neural_memory import mlp


def neural_memory(q, k, v, eta, theta, alpha, update, weights, momentum, anchor, phase, *, chunk: int):
  """See `ltm_jax.ops.neural_memory.neural_memory`; inputs already in the compute dtype.

  q, k, v: [B, T, H, N]; eta, theta, alpha: [B, T, H]; update: [B, T] bool; weights, momentum, anchor: tuples of
  [B, H, d_in, d_out]; phase: [B] int32. Returns (y, weights, momentum, anchor, phase).
  """

  def loss(w, key, value):  # One head's associative loss on one token.
    return jnp.sum((mlp.apply(w, key) - value) ** 2)

  grad = jax.vmap(jax.vmap(jax.grad(loss)))  # Over batch rows, then heads.
  per_row = lambda keep, new, old: jax.tree.map(
      lambda n, o: jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)), n, o), new, old)

  def step(carry, token):
    w, s, a, p = carry
    q_t, k_t, v_t, eta_t, theta_t, alpha_t, update_t = token
    a = per_row(update_t & (p % chunk == 0), w, a)  # A chunk starts: its gradients are taken here.
    g = grad(a, k_t, v_t)
    gate = lambda x: x[:, :, None, None]
    new_s = tuple(gate(eta_t) * si - gate(theta_t) * gi for si, gi in zip(s, g))
    new_w = tuple(gate(1 - alpha_t) * wi + si for wi, si in zip(w, new_s))
    w, s = per_row(update_t, new_w, w), per_row(update_t, new_s, s)
    p = p + update_t.astype(p.dtype)
    return (w, s, a, p), jax.vmap(jax.vmap(mlp.apply))(w, q_t)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  tokens = tuple(map(time_major, (q, k, v, eta, theta, alpha, update)))
  (weights, momentum, anchor, phase), y = lax.scan(step, (weights, momentum, anchor, phase), tokens)
  # The chunk the next token falls in: a fresh one (anchored at the final weights) when the phase wraps.
  anchor = per_row(phase % chunk == 0, weights, anchor)
  return time_major(y), weights, momentum, anchor, phase % chunk
