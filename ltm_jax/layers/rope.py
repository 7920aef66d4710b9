"""Rotary position embeddings (rotate-half layout) at arbitrary integer positions."""

from __future__ import annotations

import jax.numpy as jnp


def apply_rope(x, positions, theta: float):
  """Rotates x [B, T, H, D] by its positions [B, T]; computed in float32, returned in x's dtype."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, D/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
