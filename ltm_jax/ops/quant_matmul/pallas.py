"""Pallas backend of the quantised matmul: `ltm_pallas.quant_matmul` (Triton on GPU, the interpreter elsewhere).

The kernel computes the product; its derivatives come from the XLA reference. The product is linear in x and in the
scales, so its tangent is the reference product of the tangents, which XLA transposes for reverse mode and
differentiates again to any order (the integer values have no tangent).
"""

from __future__ import annotations

import functools

import jax

from ltm_jax.ops.quant_matmul import xla
from ltm_pallas import quant_matmul as kernel

supported = kernel.supported


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def quant_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, packed: bool) -> jax.Array:
  """x [M, K], values [G, rows, N] int8, scale [G, N] -> [M, N]; shapes as `kernel.supported` allows."""
  return kernel.quant_matmul(x, values, scale, packed=packed)


@quant_matmul.defjvp
def _tangent(packed, primals, tangents):
  x, values, scale = primals
  dx, _, dscale = tangents
  y = quant_matmul(x, values, scale, packed)
  dy = xla.quant_matmul(dx, values, scale, packed) + xla.quant_matmul(x, values, dscale, packed)
  return y, dy.astype(y.dtype)
