"""The Titans layers' own parts: the short causal convolution against a float64 loop over each row's real inputs,
and the memory statistics against the state the model returns. (The op is tested in tests/ops; the M and G mixers'
causality, segments, decoding, scanning and int8 with the other mixers in tests/test_model.py and beside them.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import api
from ltm_jax.config import apply_overrides, validate
from ltm_jax.errors import ConfigError, LtmError
from ltm_jax.inference import diagnostics
from ltm_jax.layers.titans import _causal_conv


def _conv_reference(x, history, kernel, valid):
  """Row by row: the real inputs (history, then the unpadded x) convolved causally; outputs at real positions."""
  width = kernel.shape[0]
  y, new_history = np.zeros_like(x), np.zeros_like(history)
  for row in range(x.shape[0]):
    real = np.concatenate([history[row], x[row][valid[row]]])
    outputs = [sum(kernel[tap] * real[i - tap] for tap in range(width)) for i in range(width - 1, len(real))]
    y[row][valid[row]] = np.asarray(outputs).reshape((-1,) + x.shape[2:])
    new_history[row] = real[len(real) - (width - 1):]
  return y, new_history


@pytest.mark.parametrize("width", [1, 2, 4])
def test_causal_conv_skips_padding(width):
  rng = np.random.default_rng(width)
  x, history = rng.normal(size=(3, 6, 2, 5)), rng.normal(size=(3, width - 1, 2, 5))
  kernel = rng.normal(size=(width, 2, 5))
  valid = np.ones((3, 6), bool)
  valid[1, :2] = False  # Left padding,
  valid[2, :] = False  # and a row that is all padding: its history must come back unchanged.
  expected_y, expected_history = _conv_reference(x, history, kernel, valid)
  with jax.enable_x64(True):
    y, new_history = _causal_conv(jnp.asarray(x), jnp.asarray(history), jnp.asarray(kernel), jnp.asarray(valid))
  np.testing.assert_allclose(np.where(valid[..., None, None], y, 0), expected_y, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(new_history, expected_history, rtol=1e-6)  # The history is kept in float32.


def test_memory_statistics_agree_with_the_state_and_summarise_for_training_logs():
  """Statistics of the Titans layer only, consistent with the state `step` returns; `memory_summary` (what training
  logs at each evaluation with train.memory_stats) averages them."""
  lm = api.build(micro_config(layer_pattern="AM", window=4, memory_chunk=3), seed=2)
  tokens = np.random.default_rng(0).integers(0, 259, (2, 11))
  stats = lm.memory_stats(tokens)
  assert sorted(stats) == ["block_1"]
  s = stats["block_1"]
  assert s["surprise"].shape == s["retention"].shape == (2, 11, lm.config.model.n_heads)
  assert np.all(s["surprise"] >= 0) and np.all((s["retention"] > 0) & (s["retention"] < 1))
  assert np.all(s["learning_rate"] <= lm.config.model.memory_max_lr / lm.config.model.memory_chunk)
  _, state = lm.step(lm.init_state(2), tokens)
  memory = state[1].mixer.memory.memory
  norm = np.sqrt(sum(np.sum(np.asarray(w) ** 2, axis=(-2, -1)) for w in memory.weights))
  np.testing.assert_allclose(s["weight_norm"], norm, rtol=1e-5)
  summary = diagnostics.memory_summary(lm.config.model, lm.config.latent, lm.params, jnp.asarray(tokens))
  assert summary["memory_block_1_surprise"] == pytest.approx(float(np.mean(s["surprise"])), rel=1e-6)
  assert len(summary) == len(s)
  with pytest.raises(LtmError, match="has no Titans memory layer"):
    api.build(micro_config(layer_pattern="A")).memory_stats(tokens)
  with pytest.raises(ConfigError, match="train.memory_stats needs a Titans memory layer"):
    validate(apply_overrides(micro_config(), ["train.memory_stats=true"]))
