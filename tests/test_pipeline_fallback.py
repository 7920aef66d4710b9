"""A stateless call under a pipeline mesh whose batch the micro-batches don't divide runs the plain scan, and says so
in one warning (the plain scan gathers every stage's weights to every device)."""

import jax
import numpy as np
import pytest

from ltm_jax import model as model_lib

from conftest import micro_config


def test_undivided_batch_under_pipeline_stages_warns_and_matches_the_plain_scan(monkeypatch):
  cfg = micro_config(scan_layers=True, pipeline_micro_batches=2, layer_pattern="A", n_layers=2)
  model = model_lib.LM(cfg.model)
  params = model_lib.init_params(cfg.model, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 16), 0, 256)
  logits = lambda: jax.jit(model.apply)({"params": params}, tokens)[0]
  plain = logits()
  monkeypatch.setattr(model_lib.pipeline, "stages", lambda: 2)
  with pytest.warns(UserWarning, match=r"batch of 3 rows does not divide into model.pipeline_micro_batches=2"):
    fallback = logits()
  np.testing.assert_array_equal(np.asarray(fallback), np.asarray(plain))


def test_a_prefill_under_pipeline_stages_keeps_every_layers_state(monkeypatch):
  """A prefill hands its state to decoding, so it runs the plain scan even where the batch divides into
  micro-batches; a pipelined stack would return no state for its scanned layers."""
  from ltm_jax.inference import generate
  cfg = micro_config(scan_layers=True, pipeline_micro_batches=2, layer_pattern="AR", n_layers=4)
  model = model_lib.LM(cfg.model, cache_capacity=24)
  params = model_lib.init_params(cfg.model, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  lengths = np.array([16, 11])
  plain = generate.prefill(model, params, tokens, lengths)
  monkeypatch.setattr(model_lib.pipeline, "stages", lambda: 2)
  staged = generate.prefill.__wrapped__(model, params, tokens, lengths)
  assert jax.tree.structure(staged.state) == jax.tree.structure(plain.state)
  jax.tree.map(np.testing.assert_array_equal, staged, plain)
