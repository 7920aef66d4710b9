"""Semi-amortised inference: the encoder's proposal as the inner loop's start, the gradient it learns from, and the
inner loop read on a prefix only."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import classic_latent, micro_config
from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.train.step import create_train_state, make_train_step

STEPS = 2
LATENT = classic_latent(n_per_layer=2, inner_steps=STEPS, inner_lr=0.1, encoder=True, encoder_width=32, encoder_context=3)
B, T = 4, 24


def _setup(**latent_overrides):
  cfg = micro_config(layer_pattern="A", window=6)
  cfg = dataclasses.replace(cfg, latent=dataclasses.replace(LATENT, **latent_overrides))
  model = model_lib.LM(cfg.model, cfg.latent)
  params = model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent)
  tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, 256)
  return cfg, model, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _randomised_encoder(params, scale=0.3):
  """Every encoder weight redrawn (its heads start at zero, which would leave most gradients zero)."""
  leaves, tree = jax.tree.flatten(params[model_lib.ENCODER])
  keys = jax.random.split(jax.random.key(9), len(leaves))
  fresh = [scale * jax.random.normal(k, x.shape) / np.sqrt(max(x.shape[0], 1)) for k, x in zip(keys, leaves)]
  return dict(params, **{model_lib.ENCODER: jax.tree.unflatten(tree, fresh)})


@functools.partial(jax.jit, static_argnames=("model", "length"))
def _infer(model, params, batch, key, mask, length=None):
  return latent_lib.infer(model, params, batch["inputs"], batch["targets"], key, target_mask=mask, length=length)[0]


def test_a_fresh_encoder_starts_the_loop_where_the_plain_loop_starts():
  """Its zero-initialised heads propose (0, init_logvar), so the fit equals the plain loop's; shifting the proposal
  shifts the start by exactly that much."""
  cfg, model, params, batch = _setup()
  plain = model_lib.LM(cfg.model, dataclasses.replace(cfg.latent, encoder=False))
  key = jax.random.key(3)
  amortised, reference = _infer(model, params, batch, key, None), _infer(plain, params, batch, key, None)
  np.testing.assert_array_equal(amortised.path.mu[0], reference.path.mu[0])
  np.testing.assert_allclose(amortised.posterior.mu, reference.posterior.mu, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(amortised.posterior.logvar, reference.posterior.logvar, rtol=1e-6)
  encoder = dict(params[model_lib.ENCODER], mu=dict(params[model_lib.ENCODER]["mu"],
                                                     bias=params[model_lib.ENCODER]["mu"]["bias"] + 0.5))
  shifted = _infer(model, dict(params, **{model_lib.ENCODER: encoder}), batch, key, None)
  np.testing.assert_allclose(shifted.path.mu[0] - reference.path.mu[0], 0.5, rtol=1e-6)


def test_the_proposal_reads_only_the_tokens_z_is_fitted_on():
  cfg, model, params, batch = _setup()
  params = _randomised_encoder(params)
  visible = jnp.arange(T)[None, :] < jnp.array([[8], [12], [20], [24]])
  propose = jax.jit(lambda tokens: latent_lib.propose(model, params, tokens, visible))
  base = propose(batch["targets"])
  hidden = batch["targets"].at[:, 20:].set((batch["targets"][:, 20:] + 1) % 256)  # Visible in the last row only.
  moved = propose(hidden)
  np.testing.assert_array_equal(moved.mu[:3], base.mu[:3])
  assert float(jnp.max(jnp.abs(moved.mu[3] - base.mu[3]))) > 1e-4


def test_a_prefix_fit_equals_the_fit_on_whole_rows():
  """The decoder is causal: a fit whose counted targets lie before `length` is the same read on `length` positions."""
  _, model, params, batch = _setup()
  params = _randomised_encoder(params)
  mask = jnp.arange(T)[None, :] < jnp.array([[6], [9], [15], [11]])
  key = jax.random.key(4)
  whole, prefix = _infer(model, params, batch, key, mask), _infer(model, params, batch, key, mask, length=16)
  np.testing.assert_allclose(prefix.posterior.mu, whole.posterior.mu, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(prefix.nll, whole.nll, rtol=1e-5)


@pytest.mark.parametrize("fraction, logvar", [(0.5, False), (1.0, True)])
def test_encoder_learns_the_elbo_at_its_proposal_and_the_train_step_applies_it(fraction, logvar):
  """The encoder's gradient in the train step (SGD at rate 1: old - new weights) equals the gradient of the ELBO per
  fitted token at the loop's start, written directly: proposal plus the loop's noise, z drawn with the loop's eps,
  on whole rows (with fraction 1 the step reads prefixes only); with latent.encoder_logvar through both heads."""
  cfg, model, params, batch = _setup(continuation_fraction=fraction, encoder_logvar=logvar)
  assert ("logvar" in params[model_lib.ENCODER]) == logvar
  params = _randomised_encoder(params)
  optimizer = optax.sgd(1.0)
  state = create_train_state(params, optimizer, seed=5)
  step = make_train_step(model, optimizer, optax.constant_schedule(1.0), grad_accum=1)
  new_state, metrics = step(jax.tree.map(jnp.copy, state), batch)
  got = jax.tree.map(jnp.subtract, params[model_lib.ENCODER], new_state.params[model_lib.ENCODER])

  key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0), 0)
  fit_key, _, split_key = jax.random.split(key, 3)
  init_key, eps_key = jax.random.split(fit_key)
  fit_mask, _ = latent_lib.continuation_masks(split_key, batch["targets"].shape, fraction)
  shape = model_lib.latent_shape(cfg.model, cfg.latent, B)
  eps = jax.random.normal(eps_key, shape)

  def elbo_at_proposal(encoder):
    proposal = latent_lib.propose(model, dict(params, **{model_lib.ENCODER: encoder}), batch["targets"], fit_mask)
    start = latent_lib.initial_posterior(init_key, shape, cfg.latent, proposal)
    nll = latent_lib.token_nll(model, params, batch["inputs"], batch["targets"], start.sample(eps))
    return (jnp.where(fit_mask, nll, 0.0).sum() + latent_lib.kl_divergence(start).sum()) / fit_mask.sum()

  value, want = jax.jit(jax.value_and_grad(elbo_at_proposal))(params[model_lib.ENCODER])
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-7)
  assert max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)) > 1e-3
  assert float(metrics["inner_elbo_start"]) == pytest.approx(float(value), rel=1e-5)


def test_quantisation_keeps_the_encoder_in_float32():
  """It runs once per prompt: int8 serving quantises the decoder's kernels and leaves every encoder weight as is."""
  from ltm_jax.inference import quantize  # noqa: PLC0415

  cfg, model, params, batch = _setup()
  quantized = quantize.quantize_params(params, model_lib.param_axes(cfg.model, cfg.latent), "int8")
  for got, want in zip(jax.tree.leaves(quantized[model_lib.ENCODER]), jax.tree.leaves(params[model_lib.ENCODER]),
                       strict=True):
    assert got is want
  assert quantize.is_quantized(quantized["block_0"]["mixer"]["q"]["kernel"])
