"""Numerics of ltm_jax.ops.wkv7, every backend against a plain float64 recurrence written out below."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ltm_pallas.wkv7
from ltm_jax.ops.wkv7 import AVAILABLE, empty_state, wkv7
from wkv7_reference import wkv7_reference

# Tolerances, each relative to the largest magnitude in the compared array (atol = rtol * max|expected|), so that
# entries which cancel to near zero are judged on the array's scale. float32 over a few dozen tokens: every backend
# lands near 2e-7 (the chunked form up to 1e-6 in some gradients).
F32_RTOL = 1e-5
# bfloat16 inputs: the reference sees the same rounded inputs, so y's error is float32's plus one rounding to
# bfloat16 (2^-8 relative). The gradients are rounded once to bfloat16 as well, and are allowed two units (2^-7).
# The state never leaves float32 and keeps F32_RTOL.
BF16_Y_RTOL, BF16_GRAD_RTOL = 2.0**-8, 2.0**-7
NAMES = ("r", "w", "k", "v", "a", "b", "state")
SHAPE = (2, 37, 2, 8)  # B, T, H, N: T is odd and not a multiple of any chunk length.
# "pallas_chunked" runs its sequential fallback at head size 8 (its kernels start at 16), which "pallas" already
# covers here: its own kernels are held to the reference in test_wkv7_chunked_pallas.py. "pallas_mgpu" takes head sizes
# 64 and 128 only, bfloat16 products and jax >= 0.11: test_wkv7_mgpu.py holds it to the reference.
IMPLS = tuple(impl for impl in AVAILABLE if impl not in ("pallas_chunked", "pallas_mgpu"))


def _log_decays(rng, shape, low=-6.0, high=2.5):
  """w = -exp(U(low, high)): from -0.0025 (a memory of ~400 tokens) down to -12 (forgets within a token)."""
  return -np.exp(rng.uniform(low, high, shape))


def _inputs(seed, shape=SHAPE, *, realistic=True, w=None):
  """Random float32 (r, w, k, v, a, b, state).

  realistic: RWKV-7's a = -kk, b = kk·a_lr with kk a unit vector per head and a_lr in (0, 1), which keeps every
  transition contractive. Otherwise a and b are independent random vectors of norm ~0.5 (bounded, not structured).
  """
  rng = np.random.default_rng(seed)
  batch, _, heads, size = shape
  normal = lambda *s: rng.normal(size=s)
  r, k, v = normal(*shape), normal(*shape), normal(*shape)
  w = _log_decays(rng, shape) if w is None else np.broadcast_to(w, shape)
  if realistic:
    kk = normal(*shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a, b = -kk, kk * rng.uniform(0.0, 1.0, shape)
  else:
    a, b = (0.5 / np.sqrt(size) * normal(*shape) for _ in range(2))
  state = 0.5 * normal(batch, heads, size, size)
  return tuple(jnp.asarray(x, jnp.float32) for x in (r, w, k, v, a, b, state))


def _cotangents(seed, shape=SHAPE):
  """Random weights for y [B, T, H, N] and for the final state [B, H, N, N]."""
  rng = np.random.default_rng(seed + 1000)
  batch, _, heads, size = shape
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in (shape, (batch, heads, size, size)))


def _weighted(cot, y, state):
  return jnp.sum(cot[0] * y) + jnp.sum(cot[1] * state)


@jax.jit
def _reference_and_grads(inputs, cot):
  def loss(inputs):
    out = wkv7_reference(*inputs)
    return _weighted(cot, *out), out

  (_, out), grads = jax.value_and_grad(loss, has_aux=True)(inputs)
  return out, grads


def _run_reference(inputs, cot):
  """(y, final state) and the gradients of `_weighted` w.r.t. all seven inputs, in float64 numpy."""
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # Exact: every float32 and bfloat16 fits.
    return jax.tree.map(np.asarray, _reference_and_grads(jax.tree.map(to64, inputs), jax.tree.map(to64, cot)))


def _outputs_and_grads(impl, transform=lambda f: f):
  """A function of (inputs, cot) giving (y, state) and the gradients of `_weighted` w.r.t. every input."""

  def loss(inputs, cot):
    y, state = transform(lambda *args: wkv7(*args, impl=impl))(*inputs)
    return _weighted(cot, y.astype(jnp.float32), state), (y, state)

  def run(inputs, cot):
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(inputs, cot)
    return out, grads

  return run


# One jitted function per backend, shared by the tests so that equal shapes compile once.
_JITTED = {impl: jax.jit(_outputs_and_grads(impl)) for impl in IMPLS}


def _assert_close(actual, expected, rtol, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


def _assert_matches_reference(impl, inputs, cot, rtol=F32_RTOL, y_rtol=None, grad_rtol=None):
  """Checks the final state to rtol, y to y_rtol and every gradient to grad_rtol (both default to rtol)."""
  (y, state), grads = _JITTED[impl](inputs, cot)
  (y_ref, state_ref), grads_ref = _run_reference(inputs, cot)
  _assert_close(y, y_ref, y_rtol or rtol, "y")
  _assert_close(state, state_ref, rtol, "final state")
  for name, g, g_ref in zip(NAMES, grads, grads_ref):
    _assert_close(g, g_ref, grad_rtol or rtol, f"grad {name}")
  return y, state, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_rwkv7_keys(impl):
  _assert_matches_reference(impl, _inputs(0), _cotangents(0))


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_random_bounded_keys(impl):
  _assert_matches_reference(impl, _inputs(1, realistic=False), _cotangents(1))


@pytest.mark.parametrize("impl", IMPLS)
def test_strong_and_weak_decays(impl):
  # Per key channel: decays from w = -e^6 (e^w = 0 in float32) through -8 and -1 to -1e-6 (e^w = 1 - 1e-6). A chunk
  # of 16 tokens at w = -8 decays by e^-128, which overflows any form that factors e^{g_t - g_s} as e^{g_t}·e^{-g_s}.
  w = np.array([-np.exp(6.0), -20.0, -8.0, -3.0, -1.0, -1e-2, -1e-4, -1e-6])
  _assert_matches_reference(impl, _inputs(2, w=w), _cotangents(2))


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_inputs(impl):
  *inputs, state = _inputs(3)
  inputs = (*(x.astype(jnp.bfloat16) for x in inputs), state)
  y, state, grads = _assert_matches_reference(
      impl, inputs, _cotangents(3), y_rtol=BF16_Y_RTOL, grad_rtol=BF16_GRAD_RTOL)
  assert y.dtype == jnp.bfloat16 and state.dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in grads[:6]) and grads[6].dtype == jnp.float32


@pytest.mark.parametrize("impl", IMPLS)
def test_segmented_equals_whole(impl):
  *inputs, state = _inputs(4)
  run = jax.jit(wkv7, static_argnames="impl")
  cut = 13  # Neither segment is a whole number of chunks.
  for start in (state, empty_state(*state.shape[:3])):
    y_whole, s_whole = run(*inputs, start, impl=impl)
    y1, s1 = run(*(x[:, :cut] for x in inputs), start, impl=impl)
    y2, s2 = run(*(x[:, cut:] for x in inputs), s1, impl=impl)
    _assert_close(jnp.concatenate([y1, y2], axis=1), y_whole, F32_RTOL, "y")
    _assert_close(s2, s_whole, F32_RTOL, "state")


@pytest.mark.parametrize("impl", IMPLS)
def test_none_state_is_zero_state(impl):
  *inputs, _ = _inputs(5)
  batch, _, heads, size = SHAPE
  zeros = empty_state(batch, heads, size)
  assert zeros.shape == (batch, heads, size, size) and zeros.dtype == jnp.float32
  run = jax.jit(wkv7, static_argnames="impl")
  y_none, s_none = run(*inputs, impl=impl)
  y_zero, s_zero = run(*inputs, zeros, impl=impl)
  np.testing.assert_array_equal(y_none, y_zero)
  np.testing.assert_array_equal(s_none, s_zero)
  _assert_matches_reference(impl, (*inputs, zeros), _cotangents(5))


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpointed_gradients_agree(impl):
  # Under jax.checkpoint a custom_vjp forward may run twice (jax#21303): it must give the same result both times.
  inputs, cot = _inputs(6), _cotangents(6)
  expected = _JITTED[impl](inputs, cot)
  checkpointed = jax.jit(_outputs_and_grads(impl, jax.checkpoint))(inputs, cot)
  jax.tree.map(lambda x, y: _assert_close(x, y, F32_RTOL, "checkpoint"), checkpointed, expected)


def test_pallas_under_remat_writes_checkpoints_once():
  """Under jax.checkpoint the forward pass runs the kernel without state checkpoints (the primal) and only the
  recomputation writes them; without remat the forward writes them once, as the backward needs."""
  inputs, cot = _inputs(6), _cotangents(6)
  loss = lambda *inputs: _weighted(cot, *ltm_pallas.wkv7.wkv7(*inputs, interpret=True))
  kernels = lambda fn: sorted(re.findall(r"name=(wkv7_\w+)", str(jax.make_jaxpr(jax.grad(fn, argnums=0))(*inputs))))
  assert kernels(loss) == ["wkv7_backward", "wkv7_forward"]
  assert kernels(jax.checkpoint(loss)) == ["wkv7_backward", "wkv7_forward", "wkv7_forward_primal"]
  plain, rematted = jax.grad(loss, argnums=0)(*inputs), jax.jit(jax.grad(jax.checkpoint(loss), argnums=0))(*inputs)
  np.testing.assert_array_equal(plain, rematted)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_token_decoding_matches_prefill(impl):
  *inputs, state = _inputs(7, (1, 5, 2, 8))
  run = jax.jit(wkv7, static_argnames="impl")
  y_all, s_all = run(*inputs, state, impl=impl)
  s = state
  for t in range(5):
    y_t, s = run(*(x[:, t:t + 1] for x in inputs), s, impl=impl)
    _assert_close(y_t[:, 0], y_all[:, t], F32_RTOL, f"y[{t}]")
  _assert_close(s, s_all, F32_RTOL, "state")


@pytest.mark.parametrize(("chunk", "forward_block", "backward_block"), [(4, 4, 2), (8, 2, 8)])
def test_pallas_block_and_chunk_options(chunk, forward_block, backward_block):
  # Several value-row blocks per head (the backward then sums per-block partial gradients) and other chunk lengths.
  inputs, cot = _inputs(8), _cotangents(8)

  def loss(inputs):
    out = ltm_pallas.wkv7.wkv7(*inputs, chunk=chunk, forward_block=forward_block, backward_block=backward_block,
                           interpret=True)
    return _weighted(cot, *out), out

  (_, (y, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(inputs)
  (y_ref, state_ref), grads_ref = _run_reference(inputs, cot)
  _assert_close(y, y_ref, F32_RTOL, "y")
  _assert_close(state, state_ref, F32_RTOL, "final state")
  for name, g, g_ref in zip(NAMES, grads, grads_ref):
    _assert_close(g, g_ref, F32_RTOL, f"grad {name}")


def test_pallas_kernels_lower_to_triton(cuda_lowering):
  # The GPU path without a GPU: both kernels (bfloat16, N = 64 and 128, several value blocks) go through the Pallas
  # Triton lowering, which rejects what Triton cannot express (non-power-of-two blocks, unsupported ops). Compiling
  # the Triton IR to PTX still needs a GPU.
  for size, blocks in ((64, (32, 64)), (128, (32, 64))):
    seq = jax.ShapeDtypeStruct((2, 48, 2, size), jnp.bfloat16)
    state = jax.ShapeDtypeStruct((2, 2, size, size), jnp.float32)

    def loss(*args):
      y, final = ltm_pallas.wkv7.wkv7(*args, forward_block=blocks[0], backward_block=blocks[1], interpret=False)
      return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    lowered = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*[seq] * 6, state).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("triton") >= 2  # The forward and backward kernels' custom calls.


@pytest.mark.slow
def test_long_sequence_chunked():
  # 1000 tokens (63 chunks passing the state on), decays from -1e-5 (memory far longer than the sequence) to -12.
  shape = (1, 1000, 1, 8)
  w = np.array([-1e-5, -1e-4, -1e-3, -1e-2, -0.1, -1.0, -4.0, -12.0])
  inputs, cot = _inputs(9, shape, w=w), _cotangents(9, shape)
  (y, state), grads = jax.jit(_outputs_and_grads("chunked"))(inputs, cot)
  (y_ref, state_ref), grads_ref = _run_reference(inputs, cot)
  _assert_close(y, y_ref, 1e-4, "y")
  _assert_close(state, state_ref, 1e-4, "final state")
  for name, g, g_ref in zip(NAMES, grads, grads_ref):
    _assert_close(g, g_ref, 1e-4, f"grad {name}")


def test_empty_sequence_returns_state():
  *inputs, state = _inputs(10)
  y, new_state = wkv7(*(x[:, :0] for x in inputs), state)
  assert y.shape == (2, 0, 2, 8)
  np.testing.assert_array_equal(new_state, state)


def test_rejects_bad_shapes_dtypes_and_impl():
  r, w, k, v, a, b, state = _inputs(11, (1, 3, 2, 4))
  bad_calls = [
      ("must all be", lambda: wkv7(r, w, k, v[:, :2], a, b)),
      ("must all be", lambda: wkv7(r[0], w[0], k[0], v[0], a[0], b[0])),
      ("state must be", lambda: wkv7(r, w, k, v, a, b, state[:, :1])),
      ("floating point", lambda: wkv7(r, w, k.astype(jnp.int32), v, a, b)),
      ("unknown impl", lambda: wkv7(r, w, k, v, a, b, impl="cuda")),
  ]
  for match, call in bad_calls:
    with pytest.raises(ValueError, match=match):
      call()
