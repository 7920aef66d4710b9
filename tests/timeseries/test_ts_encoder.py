"""The time-series model: left padding under a mask changes nothing, a series fed in chunks through the state API
ends where the whole-series call ends, and the spectrum branch's Fourier sums match a float64 DFT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.config import ModelConfig, TimeSeriesConfig
from ltm_jax.timeseries import model as ts_model

# Every mixer in one stack (attention, RWKV-4, RWKV-7), tiny: the properties hold layer by layer.
CFG = ModelConfig(d_model=16, n_layers=3, n_heads=2, layer_pattern="RWA", rwkv7_head_size=8, max_seq_len=64,
                  rwkv7_decay_lora=8, rwkv7_iclr_lora=8, rwkv7_value_lora=8, rwkv7_gate_lora=8, ln0=True)
TS = TimeSeriesConfig(enabled=True, patch=2, spectrum_bins=8, spectrum_max_period=16.0)
FEATURES, OUTPUTS = 2, 3
# Float32 through three layers and two branches: different summation orders stay far below this.
TOL = 2e-5


def _apply(ts):
  return jax.jit(lambda p, x, m, s: ts_model.TimeSeriesModel(CFG, ts, OUTPUTS).apply({"params": p}, x, m, s))


@pytest.fixture(scope="module")
def params():
  params = ts_model.init_params(CFG, TS, OUTPUTS, FEATURES, jax.random.key(0))

  @jax.jit
  def trained_like(params):
    """The freshly initialised output projections of RWKV-7 are zero, which would hide its path: perturb them all."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
  return trained_like(params)


def _series(key, batch, length):
  return jax.random.normal(key, (batch, length, FEATURES))


def _pooled(state):
  """Both poolings (the state carries them whatever timeseries.pool picks) and the spectrum's magnitudes."""
  return {"mean": state.pool_sum / state.patches[:, None], "last": state.last,
          "spectrum": jnp.hypot(state.spec_re, state.spec_im)}


def test_left_padding_under_a_mask_changes_nothing(params):
  apply = _apply(TS)
  x = _series(jax.random.key(2), 3, 11)  # 11 steps: not a whole number of patches.
  y, state = apply(params, x, None, None)
  # Rows padded by 3 steps (odd: patches are counted back from the last step) with large junk values that must not
  # leak through the mask; row 1's first two real steps are masked too, so it must get what x[1, 2:] gets alone.
  padded = jnp.concatenate([50 * _series(jax.random.key(3), 3, 3), x], axis=1)
  pads = jnp.array([3, 5, 3])
  mask = jnp.arange(14)[None, :] >= pads[:, None]
  y_pad, state_pad = apply(params, padded, mask, None)
  np.testing.assert_allclose(y_pad[0::2], y[0::2], atol=TOL, rtol=0)
  for name, value in _pooled(state_pad).items():
    np.testing.assert_allclose(value[0::2], _pooled(state)[name][0::2], atol=TOL, rtol=0, err_msg=name)
  shorter, _ = apply(params, x[:, 2:], None, None)
  np.testing.assert_allclose(y_pad[1], shorter[1], atol=TOL, rtol=0)
  # The same junk without the mask does change the output.
  unmasked, _ = apply(params, padded, jnp.ones_like(mask), None)
  assert float(jnp.abs(unmasked[0] - y[0]).max()) > 100 * TOL


def test_left_padding_under_a_mask_changes_no_gradient(params):
  """Training on ragged series: a loss on left-padded, masked rows has the gradients of the rows alone (a masked
  output still carries a zero cotangent through its layer's backward, where 0 / 0 would make every gradient NaN)."""
  apply = _apply(TS)
  x = _series(jax.random.key(4), 2, 8)
  padded = jnp.concatenate([jnp.zeros((2, 6, FEATURES)), x], axis=1)  # 3 whole patches of padding before each row.
  mask = jnp.arange(14)[None, :] >= 6
  loss = lambda p, x, m: jnp.sum(apply(p, x, m, None)[0] ** 2)
  grads = jax.jit(jax.grad(loss))(params, padded, jnp.broadcast_to(mask, (2, 14)))
  expected = jax.jit(jax.grad(loss))(params, x, None)
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(g, e, atol=TOL * max(1.0, float(jnp.abs(e).max())), rtol=0,
                               err_msg=jax.tree_util.keystr(path))


def test_streaming_one_patch_at_a_time_equals_the_whole_series(params):
  ts = TS
  apply = _apply(ts)
  x = _series(jax.random.key(6), 2, 16)
  whole, whole_state = apply(params, x, None, None)
  state = ts_model.init_state(CFG, ts, 2, FEATURES)
  for start in range(0, 16, ts.patch):
    out, state = apply(params, x[:, start:start + ts.patch], None, state)
  np.testing.assert_allclose(out, whole, atol=TOL, rtol=0)
  for name, value in _pooled(state).items():
    np.testing.assert_allclose(value, _pooled(whole_state)[name], atol=TOL, rtol=0, err_msg=name)
  # Larger chunks reach the same end; the state is what carries the past (a fresh one does not).
  state = ts_model.init_state(CFG, ts, 2, FEATURES)
  for start in (0, 8):
    out, state = apply(params, x[:, start:start + 8], None, state)
  np.testing.assert_allclose(out, whole, atol=TOL, rtol=0)
  fresh, _ = apply(params, x[:, 8:], None, ts_model.init_state(CFG, ts, 2, FEATURES))
  assert float(jnp.abs(fresh - whole).max()) > 100 * TOL


def test_a_chunk_of_partial_patches_with_a_state_is_refused(params):
  with pytest.raises(ValueError, match="whole patches"):
    ts_model.TimeSeriesModel(CFG, TS, OUTPUTS).apply({"params": params}, _series(jax.random.key(7), 1, 3), None,
                                                     ts_model.init_state(CFG, TS, 1, FEATURES))


def test_fourier_sums_match_a_float64_dft_from_the_first_valid_step():
  rng = np.random.default_rng(0)
  batch, length, features, pad = 2, 300, 2, 7
  x = rng.standard_normal((batch, length, features))
  mask = np.ones((batch, length), bool)
  mask[1, :pad] = False
  state = ts_model.init_state(CFG, TS, batch, features)
  re, im, steps = ts_model._fourier_sums(jnp.asarray(np.where(mask[..., None], x, 0), jnp.float32),
                                         jnp.asarray(mask), state, ts_model.frequencies(TS))
  freqs = 1.0 / np.geomspace(TS.spectrum_max_period, 2.0, TS.spectrum_bins)
  for b in range(batch):
    valid = x[b][mask[b]]  # [n, F]
    t = np.arange(len(valid))
    expected = np.exp(-2j * np.pi * freqs[:, None] * t[None, :]) @ valid  # [K, F]
    np.testing.assert_allclose(np.asarray(re[b]) + 1j * np.asarray(im[b]), expected, atol=1e-3, rtol=0)
    assert float(steps[b]) == len(valid)
