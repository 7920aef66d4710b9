"""Quantisation-aware training: the step computes with the rounded weights and updates the float ones straight
through, and bad QAT settings are refused before anything runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.config import apply_overrides, validate
from ltm_jax.errors import ConfigError
from ltm_jax.inference import quantize as quantize_lib
from ltm_jax.train import loop
from ltm_jax.train.step import create_train_state, make_train_step, token_nll


def test_qat_step_takes_the_rounded_weights_gradient_straight_to_the_float_weights():
  # int4 in groups of 8 (int8 rounds through the same plan; its rounding is tested in test_quantize.py).
  cfg = micro_config()
  model = model_lib.LM(cfg.model)
  params = model_lib.init_params(cfg.model, jax.random.key(3))
  axes = model_lib.param_axes(cfg.model)
  view = lambda p: quantize_lib.fake_quantize_params(p, axes, "int4", 8)
  tokens = jax.random.randint(jax.random.key(4), (4, 17), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  # Plain SGD with rate 1 and no clipping: the update is minus the gradient the step took.
  step = make_train_step(model, optax.sgd(1.0), optax.constant_schedule(1.0), grad_accum=1, params_view=view)
  new, _ = step(create_train_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0), 0), batch)

  grad = jax.jit(jax.grad(lambda p: token_nll(model, p, batch)[0].mean()))
  at_rounded, at_float = grad(view(params)), grad(params)
  flat_new = jax.tree_util.tree_flatten_with_path(new.params)[0]
  for (path, updated), before, g in zip(flat_new, jax.tree.leaves(params), jax.tree.leaves(at_rounded)):
    # Float32 rounding of the subtraction: a few units in the last place of the weight.
    atol = 4 * float(np.spacing(np.float32(np.max(np.abs(before))))) + 1e-6 * float(np.max(np.abs(g)))
    np.testing.assert_allclose(updated, before - g, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
  # The rounding is visible in the gradient: the step did not train the float weights as they are.
  moved = [float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(at_rounded), jax.tree.leaves(at_float))]
  assert max(moved) > 1e-4, moved


def test_bad_qat_settings_are_refused_before_training():
  cfg = micro_config()
  with pytest.raises(ConfigError, match=r"train.qat='int3': choose none, int8 or int4"):
    validate(apply_overrides(cfg, ["train.qat=int3"]))
  with pytest.raises(ConfigError, match=r"train.qat_group must be even"):
    validate(apply_overrides(cfg, ["train.qat=int4", "train.qat_group=7"]))
  params = jax.eval_shape(lambda: model_lib.init_params(cfg.model, jax.random.key(0)))
  bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, qat="int4", qat_group=12))
  with pytest.raises(ConfigError, match=r"train.qat=int4 with train.qat_group=12: cannot quantise .* fan-in 32"):
    loop._qat_view(bad, params)
  assert loop._qat_view(cfg, params) is None
