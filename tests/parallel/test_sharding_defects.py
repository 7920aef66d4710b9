"""Sharding rules that cannot split a dimension, strict mode, and the run's split keys (one process: no devices
needed). The micro-batch loop's gradient shardings and the masked vocabulary under tensor parallelism are checked on
8 devices in test_mesh.py."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from ltm_jax import config as config_lib
from ltm_jax import parallel
from ltm_jax.errors import ConfigError
from ltm_jax.ops import sharding as ops_sharding
from ltm_jax.train.optimizer import make_optimizer
from ltm_jax.train.step import create_train_state, run_keys

from conftest import micro_config

RULES = (("batch", "data"), ("heads", "tensor"))


def _op(x):
  return x * 2.0


def _run(x):
  """An op over [batch, T, heads] under a data=4 x tensor=2 mesh: neither 6 rows nor 3 heads can split."""
  with jax.sharding.use_abstract_mesh(AbstractMesh((4, 2), ("data", "tensor"))), ops_sharding.axis_rules(RULES):
    return ops_sharding.per_shard(_op, (x,), in_axes=(("batch", None, "heads"),), out_axes=("batch", None, "heads"),
                                  sizes={"batch": x.shape[0], "heads": x.shape[2]})


def test_unsplit_dimension_warns_once_per_rule_and_strict_raises(monkeypatch):
  monkeypatch.setattr(ops_sharding, "_WARNED", set())
  x = np.random.default_rng(0).standard_normal((6, 5, 3)).astype(np.float32)
  with pytest.warns(ops_sharding.UnsplitDimensionWarning) as caught:
    np.testing.assert_array_equal(_run(x), 2 * x)  # Still correct: the op runs whole.
  messages = sorted(str(w.message) for w in caught)
  assert len(messages) == 2, messages  # One per rule.
  # The array by its op (the module of the function run per shard) and shape, the rule, and the fix.
  assert messages[0].endswith("test_sharding_defects's input [6, 5, 3]: its 'batch' dimension of 6 is not divisible "
                              "by the mesh size data=4 that mesh.batch names, so every device holds it whole; make it "
                              "a multiple of 4 or set mesh.batch to axes whose sizes divide it (mesh.strict=true makes "
                              "this an error)"), messages
  assert "input [6, 5, 3]: its 'heads' dimension of 3 is not divisible by the mesh size tensor=2" in messages[1]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _run(x[:2, :, :1])  # The same rules again, on other arrays: no second warning.
  with ops_sharding.strict(), pytest.raises(ConfigError, match=r"'batch' dimension of 6 is not divisible"):
    _run(x)


def test_mesh_strict_reaches_the_ops():
  cfg = config_lib.apply_overrides(micro_config(), ["mesh.strict=true"])
  assert "strict" not in dict(cfg.mesh.rules())  # A switch, not a logical axis.
  layout = parallel.make_layout(cfg, make_optimizer(cfg.train))
  assert layout.strict
  with layout.activate():
    assert ops_sharding._STRICT.get()
  assert not ops_sharding._STRICT.get()


def test_init_and_training_keys_are_split_from_the_root():
  init_key, train_key = run_keys(7)
  root = jax.random.key_data(jax.random.key(7))
  assert not np.array_equal(jax.random.key_data(init_key), root)
  assert not np.array_equal(jax.random.key_data(train_key), root)
  assert not np.array_equal(jax.random.key_data(init_key), jax.random.key_data(train_key))
  state = create_train_state({"w": np.zeros(3, np.float32)}, make_optimizer(micro_config().train), 7)
  np.testing.assert_array_equal(state.rng, jax.random.key_data(train_key))


def test_loss_chunk_must_not_be_negative():
  with pytest.raises(ConfigError, match=r"model.loss_chunk must be >= 0 \(0: no chunking\), got -1"):
    config_lib.validate(config_lib.apply_overrides(micro_config(), ["model.loss_chunk=-1"]))
