"""Pallas kernel for the backward of a norm followed by token-shift mixes (a token-shift sub-layer's input stage), in
one pass over the rows.

The forward, with x [R, C] the residual stream's rows (sequences of T tokens laid end to end), s, b [C] the norm's
scale and bias and mu [M, C] the mixes' shift fractions:

  xn_t = norm(x_t) * s + b                  (layernorm; rmsnorm: no mean, no bias)
  p_t = xn_{t-1}                            (the carried last token at a sequence's first token)
  m_{j,t} = xn_t + (p_t - xn_t) mu_j        j < M

The kernel takes the cotangents dm_j, dxn where xn has uses of its own besides the mixes, and dres (x's gradient
from its other uses: the residual) and, for every row, sums the gradient that reaches xn_t:

  g_t = dxn_t + sum_j (1 - mu_j) dm_{j,t} + [t + 1 in the sequence] sum_j mu_j dm_{j,t+1}

then takes the norm's backward on g (per row, from the forward's statistics) and writes dx + dres in x's dtype, and each
program's partial sums of ds = sum_t g_t xhat_t, db = sum_t g_t and dmu_j = sum_t xn_t (dm_{j,t+1} - dm_{j,t})
([R / program rows, C] float32, summed outside). The sequences' first tokens' terms through the carried token (its
gradient, and its share of dmu_j) are the caller's: B rows.

Token t + 1's share needs each dm_j at a second row alignment. A program takes its rows in steps of L = 16 and moves
a step's tile up one row as a product with the [L, L] shift matrix (S[t, t+1] = 1): exact, one nonzero term per
output with float32 accumulation (IEEE float32 products for float32 tiles); the step's last row takes the first row
of the next step, or past the program's rows a one-row block of the next program's.

Bytes per element of [R, C] with a bfloat16 stream and cotangents and M = 3: 12 read (x, dres, dxn, dm_0..2) and 2
written (dx), against 44 for XLA's derivative of the same (the norm's backward reading the mixes' gradients twice,
the shift fractions' sums reading them again, the token shift's and the residual's adds). With M = 1 and no dxn (the
RWKV-7 channel mix): 6 read and 2 written.

Lowering: Triton on GPU, `interpret=True` on CPU. A step takes its columns in chunks of up to CHUNK_COLUMNS, twice
(the norm's row sums need the whole row before dx), the last chunk masked past C; R must be a multiple of L
(`supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ltm_pallas import backend
from ltm_pallas.add_norm import KINDS, _masked_memory, padded  # noqa: F401  (KINDS: the op checks kinds)

STEP_ROWS = 16  # L: the shift is a tensor-core product, whose dimensions are at least 16.
MAX_STEPS = 8  # Steps a program takes in turn, carrying its partial sums: [R / 128, C] partials at most.
CHUNK_COLUMNS = 128  # A step takes its rows' columns in chunks, so that a few [L, 128] float32 tiles are all it holds.
NUM_WARPS = 8


def supported(rows: int) -> bool:
  """Whether the kernel takes R = `rows` rows: a multiple of STEP_ROWS (any C, in chunks of CHUNK_COLUMNS)."""
  return rows % STEP_ROWS == 0


def program_steps(rows: int, max_steps: int = MAX_STEPS) -> int:
  """Steps of STEP_ROWS rows per program: the largest power of two at most `max_steps` dividing R / STEP_ROWS."""
  steps = 1
  while steps * 2 <= max_steps and (rows // STEP_ROWS) % (steps * 2) == 0:
    steps *= 2
  return steps


def _up_one_row(tile):
  """tile [L, W] moved up one row (row t holds row t + 1; the last row zero), as S @ tile: exact."""
  size = tile.shape[0]
  shift = (lax.broadcasted_iota(jnp.int32, (size, size), 0) + 1 == lax.broadcasted_iota(jnp.int32, (size, size), 1))
  precision = (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if tile.dtype == jnp.float32 else None
  return lax.dot_general(shift.astype(tile.dtype), tile, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


class _Chunk:
  """Loads and stores of the columns [k * width, (k + 1) * width) of a ref's last axis (k traced), masked past column
  c (masked loads read zeros) when c is not a multiple of width."""

  def __init__(self, k, width: int, c: int):
    self.cols = pl.ds(pl.multiple_of(k * width, width), width)
    self.mask = lax.broadcasted_iota(jnp.int32, (width,), 0) + k * width < c if c % width else None

  def _mask(self, shape):
    return self.mask if len(shape) == 1 else jnp.broadcast_to(self.mask[None, :], shape)

  def load(self, ref, rows=None):
    view = ref.at[self.cols] if rows is None else ref.at[rows, self.cols]
    if self.mask is None:
      return view[...]
    return _masked_memory().load(view, mask=self._mask(view.shape), other=0)

  def store(self, ref, value, rows=None):
    view = ref.at[self.cols] if rows is None else ref.at[rows, self.cols]
    if self.mask is None:
      view[...] = value
    else:
      _masked_memory().store(view, value, mask=self._mask(view.shape))


def _backward_kernel(x_ref, mean_ref, rstd_ref, s_ref, b_ref, dres_ref, *refs, c, kind, length, steps, mixes,
                     xn_dtype, with_dxn, chunk_columns):
  """One program: `steps` steps of STEP_ROWS rows, each in two passes over its column chunks (the row sums of the
  norm's backward, then dx from them). refs: dxn [P, W] when `with_dxn`; then (M of each, one ref per mix: Triton
  blocks are powers of two) mu_j [W], dm_j [P, W], dm_j's row after the program's [1, W]; then the outputs dx [P, W]
  and the partial sums ds, db and dmu_j [W], accumulated in place step by step."""
  dxn_ref, refs = (refs[0], refs[1:]) if with_dxn else (None, refs)
  mu_refs, dm_refs, next_refs = refs[:mixes], refs[mixes:2 * mixes], refs[2 * mixes:3 * mixes]
  dx_ref, ds_ref, db_ref, *dmu_refs = refs[3 * mixes:]
  sums_refs = (ds_ref, db_ref, *dmu_refs)
  width = min(chunk_columns, x_ref.shape[1])
  chunks = -(-c // width)  # A loop, not unrolled: each chunk's tiles die before the next one's are loaded.
  rows_here = x_ref.shape[0]
  row = lax.broadcasted_iota(jnp.int32, (STEP_ROWS, 1), 0)
  start = pl.program_id(0) * rows_here

  @pl.loop(0, chunks)
  def _(k):
    for ref in sums_refs:
      _Chunk(k, width, c).store(ref, jnp.zeros((width,), jnp.float32))

  def step(i, carry):
    rows = pl.ds(pl.multiple_of(i * STEP_ROWS, STEP_ROWS), STEP_ROWS)
    mean, rstd = mean_ref[rows][:, None], rstd_ref[rows][:, None]
    has_next = (start + i * STEP_ROWS + row + 1) % length != 0  # [L, 1]: token t + 1 is in t's sequence.
    last_row = row == STEP_ROWS - 1
    next_row = pl.ds(jnp.minimum((i + 1) * STEP_ROWS, rows_here - 1), 1)  # In the program (read when i < steps - 1).

    def gradient(k, with_sums):
      """(chunk, g, xhat, s) [L, width] of column chunk k; with_sums also adds its shares of dmu_j, ds and db."""
      chunk = _Chunk(k, width, c)
      s = chunk.load(s_ref)[None, :]
      xhat = (chunk.load(x_ref, rows).astype(jnp.float32) - mean) * rstd
      if chunk.mask is not None:
        xhat = jnp.where(chunk.mask[None, :], xhat, 0.0)
      if with_sums:  # Only the shift fractions' sums read xn; the second pass does not rebuild it.
        xn = xhat * s
        if kind == "layernorm":
          xn = xn + chunk.load(b_ref)[None, :]
        xn = xn.astype(xn_dtype).astype(jnp.float32)  # The forward's rounded xn, which the mixes read.
      g = jnp.zeros((STEP_ROWS, width), jnp.float32) if dxn_ref is None else chunk.load(dxn_ref, rows).astype(
          jnp.float32)
      for j in range(mixes):
        d = chunk.load(dm_refs[j], rows)
        after = jnp.where(i < steps - 1, chunk.load(dm_refs[j], next_row), chunk.load(next_refs[j], pl.ds(0, 1)))
        up = jnp.where(last_row, after.astype(jnp.float32), _up_one_row(d))
        up = jnp.where(has_next, up, 0.0)
        d = d.astype(jnp.float32)
        mu = chunk.load(mu_refs[j])[None, :]
        g = g + d * (1.0 - mu) + up * mu
        if with_sums:
          chunk.store(dmu_refs[j], chunk.load(dmu_refs[j]) + jnp.sum(xn * (up - d), axis=0))
      if with_sums:
        chunk.store(ds_ref, chunk.load(ds_ref) + jnp.sum(g * xhat, axis=0))
        chunk.store(db_ref, chunk.load(db_ref) + jnp.sum(g, axis=0))
      return chunk, g, xhat, s

    def row_sums(k, sums):
      _, g, xhat, s = gradient(k, True)
      return sums[0] + jnp.sum(g * s, axis=1, keepdims=True), sums[1] + jnp.sum(g * s * xhat, axis=1, keepdims=True)

    zeros = jnp.zeros((STEP_ROWS, 1), jnp.float32)
    sum_dxhat, sum_dxhat_xhat = lax.fori_loop(0, chunks, row_sums, (zeros, zeros))

    @pl.loop(0, chunks)
    def _(k):  # The norm's backward: d(xhat)/dx projects out the mean (layernorm) and xhat.
      chunk, g, xhat, s = gradient(k, False)
      dxc = g * s - xhat * (sum_dxhat_xhat / c)
      if kind == "layernorm":
        dxc = dxc - sum_dxhat / c
      dx = chunk.load(dres_ref, rows).astype(jnp.float32) + dxc * rstd
      chunk.store(dx_ref, dx.astype(dx_ref.dtype), rows)

    return carry

  lax.fori_loop(0, steps, step, 0)


def backward(x, mean, rstd, scale, bias, mu, dres, dxn, dms, *, kind, length, xn_dtype, interpret=None,
             max_steps=MAX_STEPS, chunk_columns=CHUNK_COLUMNS, num_warps=NUM_WARPS):
  """(dx [R, C] in x's dtype, ds [C], db [C], dmu [M, C]) float32 sums, without the sequences' first tokens' terms
  through the carried token (module docstring).

  x, dres, dxn: [R, C] (dres: x's gradient from elsewhere, which dx includes; dxn None: xn has no other use, and
  no [R, C] array of zeros is read); mean, rstd: [R] float32, the
  forward's statistics of x's rows (mean zero for rmsnorm); scale, bias: [C] float32 (bias unread for rmsnorm); mu:
  [M, C] float32, the shift fractions as the forward used them; dms: M cotangents [R, C] of the mixes; length: T,
  the tokens of a sequence; xn_dtype: the dtype the forward rounded xn to. max_steps, chunk_columns (a power of two)
  and num_warps: the launch settings (a program's steps at most, the columns a step takes at a time, warps a program).
  """
  rows, c = x.shape
  width, mixes = padded(c), len(dms)
  steps = program_steps(rows, max_steps)
  program_rows = STEP_ROWS * steps
  programs = rows // program_rows
  tile = pl.BlockSpec((program_rows, width), lambda i: (i, 0))
  vector = pl.BlockSpec((width,), lambda i: (0,))
  per_row = pl.BlockSpec((program_rows,), lambda i: (i,))
  # The row after a program's last: one-row blocks, so the block index is the row (the last program's is unread).
  after = pl.BlockSpec((1, width), lambda i: (jnp.minimum((i + 1) * program_rows, rows - 1), 0))
  partial = pl.BlockSpec((None, width), lambda i: (i, 0))
  sums = jax.ShapeDtypeStruct((programs, c), jnp.float32)
  dx, ds, db, *dmu = backend.call(
      functools.partial(_backward_kernel, c=c, kind=kind, length=length, steps=steps, mixes=mixes,
                        xn_dtype=jnp.dtype(xn_dtype), with_dxn=dxn is not None, chunk_columns=chunk_columns),
      out_shape=(jax.ShapeDtypeStruct((rows, c), x.dtype), *(sums,) * (2 + mixes)),
      grid=(programs,),
      in_specs=[tile, per_row, per_row, vector, vector, tile, *(tile,) * (dxn is not None), *(vector,) * mixes,
                *(tile,) * mixes, *(after,) * mixes],
      out_specs=(tile, *(partial,) * (2 + mixes)),
      num_warps=num_warps, interpret=interpret, name="norm_mix_backward",
  )(x, mean, rstd, scale, bias, dres, *(() if dxn is None else (dxn,)), *mu, *dms, *dms)
  return dx, jnp.sum(ds, axis=0), jnp.sum(db, axis=0), jnp.stack([jnp.sum(t, axis=0) for t in dmu])
