"""Mosaic GPU backend of the RWKV-7 WKV op (Hopper, sm_90 and newer): the chunked forward kernel of
`pallas/wkv7_mgpu.py`, run in Mosaic GPU interpret mode off GPU (which needs jax >= 0.11, as the kernel does).

Forward only so far: the derivative is the "chunked" backend's (pure JAX, exact), taken by recomputing that backend's
forward from the saved inputs, so a gradient costs the chunked form's forward and backward on top of the kernel. A
call with a decay beyond the kernel's range (w < `wkv7_mgpu.min_log_decay()`, checked at run time) runs "chunked"
entirely. Head sizes other than `wkv7_mgpu.SIZES` raise ValueError, as does a GPU older than sm_90
(NotImplementedError).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from ltm_jax.ops.wkv7 import chunked
from ltm_pallas import backend as kernel_backend
from ltm_pallas import wkv7_mgpu

_SECOND_ORDER = ("wkv7: impl='pallas_mgpu' (a Mosaic GPU kernel) has no second derivative; impl='scan' and "
                 "impl='chunked' are differentiable to any order")


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by the Mosaic GPU forward kernel; shapes are validated by the caller (`ltm_jax.ops.wkv7.wkv7`), whose
  arguments and results these are. `interpret`: Mosaic GPU interpret mode (None: unless compiling for a GPU)."""
  size = r.shape[-1]
  if not wkv7_mgpu.supported(size):
    raise ValueError(f"wkv7: impl='pallas_mgpu' takes head sizes {wkv7_mgpu.SIZES}, got {size}; impl='pallas_chunked' "
                     "or 'chunked' take any")
  return _differentiable(interpret)(r, w, k, v, a, b, state)


@functools.lru_cache(maxsize=None)
def _differentiable(interpret: bool | None):
  forward = functools.partial(wkv7_mgpu.forward, interpret=interpret)

  def run_forward(r, w, k, v, a, b, state):
    return lax.cond(wkv7_mgpu.in_range(w), forward, chunked.wkv7, r, w, k, v, a, b, state)

  @jax.custom_vjp
  def run(r, w, k, v, a, b, state):
    return run_forward(r, w, k, v, a, b, state)

  def run_fwd(*inputs):
    inputs = kernel_backend.first_order_only(_SECOND_ORDER, *inputs)
    return run_forward(*inputs), inputs

  def run_bwd(inputs, cotangents):
    inputs, cotangents = kernel_backend.first_order_only(_SECOND_ORDER, inputs, cotangents)
    _, pullback = jax.vjp(chunked.wkv7, *inputs)
    return pullback(cotangents)

  run.defvjp(run_fwd, run_bwd)
  return run
