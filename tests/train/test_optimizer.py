"""Learning-rate schedule, weight-decay mask and gradient accumulation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.train.optimizer import decay_mask, learning_rate
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


@pytest.mark.usefixtures("fast_compile")  # Compile-bound; compares the values of programs.
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
