"""Numerics of ltm_jax.ops.neural_memory: both backends against a plain float64 per-token loop written out below,
with the memory's gradient derived by hand (no autodiff inside the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ltm_jax.ops.neural_memory import AVAILABLE, MemoryState, initial_state, neural_memory

B, H, N = 2, 2, 4
EXPANSION = 2  # Hidden width of a deep memory, in multiples of N.
# float32 inputs against the float64 reference, relative to the largest expected magnitude: a few dozen tokens of
# float32 arithmetic land near 1e-6.
F32_RTOL = 2e-5


def _silu(u):
  return u / (1 + jnp.exp(-u))


def _reference(q, k, v, eta, theta, alpha, mask, weights, momentum, anchor, phase, chunk):
  """The op token by token: at every unmasked token, a chunk starts when the phase is a multiple of `chunk`
  (the anchor becomes the current weights), the loss's gradient is taken at the anchor, and S and M are updated.
  Written on [H, ...] arrays of one row, looping over rows, tokens and layers. Returns (y, weights, momentum, anchor,
  phase)."""
  ys, out = [], [[], [], [], []]
  for row in range(q.shape[0]):
    w, s, a, p = ([x[row] for x in weights], [x[row] for x in momentum], [x[row] for x in anchor], int(phase[row]))
    y_row = []
    for t in range(q.shape[1]):
      if mask[row, t]:
        if p % chunk == 0:
          a = list(w)
        # Forward through the anchor, keeping pre-activations; then d loss / d W_l = outer(input_l, delta_l).
        x, inputs, pre = k[row, t], [], []
        for layer, wl in enumerate(a):
          inputs.append(x)
          u = jnp.einsum("hi,hio->ho", x, wl)
          pre.append(u)
          x = _silu(u) if layer < len(a) - 1 else u
        delta = 2 * (x - v[row, t])
        grads = [None] * len(a)
        for layer in range(len(a) - 1, -1, -1):
          grads[layer] = inputs[layer][:, :, None] * delta[:, None, :]
          if layer:
            sig = 1 / (1 + jnp.exp(-pre[layer - 1]))
            delta = jnp.einsum("ho,hio->hi", delta, a[layer]) * sig * (1 + pre[layer - 1] * (1 - sig))
        gate = lambda g: g[row, t][:, None, None]
        s = [gate(eta) * sl - gate(theta) * gl for sl, gl in zip(s, grads)]
        w = [gate(1 - alpha) * wl + sl for wl, sl in zip(w, s)]
        p += 1
      x = q[row, t]
      for layer, wl in enumerate(w):
        x = jnp.einsum("hi,hio->ho", x, wl)
        x = _silu(x) if layer < len(w) - 1 else x
      y_row.append(x if mask[row, t] else jnp.zeros_like(x))
    if p % chunk == 0:
      a = list(w)
    ys.append(jnp.stack(y_row))
    for i, value in enumerate((w, s, a, p % chunk)):
      out[i].append(value)
  stack = lambda rows: tuple(jnp.stack(layer) for layer in zip(*rows))
  return jnp.stack(ys), stack(out[0]), stack(out[1]), stack(out[2]), jnp.asarray(out[3])


def _inputs(seed, length, depth, *, gates=((0.5, 1.0), (0.0, 0.3), (0.0, 0.2)), phase=None, chunk=1):
  """Random float64 numpy inputs: unit q and k (as the layer passes them), gates uniform in their ranges, a random
  mask with some rows left-padded, and a state whose weights, momentum and anchor all differ."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.normal(size=(B, length, H, N))), unit(rng.normal(size=(B, length, H, N)))
  v = rng.normal(size=(B, length, H, N))
  eta, theta, alpha = (rng.uniform(lo, hi, (B, length, H)) for lo, hi in gates)
  mask = rng.uniform(size=(B, length)) > 0.25
  mask[0, :3] = False  # Left padding as ragged prompts have it.
  dims = [N] + [EXPANSION * N] * (depth - 1) + [N]
  weights = tuple(rng.normal(size=(B, H, i, o)) / np.sqrt(i) for i, o in zip(dims, dims[1:]))
  momentum = tuple(0.1 * rng.normal(size=w.shape) for w in weights)
  phase = rng.integers(0, chunk, B) if phase is None else np.asarray(phase)
  anchor = tuple(np.where((phase == 0)[:, None, None, None], w, w + 0.1 * rng.normal(size=w.shape)) for w in weights)
  return (q, k, v, eta, theta, alpha), mask, MemoryState(weights, momentum, anchor, phase.astype(np.int32))


def _as(dtype, tree):
  return jax.tree.map(lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _run(inputs, mask, state, chunk, impl):
  return neural_memory(*inputs, state, mask=jnp.asarray(mask), chunk=chunk, impl=impl)


def _close(actual, expected, rtol):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    np.testing.assert_allclose(a, e, rtol=0, atol=rtol * max(np.abs(e).max(), 1e-30))


@pytest.mark.parametrize("depth,chunk,length", [(1, 1, 9), (2, 4, 10)])
def test_scan_matches_the_float64_loop(depth, chunk, length):
  inputs, mask, state = _inputs(depth * 10 + chunk, length, depth, chunk=chunk)
  with jax.enable_x64(True):
    expected = _reference(*_as(jnp.float64, inputs), mask, *_as(jnp.float64, state), chunk)
    y, out = _run(_as(jnp.float64, inputs), mask, _as(jnp.float64, state), chunk, "scan")
    _close((y, *out), expected, 1e-12)
  y, out = _run(_as(jnp.float32, inputs), mask, _as(jnp.float32, state), chunk, "scan")
  _close((y, *out), expected, F32_RTOL)


@pytest.mark.parametrize("depth,chunk", [(1, 1), (1, 4), (2, 3), (2, 16)])
def test_chunked_equals_scan(depth, chunk):
  """Every chunk size, T = 10 not a multiple of 3 or 4 (and shorter than 16), masks and mid-chunk phases."""
  inputs, mask, state = _inputs(depth + chunk, 10, depth, chunk=chunk)
  with jax.enable_x64(True):
    expected = _run(_as(jnp.float64, inputs), mask, _as(jnp.float64, state), chunk, "scan")
    chunked = _run(_as(jnp.float64, inputs), mask, _as(jnp.float64, state), chunk, "chunked")
    _close(chunked, expected, 1e-12)
  _close(_run(_as(jnp.float32, inputs), mask, _as(jnp.float32, state), chunk, "chunked"), expected, F32_RTOL)


@pytest.mark.parametrize("impl", AVAILABLE)
def test_segments_continue_the_sequence(impl):
  """Two calls through the returned state equal one call, with a split inside a chunk and uneven padding."""
  inputs, mask, state = _inputs(5, 11, 2, chunk=3, phase=[0, 0])
  with jax.enable_x64(True):
    inputs, state = _as(jnp.float64, inputs), _as(jnp.float64, state)
    y, final = _run(inputs, mask, state, 3, impl)
    first = _run(tuple(x[:, :5] for x in inputs), mask[:, :5], state, 3, impl)
    second = _run(tuple(x[:, 5:] for x in inputs), mask[:, 5:], first[1], 3, impl)
    _close((jnp.concatenate([first[0], second[0]], axis=1), second[1]), (y, final), 1e-12)


def test_left_padding_changes_nothing():
  """A row run with padding in front equals the row run alone (chunks count unmasked tokens only)."""
  inputs, _, state = _inputs(6, 9, 2, chunk=4, phase=[1, 3])
  with jax.enable_x64(True):
    inputs, state = _as(jnp.float64, inputs), _as(jnp.float64, state)
    alone = _run(inputs, np.ones((B, 9), bool), state, 4, "chunked")
    padded_inputs = tuple(jnp.concatenate([jnp.ones_like(x[:, :5]), x], axis=1) for x in inputs)
    padded = _run(padded_inputs, np.concatenate([np.zeros((B, 5), bool), np.ones((B, 9), bool)], 1), state, 4,
                  "chunked")
    _close((padded[0][:, 5:], padded[1]), alone, 1e-12)


def test_future_tokens_do_not_change_the_past():
  inputs, mask, state = _inputs(7, 12, 2, chunk=4)
  inputs, state = _as(jnp.float32, inputs), _as(jnp.float32, state)
  y, _ = _run(inputs, mask, state, 4, "chunked")
  changed = tuple(x.at[:, 6:].set(x[:, 6:] * 1.7 + 0.1) for x in inputs)
  y_changed, _ = _run(changed, mask, state, 4, "chunked")
  np.testing.assert_array_equal(np.asarray(y[:, :6]), np.asarray(y_changed[:, :6]))
  assert np.abs(np.asarray(y[:, 6:] - y_changed[:, 6:])).max() > 1e-3


@pytest.mark.parametrize("depth,chunk", [(1, 1), (2, 3)])
def test_gradients_match_the_float64_loop(depth, chunk):
  """Gradients of a random weighting of y and of the final weights and momentum, with respect to q, k, v, the three
  gates and the initial weights and momentum: both backends (float32) against autodiff of the float64 loop."""
  inputs, mask, state = _inputs(8 + depth, 7, depth, chunk=chunk)
  rng = np.random.default_rng(99)
  y_cot = rng.normal(size=(B, 7, H, N))
  w_cot = tuple(rng.normal(size=w.shape) for w in state.weights)

  def objective(run, dtype):
    def weighted(inputs, weights, momentum):
      y, w, s, *_ = run(inputs, MemoryState(weights, momentum, _as(dtype, state.anchor), state.phase))
      return jnp.sum(y * y_cot) + sum(jnp.sum(a * c) for a, c in zip(w + s, w_cot + w_cot))
    return jax.grad(weighted, argnums=(0, 1, 2))

  with jax.enable_x64(True):
    reference = lambda x, st: _reference(*x, mask, *st, chunk)
    expected = objective(reference, jnp.float64)(*_as(jnp.float64, (inputs, state.weights, state.momentum)))
  for impl in AVAILABLE:
    op = lambda x, st, impl=impl: (lambda y, out: (y, *out))(*_run(x, mask, st, chunk, impl))
    actual = jax.jit(objective(op, jnp.float32))(*_as(jnp.float32, (inputs, state.weights, state.momentum)))
    _close(actual, expected, 1e-4)


def test_check_grads_chunked():
  inputs, mask, state = _inputs(11, 5, 1, chunk=2, phase=[0, 1])
  with jax.enable_x64(True):
    inputs, state = _as(jnp.float64, inputs), _as(jnp.float64, state)
    fn = lambda q, k, v, eta, w0: neural_memory(
        q, k, v, eta, inputs[4], inputs[5], state._replace(weights=(w0,)), mask=jnp.asarray(mask), chunk=2,
        impl="chunked")[0]
    check_grads(fn, (*inputs[:4], *state.weights), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("gates", [((0.0, 0.0), (0.0, 0.5), (1.0, 1.0)), ((1.0, 1.0), (0.9, 1.0), (0.0, 0.0))])
def test_gates_at_the_ends_of_their_range(gates):
  """eta = 0 (momentum dropped every token) with alpha = 1 (everything forgotten), and eta = 1 with alpha = 0
  (nothing decays, large steps): the chunked form's log-space products stay exact at both ends."""
  inputs, mask, state = _inputs(12, 10, 1, gates=gates, chunk=4)
  with jax.enable_x64(True):
    expected = _reference(*_as(jnp.float64, inputs), mask, *_as(jnp.float64, state), 4)
  y, out = _run(_as(jnp.float32, inputs), mask, _as(jnp.float32, state), 4, "chunked")
  _close((y, *out), expected, F32_RTOL)


def test_bfloat16_inputs():
  inputs, mask, state = _inputs(13, 8, 2, chunk=4)
  rounded = _as(jnp.bfloat16, inputs)
  with jax.enable_x64(True):
    expected = _reference(*_as(jnp.float64, rounded), mask, *_as(jnp.float64, state), 4)
  y, out = _run(rounded, mask, _as(jnp.float32, state), 4, "chunked")
  assert y.dtype == jnp.bfloat16 and out.weights[0].dtype == jnp.float32
  _close(y, expected[0], 2.0**-7)
  _close(out, expected[1:], F32_RTOL)


def test_initial_state_broadcasts_learned_weights():
  weights = (np.random.default_rng(1).normal(size=(H, N, N)),)
  state = initial_state(weights, 3)
  assert state.weights[0].shape == (3, H, N, N) and state.phase.shape == (3,)
  np.testing.assert_allclose(np.asarray(state.anchor[0][2]), weights[0], rtol=1e-6)
  assert not np.asarray(state.momentum[0]).any()


def test_bad_input():
  inputs, mask, state = _inputs(14, 4, 1)
  inputs, state = _as(jnp.float32, inputs), _as(jnp.float32, state)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    neural_memory(*inputs, state, chunk=0)
  with pytest.raises(ValueError, match="unknown impl 'pallas'"):
    neural_memory(*inputs, state, impl="pallas")
  with pytest.raises(ValueError, match=r"eta, theta, alpha must be \[B, T, H\]"):
    neural_memory(*inputs[:3], inputs[3][..., None], *inputs[4:], state)
  with pytest.raises(ValueError, match="must chain"):
    neural_memory(*inputs, state._replace(weights=(state.weights[0][..., :3],)))
