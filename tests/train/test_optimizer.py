"""Learning-rate schedule, weight-decay mask, gradient accumulation, and the global norm and clipping against optax's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.train.optimizer import decay_mask, global_norm, learning_rate, make_optimizer
from ltm_jax.train.step import create_train_state, make_train_step


def test_schedule_warms_up_then_decays_to_floor():
  t = dataclasses.replace(micro_config().train, steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
  lr = learning_rate(t)
  assert float(lr(0)) == pytest.approx(1e-4)  # The first update already uses a non-zero rate.
  assert float(lr(4)) == pytest.approx(5e-4)
  assert float(lr(9)) == pytest.approx(1e-3)
  assert float(lr(10)) == pytest.approx(1e-3)
  assert float(lr(55)) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4), rel=1e-5)
  assert float(lr(100)) == pytest.approx(1e-4)
  assert all(float(lr(s)) >= float(lr(s + 1)) for s in range(10, 120))


def test_decay_mask_spares_norms_vectors_and_embeddings():
  params = model_lib.init_params(micro_config().model, jax.random.key(0))
  mask = decay_mask(params, decay_embeddings=False)
  assert mask["embed"]["embedding"] is False
  assert mask["head"]["kernel"] is True
  assert mask["final_norm"]["scale"] is False
  assert mask["block_0"]["mixer"]["time_decay"] is False
  assert mask["block_0"]["mixer"]["key"]["kernel"] is True
  assert decay_mask(params, decay_embeddings=True)["embed"]["embedding"] is True


def test_gradient_accumulation_equals_one_big_batch():
  cfg = micro_config()
  model = model_lib.LM(cfg.model)
  params = model_lib.init_params(cfg.model, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.model.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  results = []
  optimizer = optax.sgd(1.0)  # The parameter change is then exactly minus the averaged gradient.
  for accum in (1, 2, 4):
    step = make_train_step(model, optimizer, optax.constant_schedule(1.0), accum)
    state = create_train_state(jax.tree.map(lambda x: x.copy(), params), optimizer, 0)
    state, metrics = step(state, batch)
    results.append((state.params, metrics))
  for params_k, metrics_k in results[1:]:
    # Equal micro-batch sizes: the mean of micro-batch means is the full-batch mean, up to float32 rounding.
    assert float(metrics_k["loss"]) == pytest.approx(float(results[0][1]["loss"]), rel=1e-6)
    assert float(metrics_k["grad_norm"]) == pytest.approx(float(results[0][1]["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(params_k), jax.tree.leaves(results[0][0])):
      np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5)


def _gradient_tree(seed: int, scale: float):
  """A tree of float32 leaves of the shapes a model has (matrices, a stacked tensor, vectors, a scalar)."""
  rng = np.random.default_rng(seed)
  shapes = {"a": {"kernel": (48, 96), "bias": (96,)}, "b": {"stack": (3, 16, 40), "scale": (40,)}, "c": ()}
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) * scale, jnp.float32), shapes,
                      is_leaf=lambda x: isinstance(x, tuple))


def test_global_norm_matches_a_float64_norm():
  """On one device (this test's) the norm is the one reduction over the concatenated leaves."""
  tree = _gradient_tree(0, 1.0)
  assert jax.device_count() > 1 or "optimization_barrier" in str(jax.make_jaxpr(global_norm)(tree))
  want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
  assert float(jax.jit(global_norm)(tree)) == pytest.approx(want, rel=2e-6)


@pytest.mark.parametrize("scale", [1e-3, 1.0])  # Norms ~0.1 (kept) and ~100 (clipped to 1).
def test_the_optimizer_equals_optax_clipping_and_adamw(scale):
  """make_optimizer against optax's clip_by_global_norm chained to the same AdamW: three updates from fresh
  gradients agree to float32 rounding, and the states have one structure (checkpoints restore either way)."""
  t = dataclasses.replace(micro_config().train, steps=10, warmup_steps=2, lr=1e-2, grad_clip=1.0, weight_decay=0.1)
  params = _gradient_tree(1, 0.5)
  ours = make_optimizer(t)
  reference = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                          optax.adamw(learning_rate(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                                      mask=lambda p: decay_mask(p, t.decay_embeddings)))
  states = [ours.init(params), reference.init(params)]
  assert jax.tree.structure(states[0]) == jax.tree.structure(states[1])
  clipped = []
  for step in range(3):
    grads = _gradient_tree(10 + step, scale)
    clipped.append(float(optax.tree.norm(grads)) > t.grad_clip)
    results = [jax.jit(opt.update)(grads, state, params) for opt, state in zip((ours, reference), states)]
    (got, states[0]), (want, states[1]) = results
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    params = optax.apply_updates(params, got)
  assert all(clipped) == (scale == 1.0) and any(clipped) == (scale == 1.0)
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-9)
