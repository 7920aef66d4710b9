"""The compiled GPU kernels (Triton lowerings of the Pallas kernels, cuDNN attention), not the interpreter: values and
gradients against float64 references at small shapes, for every kernel and mask kind, and the one-line refusal of a
second derivative. `pytest -m gpu` selects them; without a GPU they skip.

Tolerances are relative to the largest magnitude of the compared array (atol = rtol * max|expected|). On the GPU a
float32 matmul inside a kernel may use TF32 (10 mantissa bits, 2^-11 relative per product), and sums run in another
order than the reference's: float32 cases allow 2e-3. bfloat16 inputs are rounded before the reference sees them;
outputs and gradients are rounded once more to bfloat16 (2^-8 relative) and probabilities before their products:
allow 2^-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import reference_mask, reference_value_and_grads, value_and_grads
from wkv7_reference import wkv7_reference

from ltm_jax import ops
from ltm_jax.ops.attention import cudnn
from ltm_jax.ops.quant_matmul import quant_matmul
from ltm_pallas import wkv7_segmented

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu",
                       reason="needs a GPU: the Triton and cuDNN kernels are compiled only for one"),
]

F32_RTOL, BF16_RTOL = 2e-3, 2.0**-5
TRITON_CALL = "__gpu$xla.gpu.triton"


def _rtol(dtype) -> float:
  return F32_RTOL if jnp.dtype(dtype) == jnp.float32 else BF16_RTOL


def _close(got, want, rtol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), what
  np.testing.assert_allclose(got, want, rtol=0, atol=rtol * max(np.max(np.abs(want)), 1e-30), err_msg=what)


def _lowered(fn, *args) -> str:
  return jax.jit(fn).lower(*args).as_text()


def _vjp(fn, args, cotangent):
  """fn(*args) and the gradients of sum(fn(*args) * cotangent) w.r.t. every arg, in one jitted call."""
  @jax.jit
  def run(args, cotangent):
    out, pullback = jax.vjp(fn, *args)
    return out, pullback(cotangent)
  return run(args, cotangent)


def _to64(tree):
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)


# Attention: (B, T, S, Hq, Hkv, D), causal, window, segment ids (self-attention, two packed sequences).
ATTENTION = {
    "causal": ((2, 48, 48, 4, 2, 32), True, None, False),
    "window": ((2, 48, 48, 4, 2, 32), True, 7, False),
    "full": ((2, 40, 56, 4, 4, 32), False, None, False),
    "causal_t_lt_s": ((1, 24, 56, 2, 1, 64), True, None, False),
    "segments": ((2, 48, 48, 2, 2, 32), True, None, True),
    "segments_window": ((2, 48, 48, 2, 2, 32), True, 5, True),
}


def _attention_case(name, dtype, seed=0):
  (b, t, s, hq, hkv, d), causal, window, segmented = ATTENTION[name]
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, t, hq, d), (b, s, hkv, d),
                                                                            (b, s, hkv, d)))
  segments = None
  masks = dict(causal=causal, window=window)
  if segmented:
    ids = np.where(np.arange(t)[None] < rng.integers(t // 4, 3 * t // 4, (b, 1)), 0, 1).astype(np.int32)
    segments = jnp.asarray(ids)
    masks.update(q_seg=ids, kv_seg=ids)
  cotangent = jnp.asarray(rng.standard_normal(q.shape), dtype)
  return (q, k, v), cotangent, reference_mask(b, t, s, **masks), dict(causal=causal, window=window,
                                                                      segment_ids=segments)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_pallas_attention_compiled_matches_float64(name, dtype):
  (q, k, v), cotangent, mask, kwargs = _attention_case(name, dtype)
  fn = lambda q, k, v: ops.attention(q, k, v, impl="pallas", **kwargs)
  assert TRITON_CALL in _lowered(fn, q, k, v)
  out, grads = value_and_grads(fn, q, k, v, cotangent)
  ref, ref_grads = reference_value_and_grads(q, k, v, mask, q.shape[-1] ** -0.5, cotangent)
  for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    _close(got, want, _rtol(dtype), f"{name} {what}")


@pytest.mark.parametrize("name", ["causal", "window", "full"])
def test_cudnn_attention_matches_float64(name):
  reason, max_head_dim = cudnn.device_unsupported_reason()
  if reason:  # An older or non-NVIDIA GPU: cuDNN's flash attention is not there.
    pytest.skip(reason)
  (q, k, v), cotangent, mask, kwargs = _attention_case(name, jnp.bfloat16, seed=1)
  fn = lambda q, k, v: ops.attention(q, k, v, impl="cudnn", **kwargs)
  assert "cudnn" in _lowered(fn, q, k, v).lower()
  out, grads = value_and_grads(fn, q, k, v, cotangent)
  ref, ref_grads = reference_value_and_grads(q, k, v, mask, q.shape[-1] ** -0.5, cotangent)
  for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    _close(got, want, BF16_RTOL, f"{name} {what}")


def _wkv4_reference(w, u, k, v):
  """y [B, T, C] of the RWKV-4 recurrence from an empty state, without the running max (finite in float64 here)."""
  def step(carry, kv):
    a, b = carry
    k_t, v_t = kv
    bonus = jnp.exp(u + k_t)
    return (jnp.exp(w) * a + jnp.exp(k_t) * v_t, jnp.exp(w) * b + jnp.exp(k_t)), (a + bonus * v_t) / (b + bonus)
  zeros = jnp.zeros(k.shape[::2], k.dtype)
  _, y = jax.lax.scan(step, (zeros, zeros), (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)))
  return jnp.swapaxes(y, 0, 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_wkv4_pallas_compiled_matches_float64(dtype):
  rng = np.random.default_rng(2)
  b, t, c = 2, 45, 40  # T and C not multiples of the kernel's chunk and channel block.
  w, u = jnp.asarray(-np.exp(rng.uniform(-3, 1, c)), jnp.float32), jnp.asarray(rng.normal(0, 0.5, c), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, c)), dtype) for _ in range(2))
  cotangent = jnp.asarray(rng.normal(size=(b, t, c)), dtype)
  fn = lambda w, u, k, v: ops.wkv4(w, u, k, v, impl="pallas")[0]
  assert TRITON_CALL in _lowered(fn, w, u, k, v)
  out, grads = _vjp(fn, (w, u, k, v), cotangent)
  with jax.enable_x64(True):
    ref, ref_grads = _vjp(_wkv4_reference, _to64((w, u, k, v)), _to64(cotangent))
  for what, got, want in zip(("y", "dw", "du", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    _close(got, want, _rtol(dtype), what)


def _wkv7_inputs(seed, shape, dtype, low):
  """RWKV-7's structure (a = -kk, b = kk * a_lr, kk a unit vector): contractive transitions; log-decays
  -exp(U(low, 0.3)) (the chunked kernels take w >= -3.75 at chunk 16)."""
  rng = np.random.default_rng(seed)
  bsz, _, heads, size = shape
  r, k, v = (rng.normal(size=shape) for _ in range(3))
  w = -np.exp(rng.uniform(low, 0.3, shape))
  kk = rng.normal(size=shape)
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  a, b = -kk, kk * rng.uniform(0, 1, shape)
  seq = tuple(jnp.asarray(x, dtype) for x in (r, w, k, v, a, b))
  state = jnp.asarray(0.5 * rng.normal(size=(bsz, heads, size, size)), jnp.float32)
  cot = (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=state.shape), jnp.float32))
  return (*seq, state), cot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["pallas", "pallas_chunked"])
def test_wkv7_pallas_compiled_matches_float64(impl, dtype):
  # pallas_chunked runs its chunked kernels at head size 32 in float32 and 64 in bfloat16, in their decay range.
  _check_wkv7(lambda *args: ops.wkv7(*args, impl=impl), 3, 40, dtype)


def _check_wkv7(fn, seed, length, dtype):
  """fn's y, final state and seven gradients at (2, length, 2, N) against the float64 recurrence; N is 32 in float32
  and 64 in bfloat16, inside the chunked kernels' decay range."""
  size = 32 if dtype == jnp.float32 else 64
  inputs, cot = _wkv7_inputs(seed, (2, length, 2, size), dtype, low=-4.0)
  assert TRITON_CALL in _lowered(fn, *inputs)
  out, grads = _vjp(fn, inputs, cot)
  with jax.enable_x64(True):
    ref, ref_grads = _vjp(wkv7_reference, _to64(inputs), _to64(cot))
  for what, got, want in zip(("y", "state"), out, ref):
    _close(got, want, _rtol(dtype), what)
  for what, got, want in zip(("dr", "dw", "dk", "dv", "da", "db", "dstate"), grads, ref_grads):
    _close(got, want, _rtol(dtype), what)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_wkv7_segmented_compiled_matches_float64(dtype):
  # Four segments of 64 tokens (T = 250 padded to 256): the state-only kernels, the scan over segments, the chunked
  # kernels on the folded batch and the hand-written backward, compiled.
  _check_wkv7(lambda *args: wkv7_segmented.wkv7(*args, segments=4), 4, 250, dtype)


@pytest.mark.parametrize("packed", [False, True], ids=["int8", "int4"])
def test_quant_matmul_pallas_compiled_matches_float64(packed):
  rng = np.random.default_rng(4)
  m, groups, group, n = 5, 2, 64, 48
  bound = 7 if packed else 127
  ints = rng.integers(-bound, bound + 1, size=(groups, group, n))
  scale = rng.uniform(0.01, 0.1, size=(groups, n))
  if packed:  # Byte i of a group: input i in the low nibble, input i + group/2 in the high one.
    half = group // 2
    stored = (ints[:, :half] & 0xF) | ((ints[:, half:] & 0xF) << 4)
    stored = np.where(stored >= 128, stored - 256, stored)
  else:
    stored = ints
  values, scale32 = jnp.asarray(stored, jnp.int8), jnp.asarray(scale, jnp.float32)
  x = rng.normal(size=(m, groups * group))
  fn = lambda x: quant_matmul(x, values, scale32, packed=packed, impl="pallas")
  assert TRITON_CALL in _lowered(fn, jnp.asarray(x, jnp.float32))
  want = x @ (ints * scale[:, None, :]).reshape(groups * group, n)
  _close(jax.jit(fn)(jnp.asarray(x, jnp.float32)), want, F32_RTOL, "float32")
  xb = jnp.asarray(x, jnp.bfloat16)
  _close(jax.jit(fn)(xb), np.asarray(xb, np.float64) @ (ints * scale[:, None, :]).reshape(-1, n), BF16_RTOL,
         "bfloat16")


def _second(f):
  first = jax.grad(lambda x: jnp.sum(jnp.sin(f(x).astype(jnp.float32))))
  return jax.grad(lambda x: jnp.sum(jnp.sin(first(x).astype(jnp.float32))))


REFUSED = {
    "attention_pallas": (lambda q: ops.attention(q, q, q, causal=True, impl="pallas"), (1, 32, 2, 32),
                         jnp.float32, "attention: impl='pallas'"),
    "attention_cudnn": (lambda q: ops.attention(q, q, q, causal=True, impl="cudnn"), (1, 32, 2, 64), jnp.bfloat16,
                        "attention: impl='cudnn'"),
    "wkv4_pallas": (lambda k: ops.wkv4(-jnp.exp(k[0, 0]), k[0, 1], k, k, impl="pallas")[0], (1, 32, 16),
                    jnp.float32, "wkv4: impl='pallas'"),
    "wkv7_pallas": (lambda x: ops.wkv7(x, -jax.nn.sigmoid(x), x, x, -x, x * x, impl="pallas")[0], (1, 32, 1, 16),
                    jnp.float32, "wkv7: impl='pallas'"),
    "wkv7_pallas_chunked": (lambda x: ops.wkv7(x, -jax.nn.sigmoid(x), x, x, -x, x * x, impl="pallas_chunked")[0],
                            (1, 32, 1, 32), jnp.bfloat16, "impl='pallas_chunked'"),
}


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_compiled_kernels_refuse_a_second_derivative_in_one_line(op):
  f, shape, dtype, name = REFUSED[op]
  if op == "attention_cudnn" and cudnn.device_unsupported_reason()[0]:
    pytest.skip(cudnn.device_unsupported_reason()[0])
  x = jnp.asarray(np.random.default_rng(5).normal(size=shape), dtype)
  with pytest.raises(NotImplementedError, match="no second derivative") as error:
    jax.jit(_second(f))(x)
  assert "\n" not in str(error.value) and name in str(error.value)


def test_quant_matmul_pallas_compiled_has_second_derivatives():
  """Its derivatives come from the XLA reference, so they exist on the GPU too; against float64."""
  rng = np.random.default_rng(6)
  ints = rng.integers(-127, 128, size=(1, 32, 16))
  x = rng.normal(size=(3, 32)) * 0.1
  fn = lambda x: quant_matmul(x, jnp.asarray(ints, jnp.int8), jnp.full((1, 16), 0.02, jnp.float32), packed=False,
                              impl="pallas")
  got = jax.jit(_second(fn))(jnp.asarray(x, jnp.float32))
  with jax.enable_x64(True):
    want = _second(lambda x: x @ (jnp.asarray(ints, jnp.float64) * 0.02)[0])(jnp.asarray(x))
  _close(got, want, F32_RTOL, "second derivative")
