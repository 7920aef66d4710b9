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
            (in x's dtype) and of d (the same values in d's dtype: the add's convert; not written again when d has
            x's dtype), and each program's partial sums of ds and db ([R / program rows, C] float32, summed outside;
            a program takes BACKWARD_STEPS blocks of rows in turn).

Bytes per element of [R, C] with a float32 stream and a bfloat16 d and h: forward 12 (x, d read; x_new, h written),
backward 16 (x_new, dh, dx_new read; dx, dd written; with a bfloat16 stream and d, 8: dd is dx), against XLA's two
passes forward (the add with the statistics' reduction, then the normalisation re-reading x_new) and three or four
backward.

Lowering: Triton on GPU, `interpret=True` on CPU. A block spans `padded(C)` columns, the power of two at or above C
(a Triton block's sizes are powers of two), its columns past C masked; rows are taken in blocks of a power of two
dividing R, at least MIN_BLOCK_ROWS (`supported`, `row_block`).
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
# the backward keeps about six such tiles live; 8 rows there keep it within the registers. Wider rows take fewer
# (`row_block`): 16 rows of a 1024-wide block took 170 registers forward (sm_90a), 12% occupancy.
BLOCK_ROWS = 16
BACKWARD_BLOCK_ROWS = 8
# Row steps a backward program takes in turn, summing its ds and db partials in registers: the partial sums it writes
# ([R / (8 * 8), C] float32 each, read back by one reduction) are then a sixteenth of the stream's bytes, not a half.
BACKWARD_STEPS = 8
BLOCK_ELEMENTS = 16 * 512  # Forward; the backward takes half as many.
NUM_WARPS = 8
_SECOND_ORDER = ("add_norm: impl='pallas' (the Pallas residual-add and norm kernels) has no second derivative; "
                 "impl='xla' has one")


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def padded(channels: int) -> int:
  """The block width for C = `channels`: the power of two at or above it (a Triton block's sizes are powers of two;
  the columns past C are masked)."""
  return 1 << (channels - 1).bit_length()


def row_block(rows: int, channels: int) -> int:
  """The forward's row block for R = `rows` rows of C = `channels`: the largest power of two dividing R, at most
  BLOCK_ROWS and BLOCK_ELEMENTS / padded(C) (at least MIN_BLOCK_ROWS where R allows)."""
  return block_rows_for(rows, max(MIN_BLOCK_ROWS, min(BLOCK_ROWS, BLOCK_ELEMENTS // padded(channels))))


def supported(rows: int, channels: int) -> bool:
  """Whether the kernels take R = `rows` rows: a row block of at least MIN_BLOCK_ROWS (else use the XLA form). Any C
  is taken, in a block of `padded(C)` columns."""
  return row_block(rows, channels) >= MIN_BLOCK_ROWS


def _masked_memory():
  """The Triton lowering's masked load and store (`jax.experimental.pallas.triton`), imported only when a kernel with
  masked columns is traced: the library imports, and its other kernels interpret, on a jax without that module."""
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
  return pl_triton


class _Columns:
  """Loads and stores of a block `width` columns wide over an array of `c` columns: plain when they are equal, masked
  past column c otherwise (masked loads read zeros, so sums over a row count only its c channels)."""

  def __init__(self, c: int, width: int):
    self.c, self.masked = c, c != width
    self.mask = jax.lax.broadcasted_iota(jnp.int32, (width,), 0) < c if self.masked else None

  def load(self, ref):
    if not self.masked:
      return ref[...]
    mask = self.mask if len(ref.shape) == 1 else jnp.broadcast_to(self.mask[None, :], ref.shape)
    return _masked_memory().load(ref, mask=mask, other=0)

  def store(self, ref, value):
    if not self.masked:
      ref[...] = value
      return
    mask = self.mask if len(ref.shape) == 1 else jnp.broadcast_to(self.mask[None, :], ref.shape)
    _masked_memory().store(ref, value, mask=mask)

  def mean(self, x):
    return jnp.sum(x, axis=1, keepdims=True) / self.c


def _statistics(x, cols, kind, eps):
  """(x - mean, 1 / sqrt(var + eps)) per row of a float32 [rows, width] tile whose masked columns are zero; the
  mean is zero for rmsnorm, and x - mean stays zero in the masked columns."""
  xc = x
  if kind == "layernorm":
    xc = x - cols.mean(x)
    if cols.masked:
      xc = jnp.where(cols.mask[None, :], xc, 0.0)
  return xc, jax.lax.rsqrt(cols.mean(xc * xc) + eps)


def _forward_kernel(x_ref, d_ref, s_ref, b_ref, xnew_ref, h_ref, *, c, kind, eps):
  cols = _Columns(c, x_ref.shape[1])
  x_new = (cols.load(x_ref).astype(jnp.float32) + cols.load(d_ref).astype(jnp.float32)).astype(xnew_ref.dtype)
  cols.store(xnew_ref, x_new)
  xc, rstd = _statistics(x_new.astype(jnp.float32), cols, kind, eps)
  h = xc * rstd * cols.load(s_ref)[None, :]
  if kind == "layernorm":
    h = h + cols.load(b_ref)[None, :]
  cols.store(h_ref, h.astype(h_ref.dtype))


def _backward_kernel(xnew_ref, s_ref, dxnew_ref, dh_ref, *out_refs, c, kind, eps, sub_rows):
  """A program's rows in `sub_rows`-row steps (as many rows as the registers hold at once), its partial sums of ds
  and db carried across them. `out_refs`: dx, dd (absent when d has x's dtype: the same values), ds, db."""
  dx_ref, *dd_ref, ds_ref, db_ref = out_refs
  cols = _Columns(c, xnew_ref.shape[1])
  s = cols.load(s_ref)[None, :]

  def step(j, sums):
    rows = pl.ds(pl.multiple_of(j * sub_rows, sub_rows), sub_rows)
    xc, rstd = _statistics(cols.load(xnew_ref.at[rows]).astype(jnp.float32), cols, kind, eps)
    xhat = xc * rstd
    dh = cols.load(dh_ref.at[rows]).astype(jnp.float32)  # Zero in the masked columns, as xhat: so are ds, db, dxhat.
    dxhat = dh * s
    # d(xhat)/d(x_new) projects out the directions the statistics remove: the mean (layernorm) and xhat itself.
    dxc = dxhat - xhat * cols.mean(dxhat * xhat)
    if kind == "layernorm":
      dxc = dxc - cols.mean(dxhat)
    dx = cols.load(dxnew_ref.at[rows]).astype(jnp.float32) + dxc * rstd
    for ref in (dx_ref, *dd_ref):
      cols.store(ref.at[rows], dx.astype(ref.dtype))
    return sums[0] + jnp.sum(dh * xhat, axis=0), sums[1] + jnp.sum(dh, axis=0)

  zeros = jnp.zeros((xnew_ref.shape[1],), jnp.float32)
  ds, db = jax.lax.fori_loop(0, xnew_ref.shape[0] // sub_rows, step, (zeros, zeros))
  cols.store(ds_ref, ds)
  cols.store(db_ref, db)


def _specs(c: int, block_rows: int):
  width = padded(c)
  tile = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
  per_channel = pl.BlockSpec((width,), lambda i: (0,))
  partial = pl.BlockSpec((None, width), lambda i: (i, 0))  # [R / block_rows, C] partial sums.
  return tile, per_channel, partial


def _forward(x, d, s, b, *, kind, eps, out_dtype, block_rows, interpret):
  rows, c = x.shape
  tile, per_channel, _ = _specs(c, block_rows)
  return backend.call(
      functools.partial(_forward_kernel, c=c, kind=kind, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((rows, c), x.dtype), jax.ShapeDtypeStruct((rows, c), out_dtype)),
      grid=(rows // block_rows,), in_specs=[tile, tile, per_channel, per_channel], out_specs=(tile, tile),
      num_warps=NUM_WARPS, interpret=interpret, name="add_norm_forward",
  )(x, d, s, b)


def _backward(x_new, s, dx_new, dh, d_dtype, *, kind, eps, block_rows, interpret):
  rows, c = x_new.shape
  # Powers of two: they still divide the rows.
  sub_rows = min(block_rows, BACKWARD_BLOCK_ROWS, max(1, BLOCK_ELEMENTS // 2 // padded(c)))
  program_rows = block_rows_for(rows, sub_rows * BACKWARD_STEPS)
  blocks = rows // program_rows
  tile, per_channel, partial = _specs(c, program_rows)
  sums = jax.ShapeDtypeStruct((blocks, c), jnp.float32)
  same = jnp.dtype(d_dtype) == x_new.dtype  # Then dd is dx: written once.
  grads = (jax.ShapeDtypeStruct((rows, c), x_new.dtype),)
  if not same:
    grads += (jax.ShapeDtypeStruct((rows, c), d_dtype),)
  dx, *dd, ds, db = backend.call(
      functools.partial(_backward_kernel, c=c, kind=kind, eps=eps, sub_rows=sub_rows),
      out_shape=(*grads, sums, sums),
      grid=(blocks,), in_specs=[tile, per_channel, tile, tile], out_specs=(*(tile for _ in grads), partial, partial),
      num_warps=NUM_WARPS, interpret=interpret, name="add_norm_backward",
  )(x_new, s, dx_new, dh)
  return dx, dd[0] if dd else dx, jnp.sum(ds, axis=0), jnp.sum(db, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def add_norm(x, d, s, b, kind: str, eps: float, out_dtype, block_rows: int = BLOCK_ROWS,
             interpret: bool | None = None):
  """(x_new [R, C] in x's dtype, h [R, C] in `out_dtype`), as the module docstring defines them.

  x, d: [R, C] (C a power of two); s, b: [C] float32 (rmsnorm reads no b; its gradient is then meaningless).
  `block_rows`, a power of two, must divide R (`row_block(R, C)`).
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
