"""Reference backend of the quantised matmul: per-group products in float32, then the scales, in plain jnp. Products
are float32 whatever x's dtype (XLA on a CPU has no bfloat16 dot with a float32 result)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_int4(packed: jax.Array) -> jax.Array:
  """int8 [..., rows, N] of packed nibbles -> int8 [..., 2 * rows, N]: low nibbles, then high nibbles."""
  return jnp.concatenate([jnp.right_shift(jnp.left_shift(packed, 4), 4), jnp.right_shift(packed, 4)], axis=-2)


def quant_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, packed: bool) -> jax.Array:
  """x [M, K], values [G, rows, N] int8, scale [G, N] -> [M, N] in x's dtype."""
  groups = values.shape[0]
  weights = (unpack_int4(values) if packed else values).astype(jnp.float32)  # [G, group, N]
  parts = jnp.einsum("mgk,gkn->mgn", x.astype(jnp.float32).reshape(x.shape[0], groups, -1), weights)
  return jnp.einsum("mgn,gn->mn", parts, scale.astype(jnp.float32)).astype(x.dtype)
