"""Pallas kernels for a residual add and the norm after it (a block's sub-layer output added to the residual stream,
then the next sub-layer's LayerNorm or RMSNorm), in one pass forward and one pass backward, tied by a
`jax.custom_vjp`.

With x [R, C] the residual stream, d [R, C] a sub-layer's output and s, b [C] the norm's scale and bias:

  x_new = x + d                                         (rounded to x's dtype: the stream's own dtype)
  h = (x_new - mean) * rsqrt(var + eps) * s + b         (layernorm; per row over its C channels)
  h = x_new * rsqrt(mean(x_new^2) + eps) * s            (rmsnorm: no mean, no bias)

Arithmetic is float32 whatever the inputs' dtypes; h is rounded once, to `out_dtype`.

Kernels (grid over blocks of whole rows: the norm's statistics need every channel of a row):
  forward:  reads x, d; writes x_new and h.
  backward: reads x_new and the cotangents of x_new and h; recomputes the statistics and writes the gradient of x
            (in x's dtype) and of d (the same values in d's dtype: the add's convert), and each row block's partial
            sums of ds and db ([R / block_rows, C] float32, summed outside).

Bytes per element of [R, C] with a float32 stream and a bfloat16 d and h: forward 12 (x, d read; x_new, h written),
backward 16 (x_new, dh, dx_new read; dx, dd written), against XLA's two passes forward (the add with the statistics'
reduction, then the normalisation re-reading x_new) and three or four backward.

Lowering: Triton on GPU, `interpret=True` on CPU. C must be a power of two (a Triton block is); rows are taken in
blocks of a power of two dividing R, at least MIN_BLOCK_ROWS (`supported`, `block_rows_for`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend
from ltm_pallas.rwkv7_out import MIN_BLOCK_ROWS, block_rows_for  # noqa: F401  (the same row tiling)

KINDS = ("layernorm", "rmsnorm")
# A program holds whole rows of C channels: at C = 512 a 16-row float32 tile is 32 values a thread on 8 warps, and
# the backward keeps about six such tiles live; 8 rows there keep it within the registers.
BLOCK_ROWS = 16
BACKWARD_BLOCK_ROWS = 8
NUM_WARPS = 8
_SECOND_ORDER = ("rwkv7_norm: impl='pallas' (the Pallas residual-add and norm kernels) has no second derivative; "
                 "impl='xla' has one")


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def supported(rows: int, channels: int) -> bool:
  """Whether the kernels take R = `rows` rows of C = `channels`: C a power of two and a row block of at least
  MIN_BLOCK_ROWS (else use the XLA form)."""
  return _pow2(channels) and block_rows_for(rows, BLOCK_ROWS) >= MIN_BLOCK_ROWS


def _statistics(x, kind, eps):
  """(x - mean, 1 / sqrt(var + eps)) per row of a float32 [rows, C] tile; the mean is zero for rmsnorm."""
  xc = x - jnp.mean(x, axis=1, keepdims=True) if kind == "layernorm" else x
  return xc, jax.lax.rsqrt(jnp.mean(xc * xc, axis=1, keepdims=True) + eps)


def _forward_kernel(x_ref, d_ref, s_ref, b_ref, xnew_ref, h_ref, *, kind, eps):
  x_new = (x_ref[...].astype(jnp.float32) + d_ref[...].astype(jnp.float32)).astype(xnew_ref.dtype)
  xnew_ref[...] = x_new
  xc, rstd = _statistics(x_new.astype(jnp.float32), kind, eps)
  h = xc * rstd * s_ref[...][None, :]
  if kind == "layernorm":
    h = h + b_ref[...][None, :]
  h_ref[...] = h.astype(h_ref.dtype)


def _backward_kernel(xnew_ref, s_ref, dxnew_ref, dh_ref, dx_ref, dd_ref, ds_ref, db_ref, *, kind, eps):
  xc, rstd = _statistics(xnew_ref[...].astype(jnp.float32), kind, eps)
  xhat = xc * rstd
  dh = dh_ref[...].astype(jnp.float32)
  ds_ref[...] = jnp.sum(dh * xhat, axis=0)
  db_ref[...] = jnp.sum(dh, axis=0)
  dxhat = dh * s_ref[...][None, :]
  # d(xhat)/d(x_new) projects out the directions the statistics remove: the mean (layernorm) and xhat itself.
  dxc = dxhat - xhat * jnp.mean(dxhat * xhat, axis=1, keepdims=True)
  if kind == "layernorm":
    dxc = dxc - jnp.mean(dxhat, axis=1, keepdims=True)
  dx = dxnew_ref[...].astype(jnp.float32) + dxc * rstd
  dx_ref[...] = dx.astype(dx_ref.dtype)
  dd_ref[...] = dx.astype(dd_ref.dtype)


def _specs(c: int, block_rows: int):
  tile = pl.BlockSpec((block_rows, c), lambda i: (i, 0))
  per_channel = pl.BlockSpec((c,), lambda i: (0,))
  partial = pl.BlockSpec((None, c), lambda i: (i, 0))  # [R / block_rows, C] partial sums.
  return tile, per_channel, partial


def _forward(x, d, s, b, *, kind, eps, out_dtype, block_rows, interpret):
  rows, c = x.shape
  tile, per_channel, _ = _specs(c, block_rows)
  return backend.call(
      functools.partial(_forward_kernel, kind=kind, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((rows, c), x.dtype), jax.ShapeDtypeStruct((rows, c), out_dtype)),
      grid=(rows // block_rows,), in_specs=[tile, tile, per_channel, per_channel], out_specs=(tile, tile),
      num_warps=NUM_WARPS, interpret=interpret, name="rwkv7_norm_forward",
  )(x, d, s, b)


def _backward(x_new, s, dx_new, dh, d_dtype, *, kind, eps, block_rows, interpret):
  rows, c = x_new.shape
  block_rows = min(block_rows, BACKWARD_BLOCK_ROWS)  # Powers of two: it still divides the rows.
  blocks = rows // block_rows
  tile, per_channel, partial = _specs(c, block_rows)
  sums = jax.ShapeDtypeStruct((blocks, c), jnp.float32)
  dx, dd, ds, db = backend.call(
      functools.partial(_backward_kernel, kind=kind, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((rows, c), x_new.dtype), jax.ShapeDtypeStruct((rows, c), d_dtype), sums, sums),
      grid=(blocks,), in_specs=[tile, per_channel, tile, tile], out_specs=(tile, tile, partial, partial),
      num_warps=NUM_WARPS, interpret=interpret, name="rwkv7_norm_backward",
  )(x_new, s, dx_new, dh)
  return dx, dd, jnp.sum(ds, axis=0), jnp.sum(db, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def add_norm(x, d, s, b, kind: str, eps: float, out_dtype, block_rows: int = BLOCK_ROWS,
             interpret: bool | None = None):
  """(x_new [R, C] in x's dtype, h [R, C] in `out_dtype`), as the module docstring defines them.

  x, d: [R, C] (C a power of two); s, b: [C] float32 (rmsnorm reads no b; its gradient is then meaningless).
  `block_rows`, a power of two, must divide R (`block_rows_for(R, BLOCK_ROWS)`).
  """
  return _forward(x, d, s, b, kind=kind, eps=eps, out_dtype=out_dtype, block_rows=block_rows, interpret=interpret)


def _add_norm_fwd(x, d, s, b, kind, eps, out_dtype, block_rows, interpret):
  x, d, s, b = backend.first_order_only(_SECOND_ORDER, x, d, s, b)
  x_new, h = _forward(x, d, s, b, kind=kind, eps=eps, out_dtype=out_dtype, block_rows=block_rows,
                      interpret=interpret)
  # d's zero-size stand-in carries only its dtype to the backward.
  return (x_new, h), (x_new, s, jnp.zeros((0,), d.dtype))


def _add_norm_bwd(kind, eps, out_dtype, block_rows, interpret, residuals, cotangents):
  residuals, cotangents = backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
  x_new, s, d_like = residuals
  dx_new, dh = cotangents
  return _backward(x_new, s, dx_new.astype(x_new.dtype), dh, d_like.dtype, kind=kind, eps=eps,
                   block_rows=block_rows, interpret=interpret)


add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)
