"""The Pallas flash-attention kernels (interpreted on CPU) against the float64 reference of attention_reference.py.

Shapes are tiny and the tiles are 16 x 16, so every case still spans several query and key blocks, with padding
wherever a length is not a multiple of 16.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import random_qkv as _inputs
from attention_reference import reference_mask
from attention_reference import reference_value_and_grads as _reference_value_and_grads
from attention_reference import value_and_grads as _value_and_grads
from jax.experimental import pallas as pl

from ltm_jax.ops.attention import attention
from ltm_pallas.attention import (
  BlockSizes,
  config,
  flash,
  flash_attention,
  kernels,
  raw_outputs,
)

BLOCKS = BlockSizes(fwd_q=16, fwd_k=16, dq_q=16, dq_k=16, dkv_k=16, dkv_q=16)
# float32 kernel vs float64 reference, unit-normal inputs, D <= 16, a few dozen keys per row.
F32_ATOL = 2e-5
F32_GRAD_ATOL = 5e-5
# Low precision, against the reference on the same rounded inputs: the output is rounded once to the dtype (2^-8 for
# bfloat16, 2^-11 for float16, relative), the probabilities and dS are rounded before their matmuls, and the
# gradients are rounded on output; allow a few units of |x| <= ~3.
BF16_ATOL, BF16_GRAD_ATOL = 3e-2, 6e-2
F16_ATOL, F16_GRAD_ATOL = 4e-3, 8e-3


def _mask(t, s, *, b=1, **masks):
  """[B, T, S] bool with default positions: query i at S - T + i, key j at j."""
  return reference_mask(b, t, s, **masks)


def _check(rng, q, k, v, mask, *, atol=F32_ATOL, grad_atol=F32_GRAD_ATOL, segment_ids=None, blocks=BLOCKS,
           **kwargs):
  """Output and q/k/v gradients of flash_attention against the float64 reference; returns them."""
  scale = kwargs.get("scale") or q.shape[-1] ** -0.5
  cotangent = jnp.asarray(rng.standard_normal(q.shape), q.dtype)
  fn = lambda q, k, v: flash_attention(q, k, v, segment_ids, block_sizes=blocks, **kwargs)
  out, grads = _value_and_grads(fn, q, k, v, cotangent)
  ref_out, ref_grads = _reference_value_and_grads(q, k, v, mask, scale, cotangent)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=atol, rtol=0)
  for name, g, ref, x in zip("qkv", grads, ref_grads, (q, k, v)):
    assert g.dtype == x.dtype and g.shape == x.shape
    np.testing.assert_allclose(np.asarray(g, np.float64), ref, atol=grad_atol, rtol=0, err_msg=f"d{name}")
  return out, grads


# (B, T, S, Hq, Hkv, D, causal, window): T and S are never multiples of the 16-row tiles.
@pytest.mark.parametrize("b,t,s,hq,hkv,d,causal,window", [
    (2, 37, 37, 2, 2, 8, True, None),  # Causal, group 1.
    (1, 45, 45, 4, 2, 16, True, 7),  # Window shorter than a tile, group 2.
    (1, 45, 45, 4, 1, 8, True, 20),  # Window spanning tiles, group 4 (multi-query).
    (1, 33, 33, 2, 2, 8, True, 1),  # Each query sees only itself.
    (2, 19, 41, 4, 2, 12, False, None),  # Cross-attention T != S, head dim padded to 16.
    (1, 20, 45, 2, 1, 8, True, 9),  # Causal T < S: the queries are the last 20 positions.
])
def test_masks_and_groups(b, t, s, hq, hkv, d, causal, window):
  rng = np.random.default_rng(t * 100 + s + (window or 0))
  q, k, v = _inputs(rng, b, t, s, hq, hkv, d)
  _check(rng, q, k, v, _mask(t, s, causal=causal, window=window, b=b), causal=causal, window=window)


@pytest.mark.parametrize("causal,window", [(True, 7), (False, None)])
def test_dkv_reading_k_and_v_at_every_step(causal, window):
  """dkv_stream_kv (the float32 defaults at head dims 128 and 256, where holding k and v across the loop would
  spill): the same numbers against the float64 reference, with segments and grouped heads."""
  rng = np.random.default_rng(5 + (window or 0))
  b, t = 2, 37
  q, k, v = _inputs(rng, b, t, t, 4, 2, 16)
  seg = _packed(rng, b, t)
  mask = _mask(t, t, causal=causal, window=window, q_seg=seg, kv_seg=seg, b=b)
  _check(rng, q, k, v, mask, causal=causal, window=window, segment_ids=(jnp.asarray(seg), jnp.asarray(seg)),
         blocks=dataclasses.replace(BLOCKS, dkv_stream_kv=True))


def test_causal_more_queries_than_keys_gives_zero_rows():
  """T > S, causal: the first T - S queries precede every key, so they output zeros and get zero gradients."""
  rng = np.random.default_rng(1)
  t, s = 40, 23
  q, k, v = _inputs(rng, 1, t, s, 2, 2, 8)
  out, grads = _check(rng, q, k, v, _mask(t, s, causal=True), causal=True, scale=0.3)
  np.testing.assert_array_equal(out[:, : t - s], 0.0)
  np.testing.assert_array_equal(grads[0][:, : t - s], 0.0)


def _packed(rng, b, t, n=4):
  return np.sort(rng.integers(0, n, size=(b, t)), axis=1).astype(np.int32)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 6)])
def test_segment_ids_self(causal, window):
  rng = np.random.default_rng(2)
  b, t = 2, 40
  q, k, v = _inputs(rng, b, t, t, 4, 2, 8)
  seg = _packed(rng, b, t)
  mask = _mask(t, t, causal=causal, window=window, q_seg=seg, kv_seg=seg, b=b)
  _check(rng, q, k, v, mask, causal=causal, window=window, segment_ids=(jnp.asarray(seg), jnp.asarray(seg)))


def test_segment_ids_cross_with_unmatched_query():
  rng = np.random.default_rng(3)
  b, t, s = 2, 18, 35
  q, k, v = _inputs(rng, b, t, s, 2, 1, 8)
  q_seg = rng.integers(0, 3, size=(b, t)).astype(np.int32)
  kv_seg = rng.integers(0, 3, size=(b, s)).astype(np.int32)
  q_seg[1, 5] = 9  # Matches no key.
  mask = _mask(t, s, causal=False, q_seg=q_seg, kv_seg=kv_seg, b=b)
  out, grads = _check(rng, q, k, v, mask, causal=False, segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  np.testing.assert_array_equal(out[1, 5], 0.0)
  np.testing.assert_array_equal(grads[0][1, 5], 0.0)


@pytest.mark.parametrize("dtype,atol,grad_atol", [(jnp.bfloat16, BF16_ATOL, BF16_GRAD_ATOL),
                                                   (jnp.float16, F16_ATOL, F16_GRAD_ATOL)])
def test_low_precision(dtype, atol, grad_atol):
  rng = np.random.default_rng(4)
  q, k, v = _inputs(rng, 1, 40, 40, 4, 2, 16, dtype)
  _check(rng, q, k, v, _mask(40, 40, causal=True, window=12), atol=atol, grad_atol=grad_atol, causal=True,
         window=12)


def test_outputs_fully_written():
  """Every kernel output starts as NaN (aliased) and must come back NaN-free, padding included."""
  rng = np.random.default_rng(5)
  b, t, s = 2, 21, 35
  q, k, v = _inputs(rng, b, t, s, 4, 2, 12)
  do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  q_seg, kv_seg = _packed(rng, b, t, 3), _packed(rng, b, s, 3)
  out = jax.jit(functools.partial(raw_outputs, causal=True, window=11, block_sizes=BLOCKS))(
      q, k, v, do, (jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  assert out["o"].shape == (b, 32, 4, 16) and out["dk"].shape == (b, 48, 2, 16)
  for name, x in out.items():
    assert not np.isnan(np.asarray(x)).any(), name
  # lse is +inf exactly on the rows that see no key (independent segment draws leave some).
  empty = ~_mask(t, s, causal=True, window=11, q_seg=q_seg, kv_seg=kv_seg, b=b).any(-1)  # [B, T]
  assert empty.any() and not empty.all()
  lse = np.asarray(out["lse"])[:, :, :t]
  np.testing.assert_array_equal(np.isinf(lse), np.broadcast_to(empty[:, None], lse.shape))


def test_poisoned_buffer_detects_unwritten_output():
  """The check above can fail: a kernel that writes only half of its output leaves NaN behind."""
  st, _ = _static_and_padded(16, 16)

  def half_kernel(x_ref, o_ref):
    o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 8)]

  spec = pl.BlockSpec((16,), lambda i: (0,))
  (out,) = kernels._call(half_kernel, st, name="half", grid=(1,), inputs=[jnp.ones(16)], in_specs=[spec],
                         out_shapes=[jax.ShapeDtypeStruct((16,), jnp.float32)], out_specs=[spec], warps=4,
                         stages=1, poison=True)
  assert np.isnan(np.asarray(out[8:])).all() and (np.asarray(out[:8]) == 1).all()


def test_default_block_sizes_are_complete_and_overridable():
  """Every head dim and dtype the kernel takes gets a complete default row; a caller's field replaces only itself."""
  for d in (8, 16, 32, 64, 80, 128, 256):
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
      row = config.default_block_sizes(config.next_power_of_two(d), dtype)
      assert None not in dataclasses.astuple(row), (d, dtype, row)
  default = config.default_block_sizes(128, jnp.bfloat16)
  mixed = BlockSizes(dq_q=16, dkv_warps=4).or_defaults(default)
  assert (mixed.dq_q, mixed.dkv_warps) == (16, 4)
  assert dataclasses.replace(mixed, dq_q=default.dq_q, dkv_warps=default.dkv_warps) == default
  with pytest.raises(ValueError, match="power of two"):
    BlockSizes(fwd_q=48)


def _static_and_padded(t, s, **kwargs):
  rng = np.random.default_rng(0)
  q, k, v = _inputs(rng, 1, t, s, 1, 1, 8)
  args = dict(causal=True, window=None, scale=None, block_sizes=BLOCKS, interpret=None)
  args.update(kwargs)
  return flash._prepare(q, k, v, None, **args)


@pytest.mark.parametrize("t,s,causal,window", [
    (64, 64, True, None), (64, 64, True, 5), (64, 64, True, 16), (64, 64, True, 33), (40, 75, True, 7),
    (75, 40, True, None), (50, 70, False, None),
])
def test_block_ranges_visit_exactly_the_visible_tiles(t, s, causal, window):
  """A tile is visited iff some pair in it is visible, and left unmasked only if every pair is (real rows only)."""
  st, _ = _static_and_padded(t, s, causal=causal, window=window)
  vis = np.zeros((st.t_pad, st.s_pad), bool)
  vis[:t, :s] = _mask(t, s, causal=causal, window=st.window)[0]
  bq, bk = st.fwd_q, st.fwd_k
  tiles = vis.reshape(st.t_pad // bq, bq, st.s_pad // bk, bk)
  any_ = tiles.any(axis=(1, 3))
  for qb in range(st.t_pad // bq):
    lo, full_lo, full_hi, hi = map(int, config.key_block_range(st, qb, bq, bk))
    if qb * bq >= t:
      continue  # Padding-only query blocks: any range is correct.
    visited = np.zeros(st.s_pad // bk, bool)
    visited[lo:hi] = True
    np.testing.assert_array_equal(visited, any_[qb], err_msg=f"query block {qb}")
    rows_real = min(bq, t - qb * bq)
    full = tiles[qb, :rows_real].all(axis=(0, 2))
    assert full[full_lo:full_hi].all(), f"query block {qb} skips the mask on a partly hidden tile"
  for kb in range(st.s_pad // bk):
    lo, full_lo, full_hi, hi = map(int, config.query_block_range(st, kb, bq, bk))
    visited = np.zeros(st.t_pad // bq, bool)
    visited[lo:hi] = True
    np.testing.assert_array_equal(visited, any_[:, kb], err_msg=f"key block {kb}")
    for qb in range(full_lo, full_hi):
      rows_real = min(bq, t - qb * bq)
      assert tiles[qb, :rows_real, kb].all(), f"key block {kb} skips the mask on query block {qb}"


def test_window_cost_is_linear():
  """With a window the visited tiles per query block are bounded by the window, whatever T is."""
  for t in (256, 1024):
    st, _ = _static_and_padded(t, t, window=32)
    counts = [int(hi - lo) for lo, _, _, hi in (config.key_block_range(st, qb, 16, 16) for qb in range(t // 16))]
    assert max(counts) == 3  # ceil((32 + 16 - 1) / 16): the window plus the tile's own span.


def test_jit_vmap_checkpoint():
  """Gradients under jax.checkpoint (the forward may run twice) and under vmap over an extra leading axis match the
  plain jitted gradient."""
  rng = np.random.default_rng(6)
  q, k, v = _inputs(rng, 3, 20, 20, 2, 1, 8)
  seg = jnp.asarray(_packed(rng, 3, 20))
  fn = lambda q, k, v, seg: flash_attention(q, k, v, (seg, seg), causal=True, window=6, block_sizes=BLOCKS)
  per_row = jax.vmap(lambda q, k, v, seg: fn(q[None], k[None], v[None], seg[None])[0])
  grads = lambda f: jax.grad(lambda q, k, v, seg: jnp.sum(jnp.sin(f(q, k, v, seg))), argnums=(0, 1, 2))
  plain, remat, vmapped = jax.jit(lambda *a: [grads(f)(*a) for f in (fn, jax.checkpoint(fn), per_row)])(
      q, k, v, seg)
  for other in (remat, vmapped):
    for g, ref in zip(other, plain):
      np.testing.assert_allclose(g, ref, atol=1e-6)


# --- Through ltm_jax.ops.attention. ---


def test_op_impl_pallas_matches_xla():
  rng = np.random.default_rng(7)
  q, k, v = _inputs(rng, 2, 24, 24, 4, 2, 8)
  seg = jnp.asarray(_packed(rng, 2, 24))
  run = lambda impl: jax.jit(lambda q, k, v: attention(q, k, v, window=5, segment_ids=seg, impl=impl))(q, k, v)
  np.testing.assert_allclose(run("pallas"), run("xla"), atol=F32_ATOL)


def test_op_refuses_positions_under_pallas():
  rng = np.random.default_rng(8)
  q, k, v = _inputs(rng, 1, 4, 8, 2, 2, 8)
  pos = dict(q_positions=jnp.arange(4, 8)[None], kv_positions=jnp.arange(8)[None])
  with pytest.raises(ValueError, match="impl='pallas'.*positions"):
    attention(q, k, v, impl="pallas", **pos)
  # Under auto the same call runs (on xla off GPU and, with positions, on GPU too).
  assert attention(q, k, v, impl="auto", **pos).shape == q.shape


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (the Triton lowering)")
@pytest.mark.parametrize("window,d", [(None, 64), (40, 128), (None, 80)])
def test_triton_matches_xla_on_gpu(window, d):
  """The compiled kernels with their default tiles, against the xla backend on the same bfloat16 values."""
  rng = np.random.default_rng(9)
  q, k, v = _inputs(rng, 2, 300, 300, 4, 2, d, jnp.bfloat16)
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  run = lambda impl: _value_and_grads(lambda q, k, v: attention(q, k, v, window=window, impl=impl), q, k, v,
                                      cotangent)
  (out, grads), (ref, ref_grads) = run("pallas"), run("xla")
  # Both round to bfloat16 (2^-8 relative) at different points: allow a few units of the largest entry.
  for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    r = np.float32(r)
    np.testing.assert_allclose(np.float32(x), r, atol=2.0**-6 * np.abs(r).max(), err_msg=name)
