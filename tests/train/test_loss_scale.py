"""Dynamic loss scaling: its schedule, exact unscaling, overflow detection, and float16 gradients it rescues."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax import loss_scale as ls_lib
from ltm_jax.train.step import create_train_state, make_train_step
from ltm_jax.train.optimizer import learning_rate, make_optimizer


def test_scale_halves_on_overflow_and_doubles_after_a_period_of_finite_steps():
  state = ls_lib.initial(2.0**4, period=3, min_scale=2.0, max_scale=2.0**6)
  flags = [True, True, True,  # Third finite step in a row: 16 -> 32.
           True, False,  # Overflow: 32 -> 16, counter reset.
           True, True, True, True, True, True,  # Two periods: 16 -> 32 -> 64 (the cap).
           True, True, True,  # Stays at the cap.
           False, False, False, False, False, False]  # Down to the floor of 2, not below.
  expected = [16, 16, 32, 32, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64, 32, 16, 8, 4, 2, 2]
  expected_good = [1, 2, 0, 1, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0]

  def step(state, finite):
    state = ls_lib.update(state, finite)
    return state, (state.scale, state.good_steps)

  _, (scales, good) = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(state, jnp.asarray(flags))
  np.testing.assert_array_equal(scales, expected)
  np.testing.assert_array_equal(good, expected_good)


def test_unscaling_is_exact_and_overflow_is_detected_in_any_leaf():
  state = ls_lib.initial(2.0**15)
  grads = {"a": jax.random.normal(jax.random.key(0), (5, 3)), "b": [jax.random.normal(jax.random.key(1), (7,))]}
  scaled = jax.tree.map(lambda g: g * state.scale, grads)
  unscaled = ls_lib.unscale(state, scaled)
  for x, y in zip(jax.tree.leaves(unscaled), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(x, y)  # A power-of-two scale changes only exponents.
  assert bool(ls_lib.all_finite(grads))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    broken = {"a": grads["a"], "b": [grads["b"][0].at[3].set(bad)]}
    assert not bool(ls_lib.all_finite(broken))
  kept = ls_lib.select(jnp.asarray(False), {"w": jnp.ones(3)}, {"w": jnp.zeros(3)})
  np.testing.assert_array_equal(kept["w"], np.zeros(3))
  with pytest.raises(ValueError, match="min_scale <= scale"):
    ls_lib.initial(0.5, min_scale=1.0)


def test_float16_gradients_that_underflow_are_recovered_by_scaling():
  """A small loss (as a per-token mean over a long batch gives) makes float16 activation gradients flush to zero;
  scaled by 2^15 and unscaled in float32 they match float32 compute."""
  cfg = micro_config(layer_pattern="A", n_layers=1).model
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
  tiny = 2.0**-20  # Stands in for 1 / (many tokens): pushes backward values below float16's range.

  def grads(dtype, state):
    model = model_lib.LM(dataclasses.replace(cfg, dtype=dtype))

    def loss(p):
      logits, _ = model.apply({"params": p}, tokens[:, :-1])
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() * tiny
      return nll if state is None else ls_lib.scale_loss(state, nll)

    g = jax.jit(jax.grad(loss))(params)
    return g if state is None else ls_lib.unscale(state, g)

  reference = grads("float32", None)
  plain = grads("float16", None)
  scaled = grads("float16", ls_lib.initial(2.0**15))
  relative = lambda g, ref=reference: float(optax.tree.norm(jax.tree.map(jnp.subtract, g, ref)) / optax.tree.norm(ref))
  # The head accumulates float32 logits, so its own gradient survives; every gradient below it is float16.
  body = lambda g: {k: v for k, v in g.items() if k.startswith("block_")}
  assert relative(body(plain), body(reference)) > 0.99  # Measured: 1.0, every block gradient flushed to zero.
  assert relative(scaled) < 1e-2, relative(scaled)  # Measured: 0.16%.
  assert bool(ls_lib.all_finite(scaled))


def test_float16_train_step_scales_and_skips_overflowing_steps():
  # The real train step: with model.dtype=float16 a finite step updates the parameters and counts a good step;
  # a scale so large that the float16 backward overflows skips the update and halves the scale.
  cfg = micro_config(dtype="float16")
  model, optimizer = model_lib.LM(cfg.model), optax.adam(1e-3)
  step = make_train_step(model, optimizer, optax.constant_schedule(1e-3), grad_accum=1)
  tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  fresh = create_train_state(model_lib.init_params(cfg.model, jax.random.key(1)), optimizer, 0)

  state, metrics = step(jax.tree.map(jnp.copy, fresh), batch)
  assert float(metrics["skipped"]) == 0 and np.isfinite(float(metrics["grad_norm"]))
  assert int(state.loss_scale.good_steps) == 1 and float(state.loss_scale.scale) == 2.0**15
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params, fresh.params)
  assert any(jax.tree.leaves(moved))

  huge = fresh.replace(loss_scale=fresh.loss_scale.replace(scale=jnp.asarray(2.0**100, jnp.float32)))
  state, metrics = step(jax.tree.map(jnp.copy, huge), batch)
  assert float(metrics["skipped"]) == 1 and float(state.loss_scale.scale) == 2.0**99
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.params, fresh.params)
  assert all(jax.tree.leaves(same))


def test_a_skipped_step_keeps_the_moments_and_advances_the_learning_rate_schedule():
  """The schedule follows state.step (what the log's lr reads and train.steps ends); the moments and Adam's bias
  correction count only the steps applied."""
  cfg = micro_config(dtype="float16")
  model, optimizer = model_lib.LM(cfg.model), make_optimizer(cfg.train)
  step = make_train_step(model, optimizer, learning_rate(cfg.train), grad_accum=1)
  tokens = jax.random.randint(jax.random.key(2), (4, 17), 0, 256)
  fresh = create_train_state(model_lib.init_params(cfg.model, jax.random.key(3)), optimizer, 0)
  huge = fresh.replace(loss_scale=fresh.loss_scale.replace(scale=jnp.asarray(2.0**100, jnp.float32)))
  state, metrics = step(huge, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  assert float(metrics["skipped"]) == 1 and int(state.step) == 1
  is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
  schedules = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_schedule) if is_schedule(s)]
  adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]
  assert [int(s.count) for s in schedules] == [1] and [int(s.count) for s in adam] == [0]
  assert all(float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves((adam[0].mu, adam[0].nu)))
