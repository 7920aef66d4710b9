"""The three flash-attention kernels and their pallas_calls, on padded arrays.

Shapes (padded; see config.Static): q, o, do [B, Tp, Hq, Dp]; k, v [B, Sp, Hkv, Dp]; lse, delta [B, Hq, Tp] float32;
segment ids [B, Tp] and [B, Sp] int32. Query head h reads key/value head h // group. Arrays stay in the caller's
[B, len, heads, D] layout: a tile is a strided [block, Dp] slice, so no transpose is ever materialised.

Softmax runs in base 2: logits are scaled by scale * log2(e) so that exp2 can be used, and the saved log-sum-exp is
base 2 as well (it never leaves this package). A row that sees no key stores lse = +inf: then exp2(s - lse) is 0
whether s is a logit or the -inf of a masked pair, so the backward needs no special case and the output row is 0.

Traffic per program, elements of HBM: forward reads its q tile once and the k/v tiles of the visited key blocks
(from L2 for the neighbouring programs of one group), writes o and lse once. dq reads q, do, lse, delta once and k/v
per visited block; dk/dv reads k, v once and q, do, lse, delta per visited (head, query block), writes dk, dv once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ltm_pallas import backend
from ltm_pallas.attention.config import LOG2E, Static, key_block_range, query_block_range, visible


def _dot(a, b, contract: tuple[int, int], st: Static) -> jax.Array:
  """a @ b contracting dims `contract` of (a, b), accumulated in float32."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=st.precision,
                         preferred_element_type=jnp.float32)


def _three_loops(st: Static, bounds, step, carry):
  """Runs step(block, carry, masked) over [lo, full_lo) and [full_hi, hi) masked and [full_lo, full_hi) unmasked."""
  lo, full_lo, full_hi, hi = bounds
  if st.has_mask:
    carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  if st.has_mask:
    carry = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
  return carry


def _split(refs, st: Static, names: Sequence[str]):
  """Names the kernel's refs; the segment-id refs are absent (None) without segments."""
  refs = list(refs)
  out = {}
  for name in names:
    if name in ("q_segment", "kv_segment") and not st.has_segments:
      out[name] = None
    else:
      out[name] = refs.pop(0)
  assert not refs
  return out


def _forward_kernel(*refs, st: Static):
  r = _split(refs, st, ("q", "k", "v", "q_segment", "kv_segment", "o", "lse"))
  bq, bk = st.fwd_q, st.fwd_k
  q_block = pl.program_id(2)
  q = r["q"][...]
  q_index = q_block * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
  q_segment = r["q_segment"][...] if st.has_segments else None
  logit_scale = st.scale * LOG2E

  def step(k_block, carry, masked):
    row_max, row_sum, acc = carry
    keys = pl.ds(pl.multiple_of(k_block * bk, bk), bk)
    k = r["k"][keys, :]
    v = r["v"][keys, :]
    s = _dot(q, k, (1, 1), st) * logit_scale
    if masked:
      k_index = k_block * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
      kv_segment = r["kv_segment"][keys] if st.has_segments else None
      s = jnp.where(visible(st, q_index, k_index, q_segment, kv_segment), s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
    # A row with nothing visible yet keeps max -inf; subtracting 0 instead keeps exp2 at exp2(-inf) = 0, not NaN.
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    p = jnp.exp2(s - shift[:, None])
    rescale = jnp.exp2(row_max - shift)
    row_sum = rescale * row_sum + jnp.sum(p, axis=1)
    acc = rescale[:, None] * acc + _dot(p.astype(v.dtype), v, (1, 0), st)
    return new_max, row_sum, acc

  carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, st.head_dim_pad), jnp.float32))
  row_max, row_sum, acc = _three_loops(st, key_block_range(st, q_block, bq, bk), step, carry)
  empty = row_sum == 0.0
  r["o"][...] = (acc / jnp.where(empty, 1.0, row_sum)[:, None]).astype(r["o"].dtype)
  r["lse"][...] = jnp.where(empty, jnp.inf, row_max + jnp.log2(jnp.where(empty, 1.0, row_sum)))


def _dq_kernel(*refs, st: Static):
  r = _split(refs, st, ("q", "k", "v", "q_segment", "kv_segment", "do", "lse", "delta", "dq"))
  bq, bk = st.dq_q, st.dq_k
  q_block = pl.program_id(2)
  q = r["q"][...]
  do = r["do"][...]
  lse = r["lse"][...]
  delta = r["delta"][...]
  q_index = q_block * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
  q_segment = r["q_segment"][...] if st.has_segments else None
  logit_scale = st.scale * LOG2E

  def step(k_block, dq, masked):
    keys = pl.ds(pl.multiple_of(k_block * bk, bk), bk)
    k = r["k"][keys, :]
    v = r["v"][keys, :]
    s = _dot(q, k, (1, 1), st) * logit_scale
    if masked:
      k_index = k_block * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
      kv_segment = r["kv_segment"][keys] if st.has_segments else None
      s = jnp.where(visible(st, q_index, k_index, q_segment, kv_segment), s, -jnp.inf)
    p = jnp.exp2(s - lse[:, None])
    dp = _dot(do, v, (1, 1), st)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, (1, 0), st)

  dq = jnp.zeros((bq, st.head_dim_pad), jnp.float32)
  dq = _three_loops(st, key_block_range(st, q_block, bq, bk), step, dq)
  r["dq"][...] = (dq * st.scale).astype(r["dq"].dtype)


def _dkv_kernel(*refs, st: Static):
  r = _split(refs, st, ("q", "k", "v", "q_segment", "kv_segment", "do", "lse", "delta", "dk", "dv"))
  bq, bk = st.dkv_q, st.dkv_k
  k_block = pl.program_id(2)
  # Held across the loop unless st.dkv_stream_kv, which reads them at every step (config.BlockSizes).
  kv = None if st.dkv_stream_kv else (r["k"][...], r["v"][...])
  k_index = k_block * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
  kv_segment = r["kv_segment"][...] if st.has_segments else None
  logit_scale = st.scale * LOG2E
  bounds = query_block_range(st, k_block, bq, bk)

  def head(g, carry):
    """Adds the contributions of query head g of this key/value head's group."""

    def step(q_block, carry, masked):
      dk, dv = carry
      rows = pl.ds(pl.multiple_of(q_block * bq, bq), bq)
      q = r["q"][rows, g, :]
      do = r["do"][rows, g, :]
      lse = r["lse"][g, rows]
      delta = r["delta"][g, rows]
      k, v = (r["k"][...], r["v"][...]) if kv is None else kv
      s = _dot(q, k, (1, 1), st) * logit_scale
      if masked:
        q_index = q_block * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
        q_segment = r["q_segment"][rows] if st.has_segments else None
        s = jnp.where(visible(st, q_index, k_index, q_segment, kv_segment), s, -jnp.inf)
      p = jnp.exp2(s - lse[:, None])  # [bq, bk]
      dv = dv + _dot(p.astype(do.dtype), do, (0, 0), st)
      dp = _dot(do, v, (1, 1), st)
      ds = p * (dp - delta[:, None])
      dk = dk + _dot(ds.astype(q.dtype), q, (0, 0), st)
      return dk, dv

    return _three_loops(st, bounds, step, carry)

  zeros = jnp.zeros((bk, st.head_dim_pad), jnp.float32)
  dk, dv = lax.fori_loop(0, st.group, head, (zeros, zeros))
  r["dk"][...] = (dk * st.scale).astype(r["dk"].dtype)
  r["dv"][...] = dv.astype(r["dv"].dtype)


def _call(kernel, st: Static, *, name: str, grid, inputs, in_specs, out_shapes, out_specs, warps: int, stages: int,
          poison: bool):
  """backend.call, optionally with every output aliased to a NaN-filled input so that unwritten elements show."""
  n_in = len(inputs)
  kwargs = {}
  if poison:
    inputs = list(inputs) + [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shapes]
    in_specs = list(in_specs) + list(out_specs)
    kwargs["input_output_aliases"] = {n_in + i: i for i in range(len(out_shapes))}
    inner = kernel

    def kernel(*refs):  # The aliased inputs are the outputs' buffers; the kernel only sees the outputs.
      inner(*refs[:n_in], *refs[n_in + len(out_shapes):])

  fn = backend.call(kernel, out_shape=out_shapes, grid=grid, in_specs=in_specs, out_specs=out_specs,
                    num_warps=warps, num_stages=stages, interpret=st.interpret, name=name, **kwargs)
  return fn(*inputs)


def _segment_specs(st: Static, q_spec: pl.BlockSpec, kv_spec: pl.BlockSpec):
  return [q_spec, kv_spec] if st.has_segments else []


def forward(st: Static, q, k, v, segments, *, poison: bool = False):
  """(o [B, Tp, Hq, Dp] in q's dtype, lse [B, Hq, Tp] float32, base 2). Grid (B, Hq, query blocks)."""
  b, _, hq, dp = q.shape
  bq = st.fwd_q
  q_tile = pl.BlockSpec((None, bq, None, dp), lambda i, h, j: (i, j, h, 0))
  kv_all = pl.BlockSpec((None, st.s_pad, None, dp), lambda i, h, j: (i, 0, lax.div(h, st.group), 0))
  in_specs = [q_tile, kv_all, kv_all] + _segment_specs(
      st, pl.BlockSpec((None, bq), lambda i, h, j: (i, j)), pl.BlockSpec((None, st.s_pad), lambda i, h, j: (i, 0)))
  out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, st.t_pad), jnp.float32)]
  out_specs = [q_tile, pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j))]
  o, lse = _call(functools.partial(_forward_kernel, st=st), st, name="flash_attention_forward",
                 grid=(b, hq, st.t_pad // bq), inputs=[q, k, v, *(segments or ())], in_specs=in_specs,
                 out_shapes=out_shapes, out_specs=out_specs, warps=st.fwd_warps, stages=st.fwd_stages,
                 poison=poison)
  return o, lse


def backward(st: Static, q, k, v, segments, o, lse, do, *, poison: bool = False):
  """(dq, dk, dv) in the inputs' dtypes: a dq kernel (grid B, Hq, query blocks) and a dk/dv kernel (grid B, Hkv,
  key blocks; each program loops over its group's query heads)."""
  b, _, hq, dp = q.shape
  hkv = k.shape[2]
  # rowsum(do * o): the softmax-backward term shared by dq and dk; one fused XLA reduction.
  delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))
  inputs = [q, k, v, *(segments or ()), do, lse, delta]

  bq = st.dq_q
  q_tile = pl.BlockSpec((None, bq, None, dp), lambda i, h, j: (i, j, h, 0))
  kv_all = pl.BlockSpec((None, st.s_pad, None, dp), lambda i, h, j: (i, 0, lax.div(h, st.group), 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, h, j: (i, h, j))
  dq_specs = [q_tile, kv_all, kv_all] + _segment_specs(
      st, pl.BlockSpec((None, bq), lambda i, h, j: (i, j)), pl.BlockSpec((None, st.s_pad), lambda i, h, j: (i, 0)))
  dq_specs += [q_tile, row_tile, row_tile]
  (dq,) = _call(functools.partial(_dq_kernel, st=st), st, name="flash_attention_dq",
                grid=(b, hq, st.t_pad // bq), inputs=inputs, in_specs=dq_specs,
                out_shapes=[jax.ShapeDtypeStruct(q.shape, q.dtype)], out_specs=[q_tile], warps=st.dq_warps,
                stages=st.dq_stages, poison=poison)

  # Programs of one key/value head see the whole query sequence of its `group` query heads.
  bk = st.dkv_k
  q_group = pl.BlockSpec((None, st.t_pad, st.group, dp), lambda i, h, j: (i, 0, h, 0))
  kv_tile = pl.BlockSpec((None, bk, None, dp), lambda i, h, j: (i, j, h, 0))
  rows_group = pl.BlockSpec((None, st.group, st.t_pad), lambda i, h, j: (i, h, 0))
  dkv_specs = [q_group, kv_tile, kv_tile] + _segment_specs(
      st, pl.BlockSpec((None, st.t_pad), lambda i, h, j: (i, 0)), pl.BlockSpec((None, bk), lambda i, h, j: (i, j)))
  dkv_specs += [q_group, rows_group, rows_group]
  dk, dv = _call(functools.partial(_dkv_kernel, st=st), st, name="flash_attention_dkv",
                 grid=(b, hkv, st.s_pad // bk), inputs=inputs, in_specs=dkv_specs,
                 out_shapes=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2, out_specs=[kv_tile, kv_tile],
                 warps=st.dkv_warps, stages=st.dkv_stages, poison=poison)
  return dq, dk, dv
