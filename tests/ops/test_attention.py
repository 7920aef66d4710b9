"""ltm_jax.ops.attention against the float64 reference of attention_reference.py (masks by explicit loops, softmax
in float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import random_qkv as _inputs
from attention_reference import reference_mask
from attention_reference import reference_value_and_grads as _reference_value_and_grads
from attention_reference import value_and_grads as _value_and_grads

from ltm_jax.ops.attention import attention, cudnn, uses_local_blocks

# float32 implementation vs float64 reference on unit-normal inputs with D <= 16.
F32_ATOL = 2e-5
F32_RTOL = 2e-5
F32_GRAD_ATOL = 5e-5
# bfloat16 inputs (reference on the same rounded values): the output is rounded to bf16 (relative 2^-8) and the
# probabilities are rounded to bf16 before the value matmul.
BF16_ATOL = 2e-2
EMPTY = np.iinfo(np.int32).max


def _jitted(fn, *args):
  return jax.jit(fn)(*args)


def _check(rng, q, k, v, mask, **kwargs):
  """Values and q/k/v gradients of impl="xla" in float32 against the float64 reference."""
  scale = kwargs.get("scale") or q.shape[-1] ** -0.5
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  out, grads = _value_and_grads(lambda q, k, v: attention(q, k, v, impl="xla", **kwargs), q, k, v, cotangent)
  ref_out, ref_grads = _reference_value_and_grads(q, k, v, mask, scale, cotangent)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_allclose(out, ref_out, atol=F32_ATOL, rtol=F32_RTOL)
  for name, g, ref in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, ref, atol=F32_GRAD_ATOL, rtol=F32_RTOL, err_msg=f"d{name}")
  return out, grads


def test_causal():
  rng = np.random.default_rng(0)
  q, k, v = _inputs(rng, 2, 16, 16, 4, 4, 8)
  _check(rng, q, k, v, reference_mask(2, 16, 16, causal=True))


@pytest.mark.parametrize("window", [1, 3, 16, 40])
def test_sliding_window(window):
  rng = np.random.default_rng(window)
  q, k, v = _inputs(rng, 2, 16, 16, 2, 2, 8)
  _check(rng, q, k, v, reference_mask(2, 16, 16, causal=True, window=window), window=window)


@pytest.mark.parametrize("t,window,hq,hkv", [(70, 1, 2, 2), (70, 5, 4, 2), (83, 16, 2, 1), (71, 17, 2, 2)])
def test_sliding_window_in_local_blocks(t, window, hq, hkv):
  # Windows far shorter than the sequence run blockwise (two key blocks per query block); odd lengths leave a
  # partial last block.
  assert uses_local_blocks(True, window, t, t, has_positions=False)
  rng = np.random.default_rng(t + window)
  q, k, v = _inputs(rng, 2, t, t, hq, hkv, 8)
  _check(rng, q, k, v, reference_mask(2, t, t, causal=True, window=window), window=window)


def test_sliding_window_in_local_blocks_with_segments():
  rng = np.random.default_rng(12)
  q, k, v = _inputs(rng, 2, 75, 75, 4, 2, 8)
  seg = np.sort(rng.integers(0, 5, size=(2, 75)), axis=1).astype(np.int32)
  mask = reference_mask(2, 75, 75, causal=True, window=9, q_seg=seg, kv_seg=seg)
  _check(rng, q, k, v, mask, window=9, segment_ids=jnp.asarray(seg))


def test_window_one_is_identity_on_values():
  rng = np.random.default_rng(1)
  q, k, v = _inputs(rng, 1, 6, 6, 2, 2, 4)
  out = _jitted(lambda q, k, v: attention(q, k, v, window=1, impl="xla"), q, k, v)
  np.testing.assert_allclose(out, v, atol=F32_ATOL)


def test_non_causal_with_scale():
  rng = np.random.default_rng(2)
  q, k, v = _inputs(rng, 2, 12, 12, 2, 2, 8)
  _check(rng, q, k, v, reference_mask(2, 12, 12, causal=False), causal=False, scale=0.2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_grouped_query_heads(hq, hkv):
  rng = np.random.default_rng(hq * 10 + hkv)
  q, k, v = _inputs(rng, 2, 10, 10, hq, hkv, 8)
  _check(rng, q, k, v, reference_mask(2, 10, 10, causal=True, window=4), window=4)


def _packed_segments(rng, b, t):
  """Sorted random segment ids, as packing produces: [B, T] int32."""
  return np.sort(rng.integers(0, 4, size=(b, t)), axis=1).astype(np.int32)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 3), (False, None)])
def test_segment_ids_self(causal, window):
  rng = np.random.default_rng(3)
  q, k, v = _inputs(rng, 2, 16, 16, 4, 2, 8)
  seg = _packed_segments(rng, 2, 16)
  mask = reference_mask(2, 16, 16, causal=causal, window=window, q_seg=seg, kv_seg=seg)
  _check(rng, q, k, v, mask, causal=causal, window=window, segment_ids=jnp.asarray(seg))


def test_segment_ids_pair_cross_attention():
  rng = np.random.default_rng(4)
  q, k, v = _inputs(rng, 2, 5, 11, 4, 2, 8)
  q_seg = rng.integers(0, 3, size=(2, 5)).astype(np.int32)
  kv_seg = rng.integers(0, 3, size=(2, 11)).astype(np.int32)
  q_seg[0, 0] = 7  # Matches no key: must come out as zeros.
  mask = reference_mask(2, 5, 11, causal=False, q_seg=q_seg, kv_seg=kv_seg)
  out, _ = _check(rng, q, k, v, mask, causal=False, segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  np.testing.assert_array_equal(out[0, 0], 0.0)


def test_cross_attention_non_causal():
  rng = np.random.default_rng(5)
  q, k, v = _inputs(rng, 2, 5, 11, 2, 1, 16)
  _check(rng, q, k, v, reference_mask(2, 5, 11, causal=False), causal=False)


@pytest.mark.parametrize("t,s,window", [(4, 10, None), (4, 10, 3), (6, 3, None)])
def test_causal_unequal_lengths_align_ends(t, s, window):
  rng = np.random.default_rng(6)
  q, k, v = _inputs(rng, 2, t, s, 2, 2, 8)
  _check(rng, q, k, v, reference_mask(2, t, s, causal=True, window=window), window=window)


def test_last_queries_match_full_call():
  rng = np.random.default_rng(7)
  q, k, v = _inputs(rng, 1, 12, 12, 2, 2, 8)
  fn = lambda q, k, v: attention(q, k, v, window=5, impl="xla")
  np.testing.assert_allclose(_jitted(fn, q[:, -3:], k, v), _jitted(fn, q, k, v)[:, -3:], atol=F32_ATOL)


@pytest.mark.parametrize("t", [3, 1])  # 1: a decoding step.
@pytest.mark.parametrize("window", [None, 4])
def test_cache_positions_with_empty_slots(window, t):
  rng = np.random.default_rng(8)
  b, s = 3, 12
  q, k, v = _inputs(rng, b, t, s, 4, 2, 8)
  filled = [9, 0, 5]  # Row 1 has an empty cache: its queries see nothing.
  kv_pos = np.full((b, s), EMPTY, np.int32)
  q_pos = np.zeros((b, t), np.int32)
  for bi, n in enumerate(filled):
    kv_pos[bi, :n] = rng.permutation(n)  # Slot order need not follow positions.
    q_pos[bi] = np.arange(max(n - t, 0), max(n - t, 0) + t) if n else 0
  mask = reference_mask(b, t, s, causal=True, window=window, q_pos=q_pos, kv_pos=kv_pos)
  assert not mask[1].any()
  out, grads = _check(rng, q, k, v, mask, window=window, q_positions=jnp.asarray(q_pos),
                      kv_positions=jnp.asarray(kv_pos))
  np.testing.assert_array_equal(out[1], 0.0)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  np.testing.assert_array_equal(grads[0][1], 0.0)


def test_bfloat16():
  rng = np.random.default_rng(9)
  q, k, v = _inputs(rng, 2, 16, 16, 4, 2, 16, jnp.bfloat16)
  out = _jitted(lambda q, k, v: attention(q, k, v, window=6, impl="xla"), q, k, v)
  assert out.dtype == jnp.bfloat16
  ref, _ = _reference_value_and_grads(q, k, v, reference_mask(2, 16, 16, causal=True, window=6), 0.25,
                                      jnp.zeros(q.shape))
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=BF16_ATOL)


def test_jit_and_vmap():
  rng = np.random.default_rng(10)
  q, k, v = _inputs(rng, 3, 8, 8, 4, 2, 8)
  seg = jnp.asarray(_packed_segments(rng, 3, 8))
  fn = lambda q, k, v, seg: attention(q, k, v, window=3, segment_ids=seg)
  eager = fn(q, k, v, seg)
  np.testing.assert_allclose(jax.jit(fn)(q, k, v, seg), eager, atol=F32_ATOL)
  # vmap over a leading axis that the op does not know about: each slice is a batch of one.
  per_row = jax.vmap(lambda q, k, v, seg: fn(q[None], k[None], v[None], seg[None])[0])
  np.testing.assert_allclose(jax.jit(per_row)(q, k, v, seg), eager, atol=F32_ATOL)


# --- cuDNN: the argument mapping runs through JAX's own XLA implementation of the same call on CPU. ---


@pytest.mark.parametrize("causal, window, t, s", [(True, w, 16, 16) for w in (None, 1, 2, 5, 16, 30)]
                         + [(False, None, 5, 9)])  # The last case: non-causal cross-attention.
def test_cudnn_mapping_matches_xla(causal, window, t, s):
  rng = np.random.default_rng(11)
  q, k, v = _inputs(rng, 2, t, s, 4, 2, 8)
  mapped = _jitted(lambda q, k, v: cudnn.attention(q, k, v, causal=causal, window=window, scale=0.3,
                                                   implementation="xla"), q, k, v)
  ours = _jitted(lambda q, k, v: attention(q, k, v, causal=causal, window=window, scale=0.3, impl="xla"), q, k, v)
  np.testing.assert_allclose(mapped, ours, atol=F32_ATOL)


def test_cudnn_window_conversion():
  assert cudnn.dot_product_attention_kwargs(causal=True, window=4, s=16) == {
      "is_causal": True, "local_window_size": (3, 0)}
  assert cudnn.dot_product_attention_kwargs(causal=True, window=16, s=16) == {"is_causal": True}


@pytest.mark.parametrize("change,fragment", [
    ({}, None),
    ({"dtype": jnp.float32}, "float16 or bfloat16"),
    ({"has_positions": True}, "positions"),
    ({"has_segment_ids": True}, "segment_ids"),
    ({"q_shape": (2, 16, 4, 12)}, "head dim"),
    ({"q_shape": (2, 16, 4, 512)}, "head dim"),
    ({"q_shape": (2, 4, 4, 64)}, "T != S"),
    ({"q_shape": (2, 4, 4, 64), "causal": False}, None),
])
def test_cudnn_unsupported_reason(change, fragment):
  args = dict(q_shape=(2, 16, 4, 64), kv_shape=(2, 16, 2, 64), dtype=jnp.bfloat16, causal=True,
              has_positions=False, has_segment_ids=False)
  args.update(change)
  reason = cudnn.unsupported_reason(args.pop("q_shape"), args.pop("kv_shape"), args.pop("dtype"), **args)
  if fragment is None:
    assert reason is None
  else:
    assert fragment in reason


def test_impl_dispatch_off_gpu():
  rng = np.random.default_rng(13)
  q, k, v = _inputs(rng, 1, 8, 8, 2, 2, 8, jnp.bfloat16)
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="impl='cudnn'"):
      attention(q, k, v, impl="cudnn")
  auto = _jitted(lambda q, k, v: attention(q, k, v, impl="auto"), q, k, v)
  xla = _jitted(lambda q, k, v: attention(q, k, v, impl="xla"), q, k, v)
  if jax.default_backend() == "gpu":  # auto may pick cuDNN there: same math, other rounding.
    np.testing.assert_allclose(np.float32(auto), np.float32(xla), atol=BF16_ATOL, rtol=0)
  else:
    np.testing.assert_array_equal(auto, xla)
  with pytest.raises(ValueError, match="unknown impl"):
    attention(q, k, v, impl="flash")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("window", [None, 1, 5])
def test_cudnn_matches_xla_on_gpu(window):
  rng = np.random.default_rng(14)
  reason, _ = cudnn.device_unsupported_reason()
  if reason:  # An older or non-NVIDIA GPU; on a capable one this shape must run, so any error fails the test.
    pytest.skip(reason)
  q, k, v = _inputs(rng, 2, 128, 128, 4, 2, 64, jnp.bfloat16)
  out = attention(q, k, v, window=window, impl="cudnn")
  ref = attention(q, k, v, window=window, impl="xla")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=BF16_ATOL)


# --- Validation. ---


def _valid():
  return _inputs(np.random.default_rng(15), 2, 6, 6, 4, 2, 8)


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), "must be \\[B"),
    (lambda q, k, v: (q, k, v[:, :3]), "same shape"),
    (lambda q, k, v: (q.astype(jnp.bfloat16), k, v), "share a dtype"),
    (lambda q, k, v: (q.astype(jnp.int32), k, v), "floating point"),
    (lambda q, k, v: (q[..., :3, :], k, v), "multiple of key/value heads"),
    (lambda q, k, v: (q[..., :4], k, v), "head_dim"),
])
def test_rejects_bad_qkv(mutate, match):
  with pytest.raises(ValueError, match=match):
    attention(*mutate(*_valid()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), ">= 1"),
    (dict(window=2.5), "window must be a static int"),
    (dict(window=2, causal=False), "causal=True"),
    (dict(q_positions=jnp.zeros((2, 6), jnp.int32)), "both"),
    (dict(q_positions=jnp.zeros((2, 6), jnp.int32), kv_positions=jnp.zeros((2, 6), jnp.int32), causal=False),
     "causal=True"),
    (dict(q_positions=jnp.zeros((2, 5), jnp.int32), kv_positions=jnp.zeros((2, 6), jnp.int32)), "shape"),
    (dict(q_positions=jnp.zeros((2, 6)), kv_positions=jnp.zeros((2, 6), jnp.int32)), "integers"),
    (dict(segment_ids=jnp.zeros((2, 5), jnp.int32)), "shape"),
    (dict(segment_ids=(jnp.zeros((2, 6), jnp.int32),)), "2 entries"),
])
def test_rejects_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    attention(*_valid(), **kwargs)


def test_single_segment_ids_need_equal_lengths():
  rng = np.random.default_rng(16)
  q, k, v = _inputs(rng, 1, 4, 6, 2, 2, 8)
  with pytest.raises(ValueError, match="T == S"):
    attention(q, k, v, causal=False, segment_ids=jnp.zeros((1, 4), jnp.int32))
