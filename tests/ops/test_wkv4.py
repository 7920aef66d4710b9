"""Numerics of ltm_jax.ops.wkv4, every backend against a plain float64 recurrence written out below."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.wkv4 import AVAILABLE, EMPTY_MAX, Wkv4State, empty_state, wkv4

# Tolerances, each relative to the largest magnitude in the compared array (atol = rtol * max|expected|), so that
# entries which cancel to near zero are judged on the array's scale. float32 over a few dozen tokens lands near
# 3e-7; 16k tokens of slow decay sum far more terms (the w-gradient of the scan backend reaches ~2e-5).
F32_RTOL = 2e-6
LONG_RTOL = 2e-4
# Low precision: the reference sees the same rounded inputs, so y's error is float32's plus one rounding to the
# output dtype, within one unit in the last place (bfloat16 2^-8, float16 2^-11). The gradients pass through y's
# cotangent, rounded the same way, and dk, dv are rounded again: allow four units (bfloat16 2^-6 ≈ 1.6e-2; measured
# up to 5e-3). The state never leaves float32 and keeps F32_RTOL.
BF16_Y_RTOL, BF16_GRAD_RTOL = 2.0**-8, 2.0**-6
F16_Y_RTOL = 2.0**-11
NAMES = ("w", "u", "k", "v", "state.num", "state.den", "state.max")


def _inputs(seed, b, t, c, *, k_scale=1.0):
  """Random float32 (w, u, k, v, state): w = -exp(U(-3, 1)), and a state with a/b ~ N(0, 1), max in [-2, 2]."""
  rng = np.random.default_rng(seed)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  w = -np.exp(rng.uniform(-3.0, 1.0, c))
  u = rng.normal(0.0, 0.5, c)
  k = rng.normal(0.0, k_scale, (b, t, c))
  v = rng.normal(0.0, 1.0, (b, t, c))
  den = rng.uniform(0.5, 2.0, (b, c))
  state = Wkv4State(f32(den * rng.normal(0.0, 1.0, (b, c))), f32(den), f32(rng.uniform(-2.0, 2.0, (b, c))))
  return f32(w), f32(u), f32(k), f32(v), state


def _cotangents(seed, b, t, c):
  """Random weights for y [B, T, C], and for a/b [B, C] and log b [B, C] of the final state."""
  rng = np.random.default_rng(seed + 1000)
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, c), (b, c), (b, c)))


def _weighted(cot, y, ratio, log_b):
  """A random-weighted sum of the outputs; the final state enters as a/b and log b, scale-free views of (a, b)."""
  cy, cr, cb = cot
  return jnp.sum(cy * y) + jnp.sum(cr * ratio) + jnp.sum(cb * log_b)


def _reference(w, u, k, v, state):
  """The WKV recurrence without the running-max trick (float64 keeps it finite here); y and the final (a, b)."""
  num, den, mx = state
  a0, b0 = num * jnp.exp(mx), den * jnp.exp(mx)

  def step(carry, kv):
    a, b = carry
    k_t, v_t = kv
    bonus = jnp.exp(u + k_t)
    y_t = (a + bonus * v_t) / (b + bonus)
    return (jnp.exp(w) * a + jnp.exp(k_t) * v_t, jnp.exp(w) * b + jnp.exp(k_t)), y_t

  (a, b), y = jax.lax.scan(step, (a0, b0), (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)))
  return jnp.swapaxes(y, 0, 1), a, b


@jax.jit
def _reference_and_grads(inputs, cot):
  def loss(inputs):
    y, a, b = _reference(*inputs)
    return _weighted(cot, y, a / b, jnp.log(b)), (y, a, b)

  (_, out), grads = jax.value_and_grad(loss, has_aux=True)(inputs)
  return out, grads


def _run_reference(inputs, cot):
  """(y, a, b) and the gradients of `_weighted` w.r.t. (w, u, k, v, state), in float64 numpy."""
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # Exact: every float32, bfloat16, float16 fits.
    return jax.tree.map(np.asarray, _reference_and_grads(jax.tree.map(to64, inputs), jax.tree.map(to64, cot)))


def _outputs_and_grads(impl, transform=lambda f: f):
  """A function of (inputs, cot) giving (y, state) and the gradients of `_weighted` w.r.t. every input."""

  def loss(inputs, cot):
    y, s = transform(lambda *args: wkv4(*args, impl=impl))(*inputs)
    return _weighted(cot, y.astype(jnp.float32), s.num / s.den, jnp.log(s.den) + s.max), (y, s)

  def run(inputs, cot):
    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(inputs, cot)
    return out, grads

  return run


# One jitted function per backend, shared by the tests so that equal shapes compile once: XLA on CPU takes seconds
# to compile the associative scan and its transpose.
_JITTED = {impl: jax.jit(_outputs_and_grads(impl)) for impl in AVAILABLE}


def _plain(state):
  """(a, b) in float64 from the stabilised (num, den, max)."""
  num, den, mx = (np.asarray(s, np.float64) for s in state)
  return num * np.exp(mx), den * np.exp(mx)


def _assert_close(actual, expected, rtol, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


def _assert_matches_reference(impl, inputs, cot, rtol, y_rtol=None, grad_rtol=None):
  """Checks the final state to rtol, y to y_rtol and every gradient to grad_rtol (both default to rtol)."""
  y_rtol, grad_rtol = y_rtol or rtol, grad_rtol or rtol
  (y, state), grads = _JITTED[impl](inputs, cot)
  (y_ref, a_ref, b_ref), grads_ref = _run_reference(inputs, cot)
  _assert_close(y, y_ref, y_rtol, "y")
  a, b = _plain(state)
  _assert_close(a, a_ref, rtol, "final a")
  _assert_close(b, b_ref, rtol, "final b")
  for name, g, g_ref in zip(NAMES, jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    _assert_close(g, g_ref, grad_rtol, f"grad {name}")
  return y, state, grads


@pytest.mark.parametrize("impl", AVAILABLE)
def test_matches_reference_odd_shapes(impl):
  b, t, c = 2, 37, 5
  _assert_matches_reference(impl, _inputs(0, b, t, c), _cotangents(0, b, t, c), F32_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("impl", AVAILABLE)
def test_long_sequence_slow_and_fast_decay(impl):
  # 16k tokens with decays near 0 (memory of ~100..10k tokens) and near -20 (forgets within one token).
  b, t = 1, 16384
  _, u, k, v, state = _inputs(1, b, t, 6)
  w = jnp.asarray([-1e-4, -1e-3, -1e-2, -19.0, -20.0, -21.0], jnp.float32)
  _assert_matches_reference(impl, (w, u, k, v, state), _cotangents(1, b, t, 6), LONG_RTOL)


@pytest.mark.parametrize("impl", AVAILABLE)
def test_large_keys_do_not_overflow(impl):
  # Keys up to ~±150: e^k alone overflows float32, the running-max form must not. Same shapes as above: no compile.
  b, t, c = 2, 37, 5
  inputs, cot = _inputs(2, b, t, c, k_scale=50.0), _cotangents(2, b, t, c)
  (y, state), grads = _JITTED[impl](inputs, cot)
  (y_ref, a_ref, b_ref), _ = _run_reference(inputs, cot)
  _assert_close(y, y_ref, F32_RTOL, "y")
  # a and b themselves overflow float32; compare a/b and log b.
  _assert_close(np.asarray(state.num) / np.asarray(state.den), a_ref / b_ref, F32_RTOL, "a/b")
  _assert_close(np.log(np.asarray(state.den, np.float64)) + np.asarray(state.max), np.log(b_ref), F32_RTOL, "log b")
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("impl", AVAILABLE)
def test_bfloat16_inputs(impl):
  b, t, c = 2, 37, 5
  w, u, k, v, state = _inputs(3, b, t, c)
  inputs = (w, u, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), state)
  y, state, grads = _assert_matches_reference(
      impl, inputs, _cotangents(3, b, t, c), F32_RTOL, y_rtol=BF16_Y_RTOL, grad_rtol=BF16_GRAD_RTOL)
  assert y.dtype == jnp.bfloat16 and grads[2].dtype == jnp.bfloat16 and grads[3].dtype == jnp.bfloat16
  assert all(s.dtype == jnp.float32 for s in state)  # The state stays float32 and is held to float32 tolerance.


@pytest.mark.parametrize("impl", AVAILABLE)
def test_float16_inputs(impl):
  # Values only: the gradients take the bfloat16 path above, and compiling them again costs seconds.
  b, t, c = 2, 37, 5
  w, u, k, v, state = _inputs(9, b, t, c)
  inputs = (w, u, k.astype(jnp.float16), v.astype(jnp.float16), state)
  y, new_state = jax.jit(wkv4, static_argnames="impl")(*inputs, impl=impl)
  (y_ref, a_ref, _), _ = _run_reference(inputs, _cotangents(9, b, t, c))
  assert y.dtype == jnp.float16
  _assert_close(y, y_ref, F16_Y_RTOL, "y")
  _assert_close(_plain(new_state)[0], a_ref, F32_RTOL, "final a")


@pytest.mark.parametrize("impl", AVAILABLE)
def test_segmented_equals_whole(impl):
  b, t, c = 2, 37, 5
  w, u, k, v, state = _inputs(4, b, t, c)
  run = jax.jit(wkv4, static_argnames="impl")
  cut = 13
  for start in (state, empty_state(b, c)):
    y_whole, s_whole = run(w, u, k, v, start, impl=impl)
    y1, s1 = run(w, u, k[:, :cut], v[:, :cut], start, impl=impl)
    y2, s2 = run(w, u, k[:, cut:], v[:, cut:], s1, impl=impl)
    _assert_close(jnp.concatenate([y1, y2], axis=1), y_whole, F32_RTOL, "y")
    for x, x_whole in zip(_plain(s2), _plain(s_whole)):
      _assert_close(x, x_whole, F32_RTOL, "state")


@pytest.mark.parametrize("impl", AVAILABLE)
def test_none_state_is_empty_state(impl):
  b, t, c = 2, 4, 3
  w, u, k, v, _ = _inputs(5, b, t, c)
  empty = empty_state(b, c)
  assert all(s.shape == (b, c) and s.dtype == jnp.float32 for s in empty)
  np.testing.assert_array_equal(empty.max, np.float32(EMPTY_MAX))
  run = jax.jit(wkv4, static_argnames="impl")
  y_none, s_none = run(w, u, k, v, impl=impl)
  y_empty, s_empty = run(w, u, k, v, empty, impl=impl)
  np.testing.assert_array_equal(y_none, y_empty)
  jax.tree.map(np.testing.assert_array_equal, s_none, s_empty)
  # Values and gradients from the empty state (exactly zero for the state: e^{EMPTY_MAX} underflows in float64 too).
  b, t, c = 2, 37, 5  # The shapes of the tests above, so nothing compiles again.
  w, u, k, v, _ = _inputs(5, b, t, c)
  _assert_matches_reference(impl, (w, u, k, v, empty_state(b, c)), _cotangents(5, b, t, c), F32_RTOL)


@pytest.mark.parametrize("impl", AVAILABLE)
def test_weightless_tokens_on_an_empty_state_give_zero_and_finite_gradients(impl):
  """Left padding: the first tokens of an empty state with k at float32's lowest (weight 0). Their y is 0 / 0 in
  the recurrence; the op gives 0 there, and a loss that leaves those outputs out has finite gradients, those of the
  real tokens alone (the reference without the padding), and 0 for the padding's k and v."""
  b, t, c, pad = 2, 37, 5, 6  # The shapes of the tests above, so nothing compiles again.
  w, u, k, v, _ = _inputs(9, b, t, c)
  k = k.at[:, :pad].set(jnp.finfo(jnp.float32).min)
  cy, cr, cb = _cotangents(9, b, t, c)
  cy = cy.at[:, :pad].set(0.0)
  (y, state), grads = _JITTED[impl]((w, u, k, v, empty_state(b, c)), (cy, cr, cb))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
  np.testing.assert_array_equal(y[:, :pad], 0.0)
  (y_ref, a_ref, b_ref), grads_ref = _run_reference((w, u, k[:, pad:], v[:, pad:], empty_state(b, c)),
                                                     (cy[:, pad:], cr, cb))
  _assert_close(y[:, pad:], y_ref, F32_RTOL, "y")
  a_final, b_final = _plain(state)
  _assert_close(a_final, a_ref, F32_RTOL, "final a")
  _assert_close(b_final, b_ref, F32_RTOL, "final b")
  dw, du, dk, dv, _ = grads
  dw_ref, du_ref, dk_ref, dv_ref, _ = grads_ref
  for name, g, g_ref in (("w", dw, dw_ref), ("u", du, du_ref), ("k", dk[:, pad:], dk_ref), ("v", dv[:, pad:], dv_ref)):
    _assert_close(g, g_ref, F32_RTOL, f"grad {name}")
  np.testing.assert_array_equal(dk[:, :pad], 0.0)
  np.testing.assert_array_equal(dv[:, :pad], 0.0)


@pytest.mark.parametrize("impl", AVAILABLE)
def test_jit_checkpoint_vmap_agree(impl):
  b, t, c = 2, 6, 3
  inputs, cot = _inputs(6, b, t, c), _cotangents(6, b, t, c)
  expected = _JITTED[impl](inputs, cot)
  checkpointed = jax.jit(_outputs_and_grads(impl, jax.checkpoint))(inputs, cot)
  jax.tree.map(lambda x, y: _assert_close(x, y, F32_RTOL, "checkpoint"), checkpointed, expected)
  # vmap over a stack of three independent problems (their own w, u too) equals running them one by one.
  stack = [_inputs(7 + i, b, t, c) for i in range(3)]
  forward = lambda *args: wkv4(*args, impl=impl)
  batched = jax.jit(jax.vmap(forward))(*jax.tree.map(lambda *xs: jnp.stack(xs), *stack))
  for i, one in enumerate(stack):
    jax.tree.map(lambda x, y: _assert_close(x[i], y, F32_RTOL, "vmap"), batched, jax.jit(forward)(*one))


def test_rejects_bad_shapes_and_impl():
  w, u, k, v, state = _inputs(8, 2, 7, 3)
  bad_calls = [
      ("k and v must both be", lambda: wkv4(w, u, k, v[:, :5])),
      ("k and v must both be", lambda: wkv4(w, u, k[0], v[0])),
      ("w and u must be", lambda: wkv4(w[:2], u, k, v)),
      ("w and u must be", lambda: wkv4(w, u[None], k, v)),
      ("state must be", lambda: wkv4(w, u, k, v, Wkv4State(state.num, state.den, state.max[:1]))),
      ("state must be", lambda: wkv4(w, u, k, v, (state.num, state.den))),
      ("floating point", lambda: wkv4(w, u, k.astype(jnp.int32), v)),
      ("unknown impl", lambda: wkv4(w, u, k, v, impl="cuda")),
  ]
  for match, call in bad_calls:
    with pytest.raises(ValueError, match=match):
      call()
