"""Mosaic GPU backend of the RWKV-7 WKV op (Hopper, sm_90 and newer): the chunked forward and backward kernels of
`pallas/wkv7_mgpu.py`, run in Mosaic GPU interpret mode off GPU (which needs jax >= 0.11, as the kernels do).

The primal runs the forward kernel alone. Under differentiation the forward kernel also writes what the backward
kernel reads as the forward's products read it (`wkv7_mgpu.Residuals`): the state entering each chunk, [B, H,
ceil(T / 64), N, N] in bfloat16, the decayed operands R̂, Ǩ, Â, B̌ in bfloat16 and the chunks' cumulative
log-decays g in float32; the backward kernel takes those with the inputs and the cotangents to all seven
gradients. A call with a decay beyond the kernels' range (w < `wkv7_mgpu.min_log_decay()`,
checked once at run time; the backward follows the forward's choice) runs the "chunked" backend (pure JAX, exact)
instead, its derivative included; a caller's static bound `w_min` within the range leaves the check out.
Head sizes other than `wkv7_mgpu.SIZES` raise ValueError, as does a GPU older than sm_90 (NotImplementedError).

Few programs over a long sequence (B·H·N/64 below the SMs, `segments` > 1: at (1, 32768, 64, 64), 64 programs and
S = 8) run the kernels parallel over time (`pallas/wkv7_segmented.py` with `mgpu_kernels`): each segment's end state
and transition by `wkv7_mgpu.end_states`, a scan, the forward from each segment's entering state, and in reverse
`wkv7_mgpu.state_gradients`, a scan, the backward. Out of range, "chunked" as above.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ltm_jax.ops.wkv7 import chunked
from ltm_jax.ops.wkv7 import pallas_segmented
from ltm_pallas import backend as kernel_backend
from ltm_pallas import wkv7_mgpu
from ltm_pallas import wkv7_segmented as segmented

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
    w_min: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by the Mosaic GPU kernels; shapes are validated by the caller (`ltm_jax.ops.wkv7.wkv7`), whose arguments
  (`w_min` included) and results these are. `interpret`: Mosaic GPU interpret mode (None: unless the default backend
  is a GPU)."""
  size = r.shape[-1]
  if not wkv7_mgpu.supported(size):
    raise ValueError(f"wkv7: impl='pallas_mgpu' takes head sizes {wkv7_mgpu.SIZES}, got {size}; impl='pallas_chunked' "
                     "or 'chunked' take any")
  checked = not wkv7_mgpu.bounded(w_min)
  count = segments(*r.shape)
  if count > 1:
    # No remat optimization, as for the unsegmented kernels: interpret mode's callbacks are side effects it refuses.
    run = functools.partial(segmented.run_segments, segmented.mgpu_kernels(interpret), count, optimize_remat=False)
    if not checked:
      return run(r, w, k, v, a, b, state)
    # The XLA fallback under jax.checkpoint: differentiated, the cond keeps both branches' residuals, and the
    # kernels' branch would write zeros for every per-chunk intermediate of the fallback's (~50x its inputs).
    return lax.cond(wkv7_mgpu.in_range(w), run, jax.checkpoint(chunked.wkv7), r, w, k, v, a, b, state)
  return _differentiable(interpret, checked)(r, w, k, v, a, b, state)


def segments(batch: int, length: int, heads: int, size: int) -> int:
  """How many segments a [B, T, H, N] sequence is cut into (`pallas/wkv7_segmented.py` with the Mosaic GPU kernels):
  `pallas_segmented`'s rule (its SM_COUNT, PROGRAMS_PER_SM and MIN_SEGMENT) for the kernels' B·H·N/64 programs.
  1 runs the kernels on the whole sequence."""
  return pallas_segmented.segment_count(batch * heads * (size // wkv7_mgpu.BLOCK), length)


@functools.lru_cache(maxsize=None)
def _differentiable(interpret: bool | None, checked: bool):
  """The kernels as one differentiable function; with `checked`, each call checks w's range at run time and takes
  the "chunked" backend beyond it (the backward follows the forward's choice), else it runs the kernels alone."""
  forward = functools.partial(wkv7_mgpu.forward, interpret=interpret)

  @jax.custom_vjp
  def run(r, w, k, v, a, b, state):
    if not checked:
      return forward(r, w, k, v, a, b, state)
    return lax.cond(wkv7_mgpu.in_range(w), forward, chunked.wkv7, r, w, k, v, a, b, state)

  def run_fwd(*inputs):
    inputs = kernel_backend.first_order_only(_SECOND_ORDER, *inputs)
    with_states = functools.partial(forward, checkpoints=True)

    def beyond_range(*x):
      y, final = chunked.wkv7(*x)
      residuals = jax.eval_shape(with_states, *x)[2]
      return y, final, jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), residuals)

    if not checked:
      y, final, states = with_states(*inputs)
      return (y, final), (inputs, states, None)
    kernels = wkv7_mgpu.in_range(inputs[1])
    y, final, states = lax.cond(kernels, with_states, beyond_range, *inputs)
    return (y, final), (inputs, states, kernels)

  def run_bwd(residuals, cotangents):
    residuals, cotangents = kernel_backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
    inputs, states, kernels = residuals
    dy, dstate = cotangents

    def kernel(inputs, states, dy, dstate):
      grads = wkv7_mgpu.backward(*inputs[:6], states, dy, dstate, interpret=interpret)
      return (*grads[:6], grads[6].astype(inputs[6].dtype))

    def beyond_range(inputs, states, dy, dstate):
      del states
      return jax.vjp(chunked.wkv7, *inputs)[1]((dy, dstate))

    if not checked:
      return kernel(inputs, states, dy, dstate)
    return lax.cond(kernels, kernel, beyond_range, inputs, states, dy, dstate)

  run.defvjp(run_fwd, run_bwd)
  return run
