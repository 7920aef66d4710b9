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
from ltm_jax.train import train
from ltm_jax.train.metrics import read_metrics
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


def test_memory_stats_agree_with_the_returned_state():
  lm = api.build(micro_config(layer_pattern="AM", window=4, memory_chunk=3), seed=2)
  tokens = np.random.default_rng(0).integers(0, 259, (2, 11))
  stats = lm.memory_stats(tokens)
  assert sorted(stats) == ["block_1"]  # Only the Titans layer.
  _, state = lm.step(lm.init_state(2), tokens)
  heads = lm.config.model.n_heads
  s = stats["block_1"]
  assert s["surprise"].shape == s["retention"].shape == (2, 11, heads)
  assert np.all(s["surprise"] >= 0) and np.all((s["retention"] > 0) & (s["retention"] < 1))
  assert np.all(s["learning_rate"] <= lm.config.model.memory_max_lr / lm.config.model.memory_chunk)
  memory = state[1].mixer.memory.memory
  norm = np.sqrt(sum(np.sum(np.asarray(w) ** 2, axis=(-2, -1)) for w in memory.weights))
  np.testing.assert_allclose(s["weight_norm"], norm, rtol=1e-5)
  with pytest.raises(LtmError, match="has no Titans memory layer"):
    api.build(micro_config(layer_pattern="A")).memory_stats(tokens)


def test_training_logs_memory_statistics(tmp_path):
  cfg = apply_overrides(micro_config(layer_pattern="G", n_layers=1, window=8),
                        ["train.steps=2", "train.eval_every=2", "train.memory_stats=true"])
  train(cfg, tmp_path, progress=False)
  evaluated = [row for row in read_metrics(tmp_path) if "val_loss" in row]
  assert evaluated and all(0 < evaluated[-1][f"memory_block_0_{name}"] for name in ("surprise", "weight_norm"))
  assert 0 < evaluated[-1]["memory_block_0_retention"] < 1
  with pytest.raises(ConfigError, match="train.memory_stats needs a Titans memory layer"):
    validate(apply_overrides(micro_config(), ["train.memory_stats=true"]))
