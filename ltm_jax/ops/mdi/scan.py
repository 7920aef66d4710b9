"""Per-token reference of the MDI recurrence: one `lax.scan` step per token, gradients by autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def step(h, gate_z, z, gamma, keep, w_h, scale, *, eps: float, clip: float):
  """One token for every row: h [B, D] (h_{t-1}); gate_z, z, gamma [B, D]; keep [B] (1: a real token, 0: padding,
  which leaves h as it was); w_h [D, D]; scale [D]. Returns h_t [B, D]."""
  g = jax.nn.sigmoid(gate_z + h @ w_h)
  u = (1 - g) * h + g * z + gamma * h
  normed = u * lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps) * scale
  new = jnp.clip(normed, -clip, clip)
  return jnp.where(keep[:, None] > 0, new, h)


def mdi(gate_z, z, gamma, keep, w_h, scale, h0, *, eps: float, clip: float):
  """See `ltm_jax.ops.mdi.mdi`; inputs already in the compute dtype, keep [B, T] in it too.
  Returns (hs [B, T, D], h_T [B, D])."""

  def body(h, token):
    h = step(h, *token, w_h, scale, eps=eps, clip=clip)
    return h, h

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  h, hs = lax.scan(body, h0, tuple(map(time_major, (gate_z, z, gamma, keep))))
  return time_major(hs), h
