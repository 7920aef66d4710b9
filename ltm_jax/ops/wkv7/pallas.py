"""Pallas backend of the RWKV-7 WKV op: the fused kernels of `pallas/wkv7.py` (interpreted off GPU)."""

from __future__ import annotations

import jax

from ltm_jax.ops import sharding
from ltm_pallas import wkv7 as kernels


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by the fused kernels; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv7.wkv7`. The kernels' block sizes are their defaults.
  """
  return kernels.wkv7(r, w, k, v, a, b, state, optimize_remat=not sharding.inside_shard_map())
