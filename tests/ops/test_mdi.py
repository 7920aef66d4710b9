"""Numerics of ltm_jax.ops.mdi: both backends against a plain float64 per-token loop written out below (values and
gradients), segments with a carried state, bounds under adversarial inputs, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.mdi import AVAILABLE, mdi, mdi_step

EPS, CLIP = 1e-6, 100.0


def _loop(gate_z, z, gamma, keep, w_h, scale, h0, clip=CLIP):
  """The recurrence token by token, as the op's docstring states it (jnp so that jax.grad can differentiate it)."""
  h, hs = h0, []
  for t in range(gate_z.shape[1]):
    g = 1 / (1 + jnp.exp(-(gate_z[:, t] + h @ w_h)))
    u = (1 - g) * h + g * z[:, t] + gamma[:, t] * h
    new = u / jnp.sqrt(jnp.mean(u * u, axis=-1, keepdims=True) + EPS) * scale
    new = jnp.minimum(jnp.maximum(new, -clip), clip)
    h = jnp.where(keep[:, t, None], new, h)
    hs.append(h)
  return jnp.stack(hs, axis=1), h


def _inputs(seed, batch=3, length=6, width=8):
  rng = np.random.default_rng(seed)
  inputs = dict(gate_z=rng.normal(size=(batch, length, width)), z=rng.normal(size=(batch, length, width)),
                gamma=rng.uniform(0, 1, size=(batch, length, width)), w_h=rng.normal(size=(width, width)) / 2,
                scale=1 + 0.3 * rng.normal(size=width), h0=rng.normal(size=(batch, width)))
  keep = rng.uniform(size=(batch, length)) > 0.25
  keep[1, :4] = False  # Left padding.
  return inputs, keep


def _loss(outputs):
  """A scalar that weighs every output differently, so each gradient entry is tested."""
  hs, h = outputs
  weights = jnp.cos(jnp.arange(hs.size, dtype=hs.dtype)).reshape(hs.shape)
  return jnp.sum(weights * hs) + jnp.sum(jnp.sin(h))


def test_backends_match_the_float64_loop():
  """Values and gradients of both backends against the loop, to float64 rounding. The clip (1.5 against h of RMS
  ~1.3) binds on some channels and not others, so both of its branches are exercised."""
  inputs, keep = _inputs(0)
  clip = 1.5
  names = ("gate_z", "z", "gamma", "w_h", "scale", "h0")
  args = lambda dtype: tuple(jnp.asarray(inputs[k], dtype) for k in names)

  def outputs(run, dtype):  # One compilation for the outputs and every gradient.
    def f(*a):
      out = run(*a)
      return _loss(out), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))(*args(dtype))
    return out, grads

  with jax.enable_x64(True):
    expected, expected_grads = outputs(lambda *a: _loop(*a[:3], jnp.asarray(keep), *a[3:], clip=clip), jnp.float64)
    clipped = np.mean(np.abs(np.asarray(expected[0])) == clip)
    assert 0.05 < clipped < 0.95, clipped
    got64 = {impl: outputs(lambda *a: mdi(*a, mask=jnp.asarray(keep), clip=clip, impl=impl), jnp.float64)
             for impl in AVAILABLE}
  for impl in AVAILABLE:
    values, grads = got64[impl]
    assert values[0].dtype == jnp.float64
    for got, want in zip(values, expected):
      np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11, err_msg=impl)
    for name, got, want in zip(names, grads, expected_grads):
      np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=f"{impl} {name}")


def test_segments_with_carried_state_equal_the_whole_sequence():
  """Calls of 4, 1 and 4 tokens, and one-token steps through `mdi_step`, continue one another through h."""
  inputs, keep = _inputs(1, length=9)
  x = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
  seq = lambda a, b: (x["gate_z"][:, a:b], x["z"][:, a:b], x["gamma"][:, a:b], x["w_h"], x["scale"])

  @jax.jit
  def runs():
    whole = mdi(*seq(0, 9), x["h0"], mask=jnp.asarray(keep))
    parts, h = [], x["h0"]
    for a, b in ((0, 4), (4, 5), (5, 9)):
      hs, h = mdi(*seq(a, b), h, mask=jnp.asarray(keep[:, a:b]))
      parts.append(hs)
    stepped = x["h0"]
    for t in range(9):
      stepped = mdi_step(*(v[:, 0] for v in seq(t, t + 1)[:3]), x["w_h"], x["scale"], stepped,
                         keep=jnp.asarray(keep[:, t]))
    return whole, (jnp.concatenate(parts, axis=1), h), stepped

  (whole, h_whole), (parts, h), stepped = runs()
  np.testing.assert_allclose(parts, whole, rtol=0, atol=1e-6)
  np.testing.assert_allclose(h, h_whole, rtol=0, atol=1e-6)
  np.testing.assert_allclose(stepped, h_whole, rtol=0, atol=1e-6)


def test_state_stays_bounded_and_gradients_finite_under_adversarial_inputs():
  """Large activations, gamma at its upper clip, a large learned scale and a long sequence: the RMSNorm bounds the
  root mean square of h by the scale and the clip bounds every channel. Past ~1e18 float32 squares overflow inside
  the norm, which then maps h to zero: still finite."""
  rng = np.random.default_rng(2)
  batch, length, width = 2, 512, 16
  gate_z = jnp.asarray(rng.normal(size=(batch, length, width)) * 1e4, jnp.float32)
  z = jnp.asarray(rng.normal(size=(batch, length, width)) * 1e6, jnp.float32)
  gamma = jnp.full((batch, length, width), 1 - 1e-6, jnp.float32)
  w_h = jnp.asarray(rng.normal(size=(width, width)) * 1e3, jnp.float32)
  scale = jnp.asarray(np.r_[1e4, np.ones(width - 1)], jnp.float32)  # One channel's scale would exceed the clip.
  h0 = jnp.asarray(rng.normal(size=(batch, width)) * 1e6, jnp.float32)
  run = jax.jit(lambda *a: mdi(*a))  # The backend training uses; the forward is the reference's arithmetic.
  hs, h = run(gate_z, z, gamma, w_h, scale, h0)
  assert np.all(np.isfinite(hs)) and np.max(np.abs(hs)) <= CLIP
  assert np.max(np.abs(hs[..., 0])) == CLIP  # The clip binds on the large-scale channel; the others keep RMS <= 1.
  rms = np.sqrt(np.mean(np.asarray(hs[..., 1:]) ** 2, axis=-1))
  assert np.max(rms) <= np.sqrt(width / (width - 1)) * (1 + 1e-5)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a)[0][:, -64:]), argnums=(0, 1, 2, 3, 4)))(
      gate_z, z, gamma, w_h, scale, h0)
  assert all(np.all(np.isfinite(g)) for g in grads)
  hs, _ = run(gate_z, z * 1e24, gamma, w_h, scale, h0 * 1e24)
  assert np.all(np.isfinite(hs))


def test_bad_input_raises_one_line_errors():
  x = jnp.ones((2, 3, 4))
  w, s, h = jnp.ones((4, 4)), jnp.ones(4), jnp.ones((2, 4))
  with pytest.raises(ValueError, match=r"gate_z, z, gamma must all be \[B, T, D\]"):
    mdi(x, x[:, :2], x, w, s, h)
  with pytest.raises(ValueError, match=r"w_h must be \[D, D\]"):
    mdi(x, x, x, jnp.ones((4, 3)), s, h)
  with pytest.raises(ValueError, match=r"mask must be \[B, T\]"):
    mdi(x, x, x, w, s, h, mask=jnp.ones((2, 4), bool))
  with pytest.raises(ValueError, match="unknown impl 'pallas'; choose from auto, scan, adjoint"):
    mdi(x, x, x, w, s, h, impl="pallas")
