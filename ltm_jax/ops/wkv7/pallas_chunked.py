"""Chunked Pallas backend of the RWKV-7 WKV op: the tensor-core kernels of `pallas/wkv7_chunked.py` (interpreted off
GPU), and the sequential kernels of `pallas/wkv7.py` wherever the chunked form does not apply.

The chunked kernels factor each chunk's decays as e^{g_t}·e^{-g_s}, exact while every log-decay is at least
`min_log_decay(chunk)` (-3.75 at chunk 16; RWKV-7 layers keep w >= -0.61). A caller's static bound `w_min` at or above
that limit runs them directly; otherwise inputs are checked at run time (one read of w) and any call with a stronger
decay runs the sequential kernels instead, which are exact for every w <= 0. Head sizes the chunked kernels have no
spill-free settings for (`wkv7_chunked.fits`: powers of two from 16 to 128 with 16-bit inputs, to 32 with float32)
take the sequential kernels statically.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from ltm_jax.ops import sharding
from ltm_pallas import wkv7 as sequential
from ltm_pallas import wkv7_chunked as chunked


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    w_min: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by the chunked kernels, or the sequential ones out of their range; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv7.wkv7`. The kernels' settings are their defaults for the head size.
  """
  if not chunked.fits(r.shape[-1], chunked.operand_dtype(r.dtype)):
    return sequential.wkv7(r, w, k, v, a, b, state, optimize_remat=not sharding.inside_shard_map())
  return in_range_or_sequential(chunked.wkv7, r, w, k, v, a, b, state, w_min=w_min)


def in_range_or_sequential(kernels, r, w, k, v, a, b, state, *, w_min=None):
  """`kernels(r, w, k, v, a, b, state, optimize_remat=...)`, a chunked form, where every log-decay is in the chunked
  kernels' range, the sequential kernels otherwise: statically when the caller's bound `w_min` (w >= w_min) is
  within the range, else by a run-time `lax.cond` on one read of w.

  Differentiated, a `lax.cond` keeps the residuals of both branches, and the branch taken writes zeros for the
  other's that no residual of its own can share (JAX shares a slot between residuals of one shape and dtype): the
  sequential kernels' float32 checkpoints, [B, H, T / 16, N, N], eight times one bfloat16 input at N = 64. The
  sequential branch therefore runs under `jax.checkpoint` and keeps only its inputs, which the chunked branch keeps
  too; its backward, on the rare inputs outside the chunked range, runs its forward again."""
  optimize = not sharding.inside_shard_map()
  chunk = chunked.settings(r.shape[-1], chunked.operand_dtype(r.dtype))["chunk"]
  run_chunked = functools.partial(kernels, optimize_remat=optimize)
  if chunked.bounded(w_min, chunk):
    return run_chunked(r, w, k, v, a, b, state)
  # Without the custom_vjp's own remat optimisation: under this explicit checkpoint it gains nothing on so rare a
  # branch, and with it a second derivative fails inside JAX instead of raising the kernels' one-line refusal.
  run_sequential = jax.checkpoint(functools.partial(sequential.wkv7, optimize_remat=False))
  return lax.cond(chunked.in_range(w, chunk), run_chunked, run_sequential, r, w, k, v, a, b, state)
