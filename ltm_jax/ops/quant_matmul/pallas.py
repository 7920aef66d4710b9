"""Pallas backend of the quantised matmul: `ltm_pallas.quant_matmul` (Triton on GPU, the interpreter elsewhere)."""

from __future__ import annotations

import jax

from ltm_pallas import quant_matmul as kernel

supported = kernel.supported


def quant_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, packed: bool) -> jax.Array:
  """x [M, K], values [G, rows, N] int8, scale [G, N] -> [M, N]; shapes as `kernel.supported` allows."""
  return kernel.quant_matmul(x, values, scale, packed=packed)
