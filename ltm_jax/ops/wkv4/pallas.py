"""Pallas backend of the RWKV-4 WKV op: the fused forward and backward kernels of `ltm_pallas.wkv4`.

Triton on GPU, the Pallas interpreter elsewhere (slow: the CPU suite uses it to check numerics, not for speed).
"""

from __future__ import annotations

import jax

from ltm_jax.ops import sharding
from ltm_pallas import wkv4 as kernel


def wkv4(
    w: jax.Array,
    u: jax.Array,
    k: jax.Array,
    v: jax.Array,
    state: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """WKV by the Pallas kernels; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv4.wkv4`, with `state` a plain (num, den, max) tuple of [B, C] float32.
  The kernel's default chunk and channel block apply, and it parallelises over T by itself when B·C is small.
  """
  return kernel.wkv4(w, u, k, v, state, optimize_remat=not sharding.inside_shard_map())
