"""How a latent model trains: the decoder objectives (final, iterates), continuation rows whose z cannot see the
scored tokens, the window that bounds what the plain decoder sees, and the diagnostics logged during training."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import classic_latent, micro_config
from ltm_jax import cli
from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.api import load
from ltm_jax.train import train
from ltm_jax.train.evaluation import full_evaluation
from ltm_jax.latent import continuation_masks
from ltm_jax.layers import SplitLatents
from ltm_jax.train.step import create_train_state, make_train_step

STEPS = 3
LATENT = classic_latent(n_per_layer=2, inner_steps=STEPS, inner_lr=0.3)


def _setup(seed=0, model_overrides=None, **latent_overrides):
  cfg = micro_config(**(model_overrides or {}))
  cfg = dataclasses.replace(cfg, latent=dataclasses.replace(LATENT, **latent_overrides))
  model = model_lib.LM(cfg.model, cfg.latent)
  params = model_lib.init_params(cfg.model, jax.random.key(seed), cfg.latent)
  tokens = jax.random.randint(jax.random.key(seed + 100), (4, 25), 0, 256)
  return cfg, model, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.partial(jax.jit, static_argnames="model")
def _terms(model, params, batch, key):
  return latent_lib.decoder_terms(model, params, batch, key)


def _mean_nll_grad(model, params, batch, z):
  return _scored_nll_grad(model, params, batch, ((z, None, None),))


@functools.partial(jax.jit, static_argnames="model")
def _scored_nll_grad(model, params, batch, scored):
  """The NLL per scored target, each (z, mask) pair's targets given its z (held fixed), and its gradient. Jitted once
  per model and structure of `scored`, with z and the masks as arguments: the per-iterate gradients share one
  compiled program instead of compiling one per iterate."""
  def loss(p):
    total, count = 0.0, 0.0
    for z, mask, _ in scored:  # Every position read: a prefix's own length must not change its NLL.
      nll = latent_lib.token_nll(model, p, batch["inputs"], batch["targets"], jax.lax.stop_gradient(z))
      mask = jnp.ones(nll.shape, bool) if mask is None else mask
      total, count = total + jnp.where(mask, nll, 0.0).sum(), count + mask.sum()
    return total / count
  return jax.value_and_grad(loss)(params)


def _assert_trees_close(got, want, rtol=1e-4, atol=1e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_iterates_gradient_is_the_mean_of_per_iterate_gradients():
  _, model, params, batch = _setup(decoder_objective="iterates")
  key = jax.random.key(11)
  terms = _terms(model, params, batch, key)
  grads, metrics = terms.iterates_grad, terms.metrics
  assert terms.scored is None
  # The same inner loop run on its own (no decoder gradients), then one gradient per iterate with its z held fixed.
  fit_key = jax.random.split(key, 3)[0]
  fitted, eps = jax.jit(functools.partial(latent_lib.infer, model, steps=STEPS))(
      params, batch["inputs"], batch["targets"], fit_key)
  per_iterate = []
  for k in range(STEPS + 1):
    z_k = jax.tree.map(lambda x, k=k: x[k], fitted.path).sample(eps)
    per_iterate.append(_mean_nll_grad(model, params, batch, z_k))
  expected = jax.tree.map(lambda *g: sum(g) / len(g), *[g for _, g in per_iterate])
  _assert_trees_close(grads, expected)
  assert float(metrics["loss"]) == pytest.approx(float(np.mean([v for v, _ in per_iterate])), rel=1e-5)
  # The iterates really differ: the last one alone gives another gradient.
  last = per_iterate[-1][1]
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(last), jax.tree.leaves(grads))) > 1e-5


def test_iterates_train_step_applies_that_gradient():
  _, model, params, batch = _setup(decoder_objective="iterates")
  optimizer = optax.sgd(1.0)
  state = create_train_state(params, optimizer, seed=3)
  step = make_train_step(model, optimizer, optax.constant_schedule(1.0), grad_accum=1)
  new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0), 0)
  expected = _terms(model, params, batch, key)
  _assert_trees_close(jax.tree.map(jnp.subtract, params, new_state.params), expected.iterates_grad)
  assert float(metrics["loss"]) == pytest.approx(float(expected.metrics["loss"]), rel=1e-6)


def test_continuation_masks():
  fit, score = continuation_masks(jax.random.key(0), (8, 40), 0.5)
  fit, score = np.asarray(fit), np.asarray(score)
  assert fit[4:].all() and score[4:].all()  # Ordinary rows: fitted and scored whole.
  for row in range(4):
    split = int(fit[row].sum())
    assert 10 <= split < 30
    np.testing.assert_array_equal(fit[row], np.arange(40) < split)
    np.testing.assert_array_equal(score[row], ~fit[row])
  splits = [int(continuation_masks(jax.random.key(s), (1, 40), 1.0)[0].sum()) for s in range(20)]
  assert len(set(splits)) > 5  # Drawn, not fixed.
  fit, score = continuation_masks(jax.random.key(0), (8, 40), 0.0)
  assert bool(fit.all()) and bool(score.all())


def test_continuation_rows_fit_z_without_the_scored_tokens():
  _, model, params, batch = _setup(continuation_fraction=0.5)
  key = jax.random.key(5)
  z, score, _ = _terms(model, params, batch, key).scored[0]
  # Change every row's last target: scored, never fitted, in continuation rows (0, 1); fitted in rows 2, 3.
  changed = dict(batch, targets=batch["targets"].at[:, -1].set((batch["targets"][:, -1] + 7) % 256))
  z2 = _terms(model, params, changed, key).scored[0][0]
  np.testing.assert_allclose(z2[:2], z[:2], rtol=1e-6, atol=1e-7)
  assert float(jnp.max(jnp.abs(z2[2:] - z[2:]))) > 1e-6
  assert not bool(score[:2].all()) and bool(score[2:].all())


@pytest.mark.parametrize("fraction, top_layers", [(0.0, None), (0.5, None), (1.0, 1)])
def test_final_decoder_gradient_is_the_scored_nll_with_z_frozen(fraction, top_layers):
  # The step runs the trunk (the blocks below z) once and the latent-reading blocks per scored z (with z read by the
  # last block alone, one pass under a SplitLatents pair); the expected gradient runs the whole model once per z.
  cfg, model, params, batch = _setup(continuation_fraction=fraction, top_layers=top_layers)
  optimizer = optax.sgd(1.0)
  state = create_train_state(params, optimizer, seed=7)
  step = make_train_step(model, optimizer, optax.constant_schedule(1.0), grad_accum=1)
  new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0), 0)
  scored = _terms(model, params, batch, key).scored
  if fraction == 0:
    assert len(scored) == 1 and scored[0][1] is None  # Every target, under z fitted on the whole row.
  else:
    if top_layers == 1:
      ((split, mask, _),) = scored
      assert isinstance(split, SplitLatents) and mask is None
      scored = ((split.after, ~split.is_before, None), (split.before, split.is_before, None))
    (_, score, _), (z_0, prefix, _) = scored
    fit, expected_score = continuation_masks(jax.random.split(key, 3)[2], batch["targets"].shape, fraction)
    np.testing.assert_array_equal(score, expected_score)
    np.testing.assert_array_equal(prefix, fit & ~expected_score)  # Continuation rows' prefixes only.
    rows = round(fraction * 4)
    assert bool(prefix[:rows].any()) and not bool(prefix[rows:].any())
    # The prefix is scored under the inner loop's starting point: the initial posterior with the loop's noise.
    init_key, eps_key = jax.random.split(jax.random.split(key, 3)[0])
    shape = model_lib.latent_shape(cfg.model, cfg.latent, 4)
    start = latent_lib.initial_posterior(init_key, shape, cfg.latent)
    np.testing.assert_allclose(z_0, start.sample(jax.random.normal(eps_key, shape)), rtol=1e-6, atol=1e-7)
  value, expected = _scored_nll_grad(model, params, batch, scored)
  _assert_trees_close(jax.tree.map(jnp.subtract, params, new_state.params), expected)
  assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-6)


def test_one_pass_under_split_latents_scores_each_position_as_its_own_pass():
  # z read by the last block alone: each position's NLL under a SplitLatents pair equals its NLL in the pass that
  # reads its own z throughout. With two latent-reading blocks it does not (positions after the split see, through
  # the upper block's attention, states made under z_0), which is why the train step keeps two passes there.
  for top_layers, exact in ((1, True), (2, False)):
    cfg, model, params, batch = _setup(continuation_fraction=1.0, top_layers=top_layers,
                                       model_overrides=dict(layer_pattern="A", window=8))
    shape = model_lib.latent_shape(cfg.model, cfg.latent, 4)
    z, z_0 = (jax.random.normal(jax.random.key(s), shape) for s in (1, 2))
    before = jnp.arange(24)[None, :] < jnp.array([[6], [10], [13], [17]])
    nll = jax.jit(lambda latents: latent_lib.token_nll(model, params, batch["inputs"], batch["targets"], latents))
    split, after_only, before_only = nll(SplitLatents(z_0, z, before)), nll(z), nll(z_0)
    np.testing.assert_allclose(jnp.where(before, split, 0.0), jnp.where(before, before_only, 0.0), rtol=1e-5,
                               atol=1e-6)
    gap = float(jnp.max(jnp.abs(jnp.where(before, 0.0, split - after_only))))
    assert (gap < 1e-5) if exact else (gap > 1e-4), (top_layers, gap)
    assert latent_lib.one_pass_split(cfg.model, cfg.latent) == exact


def test_window_bounds_the_plain_decoder_and_z_reaches_past_it():
  cfg, model, params, batch = _setup(model_overrides=dict(layer_pattern="A", window=4))
  reach = cfg.model.receptive_field
  assert reach == 2 * 3 + 1
  tokens, p = batch["inputs"], 3
  changed = tokens.at[:, p].set((tokens[:, p] + 1) % 256)
  plain_model = model_lib.LM(cfg.model)
  plain_params = model_lib.init_params(cfg.model, jax.random.key(0))
  run = jax.jit(lambda t: plain_model.apply({"params": plain_params}, t)[0])
  a, b = run(tokens), run(changed)
  np.testing.assert_array_equal(a[:, :p], b[:, :p])
  np.testing.assert_array_equal(a[:, p + reach:], b[:, p + reach:])  # Out of reach: bit for bit the same.
  assert float(jnp.max(jnp.abs(a[:, p + reach - 1] - b[:, p + reach - 1]))) > 1e-6  # The farthest it reaches.

  # The latent model with z fitted on the sequence: the change reaches every later position through z.
  def fitted_logits(t):
    fitted, _ = latent_lib.infer(model, params, t, batch["targets"], jax.random.key(1))
    return model.apply({"params": params}, t, latents=fitted.posterior.mu)[0]
  a, b = jax.jit(fitted_logits)(tokens), jax.jit(fitted_logits)(changed)
  assert float(jnp.min(jnp.max(jnp.abs(a[:, p + reach:] - b[:, p + reach:]), axis=-1))) > 1e-6


@pytest.fixture(scope="module")
def trained_latent(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("latent")
  cfg = micro_config(layer_pattern="A", window=8)
  cfg = dataclasses.replace(cfg, latent=LATENT,
                            train=dataclasses.replace(cfg.train, steps=4, eval_every=2, checkpoint_every=4,
                                                      log_every=2, batch_size=4, seq_len=32, eval_batches=2))
  train(cfg, workdir, progress=False)
  return cfg, workdir


def test_training_logs_the_latent_diagnostics_ltm_eval_reports(trained_latent):
  cfg, workdir = trained_latent
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  evals = [row for row in rows if "val_loss" in row]
  assert [row["step"] for row in evals] == [2, 4]
  for row in evals:
    for key in ("val_kl", "val_nll", "val_prior_nll", "val_shuffled_nll", "val_continuation_ppl", "val_mu_abs",
                "val_active_units", "tokens"):
      assert key in row and np.isfinite(row[key]), key
  lm = load(workdir)
  t = cfg.train
  splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, t.seq_len)
  batches = data_lib.eval_batches(splits.val, t.batch_size, t.seq_len, t.eval_batches)
  evaluation = full_evaluation(lm.model, lm.params, batches, seed=t.seed, curve_steps=())
  last = evals[-1]
  for key in ("nll", "kl", "prior_nll", "shuffled_nll", "continuation_ppl", "mu_abs"):
    assert last[f"val_{key}"] == pytest.approx(evaluation[key], rel=1e-5), key
  assert last["val_active_units"] == evaluation["active_units"]
  assert last["val_loss"] == pytest.approx(evaluation["elbo"], rel=1e-5)


def test_ltm_eval_measures_the_elbo_curve_on_the_batches_it_is_asked_to(trained_latent, capsys):
  cfg, workdir = trained_latent
  t = cfg.train
  assert cli.main(["eval", "--workdir", str(workdir), "--batches", "2", "--curve-steps", "0", "1",
                   "--curve-batches", "1"]) == 0
  metrics = json.loads((workdir / "eval.json").read_text())
  # The line that says what z is worth reads the same numbers as eval.json.
  worth = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("z is worth"))
  assert f"continuation perplexity {metrics['continuation_ppl']:.3f}" in worth
  assert f"costs {metrics['shuffled_nll'] - metrics['nll']:.3f} nats/token" in worth
  assert f"{metrics['active_units']}/{metrics['latent_dims']} latent dimensions active" in worth
  assert set(metrics["elbo_ppl_by_inner_steps"]) == {"0", "1", str(STEPS)}
  assert metrics["curve_tokens"] == t.batch_size * t.seq_len and metrics["tokens"] == 2 * t.batch_size * t.seq_len
  # The curve at the trained steps over the first batch equals the main ELBO of that batch alone.
  lm = load(workdir)
  first = data_lib.open_source(cfg.data, cfg.model.vocab_size, t.seq_len).validation_batches(t.batch_size, 2)[:1]
  alone = full_evaluation(lm.model, lm.params, first, seed=t.seed, curve_steps=())
  assert alone["elbo_ppl_by_inner_steps"] == {} and alone["curve_tokens"] == 0
  assert metrics["elbo_ppl_by_inner_steps"][str(STEPS)] == pytest.approx(alone["elbo_ppl"], rel=1e-5)
  capsys.readouterr()
