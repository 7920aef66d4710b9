"""Latent thought vectors: the inner loop, the KL, the absence of gradient leaks, causality, evaluation and errors."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ROOT, classic_latent, micro_config
from ltm_jax import api, cli
from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.config import ConfigError, apply_overrides, validate
from ltm_jax.train.evaluation import CURVE_STEPS, batch_metrics, full_evaluation
from ltm_jax.train.step import create_train_state, make_train_step

# Every test fits with STEPS inner steps on [3, 16] batches where it can, so jitted inner loops are compiled once.
STEPS = 4
LATENT = classic_latent(n_per_layer=3, inner_steps=STEPS, inner_lr=0.3)


def _config(**latent_overrides):
  cfg = micro_config()
  return dataclasses.replace(cfg, latent=dataclasses.replace(LATENT, **latent_overrides))


def _setup(seed=0, **latent_overrides):
  cfg = _config(**latent_overrides)
  model = model_lib.LM(cfg.model, cfg.latent)
  params = model_lib.init_params(cfg.model, jax.random.key(seed), cfg.latent)
  tokens = jax.random.randint(jax.random.key(seed + 100), (3, 17), 0, 256)
  return cfg, model, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_inner_loop_lowers_every_sequences_elbo():
  _, model, params, batch = _setup()
  fitted, _ = _fit(model, params, batch, jax.random.key(1), STEPS)
  elbo = fitted.nll + fitted.kl  # [steps + 1, B], all with the same fixed noise.
  assert elbo.shape == (STEPS + 1, 3)
  assert bool(jnp.all(elbo[-1] < elbo[0] - 1.0)), elbo  # Each sequence gains at least a nat.


def test_analytic_kl_matches_monte_carlo():
  rng = np.random.default_rng(0)
  mu, logvar = rng.normal(size=(2, 3, 4)), rng.uniform(-3, 1, size=(2, 3, 4))
  analytic = np.asarray(latent_lib.kl_divergence(latent_lib.Posterior(jnp.asarray(mu), jnp.asarray(logvar))))
  n = 200_000  # E_q[log q(z) - log p(z)] in float64; the constant log(2 pi) cancels.
  z = mu[None] + np.exp(0.5 * logvar)[None] * rng.normal(size=(n, *mu.shape))
  log_q = -0.5 * (((z - mu) ** 2) / np.exp(logvar) + logvar)
  log_p = -0.5 * z**2
  samples = (log_q - log_p).reshape(n, 2, -1).sum(-1)
  stderr = samples.std(0) / np.sqrt(n)
  np.testing.assert_array_less(np.abs(samples.mean(0) - analytic), 5 * stderr)
  assert analytic.shape == (2,) and np.all(analytic > 0)


def test_zero_inner_steps_decode_with_the_initial_posterior():
  cfg, model, params, batch = _setup()
  key = jax.random.key(3)
  fitted, eps = _fit(model, params, batch, key, 0)
  start = latent_lib.initial_posterior(jax.random.split(key)[0], eps.shape, cfg.latent)
  np.testing.assert_allclose(fitted.posterior.mu, start.mu, rtol=1e-6)  # Jitted vs eager rounding only.
  np.testing.assert_array_equal(fitted.posterior.logvar, start.logvar)
  expected = latent_lib.token_nll(model, params, batch["inputs"], batch["targets"], start.sample(eps)).sum(-1)
  np.testing.assert_allclose(fitted.nll[0], expected, rtol=1e-6)


def test_a_run_time_step_count_fits_as_the_scanned_loop_in_one_program():
  """Evaluation's inner loop takes its step count at run time (fit_posterior): one compiled program, and for every
  count the posterior the scanned loop of that many steps reaches."""
  _, model, params, batch = _setup()
  key = jax.random.key(6)
  traced = jax.jit(lambda steps: latent_lib.infer(model, params, batch["inputs"], batch["targets"], key, steps=steps,
                                                  trace=False)[0].posterior)
  for steps in (0, 1, STEPS):
    want = _fit(model, params, batch, key, steps)[0].posterior
    got = traced(steps)
    np.testing.assert_allclose(got.mu, want.mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.logvar, want.logvar, rtol=1e-5, atol=1e-6)
  assert traced._cache_size() == 1


def test_inner_loop_is_the_same_with_and_without_jit():
  _, model, params, batch = _setup()
  batch = {k: v[:1, :6] for k, v in batch.items()}  # Eager execution dispatches op by op: keep it small.
  run = lambda p, b: latent_lib.infer(model, p, b["inputs"], b["targets"], jax.random.key(4), steps=2)[0]
  jitted = jax.jit(run)(params, batch)
  with jax.disable_jit():
    eager = run(params, batch)
  np.testing.assert_allclose(jitted.posterior.mu, eager.posterior.mu, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(jitted.nll, eager.nll, rtol=1e-5)


def test_decoder_gradient_equals_gradient_with_z_frozen():
  # With SGD at learning rate 1, params - new_params is the step's gradient. It must equal the gradient of the NLL
  # with z fixed to the inner loop's output: any inner-loop gradient reaching the decoder would change it.
  # The leak check differentiates through the inner loop, a second derivative: the model pins the reference
  # backends, which have one (auto picks fused kernels on a GPU, which refuse it).
  cfg = dataclasses.replace(micro_config(attention_impl="xla", wkv_impl="scan"), latent=LATENT)
  model = model_lib.LM(cfg.model, cfg.latent)
  params = model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent)
  tokens = jax.random.randint(jax.random.key(100), (3, 17), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  optimizer = optax.sgd(1.0)
  state = create_train_state(params, optimizer, seed=7)
  step = make_train_step(model, optimizer, optax.constant_schedule(1.0), grad_accum=1)
  new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
  grads = jax.tree.map(jnp.subtract, params, new_state.params)

  key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0), 0)
  z = jax.jit(latent_lib.decoder_terms, static_argnums=0)(model, params, batch, key).scored[0][0]
  frozen = jax.lax.stop_gradient(z)
  loss = lambda p: latent_lib.token_nll(model, p, batch["inputs"], batch["targets"], frozen).mean()
  expected = jax.jit(jax.grad(loss))(params)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # And z does depend on the decoder: differentiating through the inner loop would give a different gradient.
  leaky = lambda p: latent_lib.token_nll(model, p, batch["inputs"], batch["targets"],
                                         _unstopped_fit(model, p, batch, key)).mean()
  leak = jax.jit(jax.grad(leaky))(params)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(leak), jax.tree.leaves(expected)))
  assert diff > 1e-5
  assert float(metrics["kl"]) > 0 and np.isfinite(float(metrics["inner_elbo_start"]))


def _fit(model, params, batch, key, steps):
  """The jitted inner loop shared by the tests (compiled once per model and step count)."""
  return _jitted_infer(model, params, batch["inputs"], batch["targets"], key, steps)


@functools.partial(jax.jit, static_argnames=("model", "steps"))
def _jitted_infer(model, params, inputs, targets, key, steps):
  return latent_lib.infer(model, params, inputs, targets, key, steps=steps)


def _unstopped_fit(model, params, batch, key):
  """The inner loop written without stop_gradient (what the original PyTorch code effectively does)."""
  cfg = model.latent
  fit_key, sample_key, _ = jax.random.split(key, 3)  # As latent_lib.decoder_terms splits its key.
  init_key, eps_key = jax.random.split(fit_key)
  shape = model_lib.latent_shape(model.cfg, cfg, batch["inputs"].shape[0])
  q = latent_lib.initial_posterior(init_key, shape, cfg)
  eps = jax.random.normal(eps_key, shape)
  opt = optax.adam(latent_lib.inner_schedule(cfg, cfg.inner_steps), b1=cfg.inner_b1, b2=cfg.inner_b2)
  opt_state = opt.init(q)
  for _ in range(1):  # One step is enough for z to depend on the decoder.
    g = jax.grad(lambda q: (latent_lib.token_nll(model, params, batch["inputs"], batch["targets"], q.sample(eps)).sum()
                            + latent_lib.kl_divergence(q).sum()))(q)
    updates, opt_state = opt.update(g, opt_state, q)
    q = optax.apply_updates(q, updates)
  return q.sample(jax.random.normal(sample_key, shape))


@pytest.mark.parametrize("rope", [False, True])
def test_cross_attention_keeps_the_decoder_causal(rope):
  cfg, model, params, batch = _setup(rope=rope, rope_span=16)
  z = jax.random.normal(jax.random.key(5), model_lib.latent_shape(cfg.model, cfg.latent, 3))
  tokens = batch["inputs"]
  changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % 256)
  a, _ = model.apply({"params": params}, tokens, latents=z)
  b, _ = model.apply({"params": params}, changed, latents=z)
  np.testing.assert_array_equal(a[:, :9], b[:, :9])
  assert float(jnp.max(jnp.abs(a[:, 9:] - b[:, 9:]))) > 1e-4
  # And the logits do depend on z.
  c, _ = model.apply({"params": params}, tokens, latents=z + 1.0)
  assert float(jnp.max(jnp.abs(a - c))) > 1e-4


def test_latents_add_only_cross_attention_to_the_same_decoder():
  cfg = _config()
  plain = model_lib.init_params(cfg.model, jax.random.key(0))
  latent = model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent)
  for name, block in latent.items():
    if not name.startswith("block_"):
      continue
    assert set(block) - set(plain[name]) == {"cross_attention", "cross_norm"}
    extra = {k: v for k, v in block.items() if k not in ("cross_attention", "cross_norm")}
    chex_equal = jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), extra, plain[name])
    assert all(jax.tree.leaves(chex_equal))
  np.testing.assert_array_equal(latent["embed"]["embedding"], plain["embed"]["embedding"])


def test_decoding_under_z_equals_the_forward_pass():
  cfg, model, params, batch = _setup(rope=True, rope_span=16)
  lm = api.LanguageModel(cfg, params)
  tokens = np.asarray(batch["inputs"])
  z = lm.prior_latents(3, seed=2)
  whole = lm.forward(tokens, z)
  state = lm.init_state(3)
  pieces = []
  for start, stop in ((0, 5), (5, 6), (6, 16)):
    positions = np.broadcast_to(np.arange(start, stop), (3, stop - start))
    logits, state = lm.step(state, tokens[:, start:stop], z, positions)
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, 1), whole, rtol=2e-5, atol=2e-5)


def test_generation_conditions_on_posterior_or_prior():
  cfg, _, params, _ = _setup()
  lm = api.LanguageModel(cfg, params)
  prompt = np.asarray(lm.encode("def f(x):\n  return"))[None]
  key = jax.random.key(0)
  posterior = lm.generate_tokens(prompt, 6, key=key, temperature=0.0, latents="posterior")
  mu = lm.fit_latents(prompt, seed=0).posterior.mu
  assert posterior.shape == (1, 6)
  prior = lm.generate_tokens(prompt, 6, key=key, temperature=0.0, latents="prior")
  explicit = lm.generate_tokens(prompt, 6, key=key, temperature=0.0, latents=mu)
  assert prior.shape == explicit.shape == (1, 6)
  assert isinstance(lm.generate("x", 3, latents="prior"), str)
  with pytest.raises(ValueError, match="pass latents of shape"):
    lm.forward(prompt)
  with pytest.raises(ValueError, match="latents must have shape"):
    lm.forward(prompt, np.zeros((1, 2, 1, 32), np.float32))


def test_full_evaluation_of_latent_and_plain_models():
  cfg, model, params, batch = _setup()
  batches = [batch, {k: v[::-1] for k, v in batch.items()}]
  assert CURVE_STEPS == (0, 4, 8, 16, 32, 64)
  metrics = full_evaluation(model, params, batches, seed=0, curve_steps=(0, 12))
  assert set(metrics["elbo_ppl_by_inner_steps"]) == {"0", str(STEPS), "12"}
  assert metrics["elbo_ppl_is_upper_bound"] is True
  assert metrics["kl"] > 0 and metrics["elbo_ppl"] == pytest.approx(np.exp(metrics["nll"] + metrics["kl"]))
  assert 0 <= metrics["active_units"] <= metrics["latent_dims"] == 2 * 3 * 32
  assert all(np.isfinite(metrics[k]) for k in ("continuation_ppl", "prior_nll", "shuffled_nll"))
  curve = metrics["elbo_ppl_by_inner_steps"]
  assert curve["12"] < curve[str(STEPS)] < curve["0"]  # More inner steps, a tighter bound.

  plain_model = model_lib.LM(cfg.model)
  plain_params = model_lib.init_params(cfg.model, jax.random.key(0))
  plain = full_evaluation(plain_model, plain_params, batches, curve_steps=(0, 12))
  nll = latent_lib.token_nll(plain_model, plain_params, batch["inputs"], batch["targets"])
  assert plain["kl"] == 0 and plain["nll"] == pytest.approx(float(nll.mean()), rel=1e-5)
  assert plain["elbo_ppl"] == pytest.approx(np.exp(plain["nll"]))
  second = float(nll[:, nll.shape[1] // 2:].mean())
  assert plain["continuation_ppl"] == pytest.approx(np.exp(second), rel=1e-5)
  assert plain["prior_nll"] is None and plain["active_units"] is None


def test_active_units_count_what_the_data_moves_not_the_fits_own_noise():
  """A decoder whose cross-attention output is zero ignores z: no unit is active, though its inner loop (8 Adam
  steps at 0.3 from a start of noise) moves every row's mu by about 0.3 a step in directions a row's own noise
  would pick (176 of 192 units passed the 0.01 variance threshold over these 16 rows when each had its own). And
  the fit is a function of the data: two equal rows get the same posterior."""
  cfg = micro_config()
  latent = classic_latent(n_per_layer=3, inner_steps=8, inner_lr=0.3, init_logvar=-1.0)
  model = model_lib.LM(cfg.model, latent)
  reading = model_lib.init_params(cfg.model, jax.random.key(0), latent)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.zeros_like(x) if "cross_attention" in jax.tree_util.keystr(path)
      and "out" in jax.tree_util.keystr(path) else x, reading)
  tokens = jax.random.randint(jax.random.key(1), (2, 8, 33), 0, 256)
  batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
  metrics = full_evaluation(model, params, batches, seed=0, curve_steps=())
  assert metrics["nll"] == pytest.approx(metrics["shuffled_nll"], rel=1e-6)  # z does not matter here.
  assert metrics["active_units"] == 0, metrics["active_units"]
  rows = jnp.concatenate([tokens[0, :1], tokens[0, :1], tokens[0, 1:3]])
  mu = batch_metrics(model, reading, rows[:, :-1], rows[:, 1:], jax.random.key(2), STEPS, full=True)["mu"]
  np.testing.assert_array_equal(mu[0], mu[1])
  assert float(jnp.max(jnp.abs(mu[0] - mu[2]))) > 1e-3  # Other data, another posterior.


@pytest.mark.parametrize("pattern", ["RA", "W"])
def test_the_top_blocks_from_the_trunk_are_the_whole_model(pattern):
  # Blocks below the first that reads z run once (the trunk) and every z starts from their output: the same NLL as
  # the whole model, also for RWKV-7, whose first layer's values ride along to the blocks above (v_first). The
  # lower blocks have no cross-attention and z holds one layer.
  cfg = micro_config(layer_pattern=pattern, rwkv7_head_size=16)
  cfg = dataclasses.replace(cfg, latent=dataclasses.replace(LATENT, top_layers=1))
  model = model_lib.LM(cfg.model, cfg.latent)
  params = model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent)
  assert "cross_attention" not in params["block_0"] and "cross_attention" in params["block_1"]
  tokens = jax.random.randint(jax.random.key(1), (3, 17), 0, 256)
  z = jax.random.normal(jax.random.key(2), model_lib.latent_shape(cfg.model, cfg.latent, 3))
  assert z.shape == (3, 1, 3, cfg.model.d_model)
  whole = latent_lib.token_nll(model, params, tokens[:, :-1], tokens[:, 1:], z)
  trunk = latent_lib.trunk_of(model, params, tokens[:, :-1])
  assert (trunk.v_first is not None) == (pattern == "W")
  np.testing.assert_allclose(latent_lib.token_nll(model, params, tokens[:, :-1], tokens[:, 1:], z, trunk=trunk),
                             whole, rtol=1e-6, atol=1e-6)
  # A prefix of the trunk scores the prefix, as the inner loop reads it.
  np.testing.assert_allclose(latent_lib.token_nll(model, params, tokens[:, :9], tokens[:, 1:10], z,
                                                  trunk=trunk.prefix(9)), whole[:, :9], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("latent.n_per_layer=0", "n_per_layer must be >= 1"),
    ("latent.inner_steps=-1", "inner_steps must be >= 0"),
    ("latent.inner_lr=-0.1", "inner_lr must be >= 0"),
    ("latent.decoder_objective=all", "decoder_objective='all' is not one of final, iterates"),
    ("latent.continuation_fraction=1.5", r"continuation_fraction must be in \[0, 1\]"),
    ("latent.decoder_objective=iterates latent.continuation_fraction=0.5", "cannot be combined"),
    ("latent.encoder_width=48", "encoder_width must be a positive multiple of 32, got 48"),
    ("latent.encoder_width=0", "encoder_width must be a positive multiple of 32, got 0"),
    ("latent.encoder_context=0", "encoder_context must be >= 1, got 0"),
    ("latent.top_layers=0", r"top_layers must be in \[1, model.n_layers=2\] or None, got 0"),
    ("latent.top_layers=3", r"top_layers must be in \[1, model.n_layers=2\] or None, got 3"),
    ("latent.top_layers=1 model.scan_layers=true", "the layer scan cannot stack"),
])
def test_bad_latent_settings_are_refused(override, message):
  with pytest.raises(ConfigError, match=message):
    validate(apply_overrides(_config(), override.split()))


@pytest.fixture(scope="module")
def plain_workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("plain")
  small = ["model.d_model=32", "model.n_layers=2", "train.batch_size=4", "train.seq_len=32", "train.eval_batches=1",
           "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2", "data.worker_threads=1"]
  assert cli.main(["train", "--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(path), *small]) == 0
  return path


def test_plain_checkpoint_evaluated_with_latents_is_refused(plain_workdir, capsys):
  before = sorted(p.name for p in plain_workdir.iterdir())
  code = cli.main(["eval", "--workdir", str(plain_workdir), "latent.enabled=true"])
  err = capsys.readouterr().err
  assert code == 2 and "latent.enabled: checkpoint False, config True" in err and err.count("\n") == 1
  assert sorted(p.name for p in plain_workdir.iterdir()) == before  # No eval.json written.
  code = cli.main(["eval", "--workdir", str(plain_workdir), "--batches", "1"])
  assert code == 0
  metrics = json.loads((plain_workdir / "eval.json").read_text())
  assert metrics["kl"] == 0 and metrics["elbo_ppl_is_upper_bound"] is False


def test_latent_checkpoint_evaluated_without_latents_is_refused(tmp_path, capsys):
  small = ["model.d_model=32", "model.n_layers=2", "train.batch_size=4", "train.seq_len=32", "train.eval_batches=1",
           "train.steps=1", "train.eval_every=1", "train.checkpoint_every=1", "data.worker_threads=1",
           "latent.inner_steps=1"]
  assert cli.main(["train", "--config", str(ROOT / "configs" / "tiny_ltm.py"), "--workdir", str(tmp_path), *small]) == 0
  capsys.readouterr()
  code = cli.main(["eval", "--workdir", str(tmp_path), "latent.enabled=false"])
  assert code == 2 and "latent.enabled: checkpoint True, config False" in capsys.readouterr().err
  assert not (tmp_path / "eval.json").exists()
  code = cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "3",
                   "--latents", "prior"])
  assert code == 0
