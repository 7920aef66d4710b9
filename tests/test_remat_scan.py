"""Remat policies, scanned layers and float16 compute: each changes how the model runs, never what it computes."""

from __future__ import annotations

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import classic_latent, micro_config
from ltm_jax import model as model_lib
from ltm_jax.config import REMAT_POLICIES, ConfigError, apply_overrides, validate
from ltm_jax.layers.common import LOGICAL_AXES

LATENT = classic_latent(n_per_layer=3, inner_steps=2)
# Scanned and unrolled layers run the same float32 ops, fused differently by XLA.
FLOAT32_ATOL = 2e-5


def _random_params(cfg, latent, seed=1):
  """Every parameter random (RWKV-7 starts with zero output projections, which would hide a wrong v_first)."""
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0), latent))
  leaves, tree = jax.tree.flatten(shapes)
  # One jitted draw: drawing leaf by leaf eagerly compiles a program per distinct shape.
  draw = lambda key: tree.unflatten([0.3 * jax.random.normal(k, x.shape)
                                     for k, x in zip(jax.random.split(key, len(leaves)), leaves)])
  return jax.jit(draw)(jax.random.key(seed))


def _batch(cfg, batch=2, length=12, seed=2):
  tokens = jax.random.randint(jax.random.key(seed), (batch, length + 1), 0, cfg.vocab_size)
  return tokens[:, :-1], tokens[:, 1:]


def _loss_fn(cfg, latent, inputs, targets):
  """(params, z) -> mean token NLL and logits."""
  model = model_lib.LM(cfg, latent)

  def loss(params, z):
    logits, _ = model.apply({"params": params}, inputs, latents=z)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), logits

  return loss


# Pattern, layers, remat policies of the scanned model (against the unscanned model without remat, computed once per
# case, so these also check that remat changes no value), with or without latents. "WA" keeps its first unit (the
# first RWKV-7 layer) separate.
SCAN_CASES = [("RA", 4, ("full",), True), ("A", 3, ("minimal",), False), ("WA", 6, ("save_mixer", "save_ffn"), True)]


@pytest.mark.parametrize("pattern, n_layers, remats, with_latents", SCAN_CASES,
                         ids=[f"{p}{n}-{'+'.join(r)}{'-latent' if z else ''}" for p, n, r, z in SCAN_CASES])
def test_scanned_layers_give_the_same_logits_and_gradients(pattern, n_layers, remats, with_latents):
  cfg = micro_config(layer_pattern=pattern, n_layers=n_layers, rwkv7_head_size=8, ln0=pattern == "WA").model
  latent = LATENT if with_latents else None
  params = _random_params(cfg, latent)
  inputs, targets = _batch(cfg)
  z = None if latent is None else jax.random.normal(jax.random.key(3), model_lib.latent_shape(cfg, latent, 2))
  argnums = (0, 1) if with_latents else 0
  grad = lambda c, p: jax.jit(jax.value_and_grad(_loss_fn(c, latent, inputs, targets), argnums, has_aux=True))(p, z)
  (loss, logits), grads = grad(cfg, params)
  scale = float(np.abs(logits).max())
  for remat in remats:
    scanned_cfg = dataclasses.replace(cfg, scan_layers=True, remat=remat)
    scanned_params = model_lib.scan_params(scanned_cfg, params)
    assert model_lib.SCANNED in scanned_params and not any(k == f"block_{n_layers - 1}" for k in scanned_params)
    (scanned_loss, scanned_logits), scanned_grads = grad(scanned_cfg, scanned_params)
    np.testing.assert_allclose(scanned_logits, logits, atol=FLOAT32_ATOL * scale, rtol=0)
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-5)
    model_grads = grads
    if with_latents:  # The gradient the latent inner loop follows, too.
      np.testing.assert_allclose(scanned_grads[1], grads[1], atol=1e-4 * float(np.abs(grads[1]).max()), rtol=0)
      model_grads, scanned_grads = grads[0], scanned_grads[0]
    chex.assert_trees_all_close(model_lib.unscan_params(scanned_cfg, scanned_grads), model_grads, atol=1e-5,
                                rtol=1e-4)


def test_scanned_segments_with_carried_state_equal_one_call():
  n_layers = 6  # The first unit (with the first RWKV-7 layer) separate, then two scanned repeats of "WA".
  cfg = micro_config(layer_pattern="WA", n_layers=n_layers, rwkv7_head_size=8, scan_layers=True).model
  plain_cfg = dataclasses.replace(cfg, scan_layers=False)
  plain_params = _random_params(plain_cfg, None)
  params = model_lib.scan_params(cfg, plain_params)
  apply = jax.jit(model_lib.LM(cfg).apply)
  tokens = jax.random.randint(jax.random.key(4), (2, 19), 0, cfg.vocab_size)
  whole, whole_state = apply({"params": params}, tokens)
  state, pieces = model_lib.init_state(cfg, 2), []
  for start, stop in [(0, 18), (18, 19)]:  # A prompt, then a one-token step as decoding does.
    logits, state = apply({"params": params}, tokens[:, start:stop], state)
    pieces.append(logits)
  scale = float(np.abs(whole).max())
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=FLOAT32_ATOL * scale, rtol=0)
  chex.assert_trees_all_close(state, whole_state, atol=FLOAT32_ATOL * scale, rtol=1e-5)
  # The stacked state holds the same per-layer states as the unscanned model's.
  plain, plain_state = jax.jit(model_lib.LM(plain_cfg).apply)({"params": plain_params}, tokens)
  np.testing.assert_allclose(whole, plain, atol=FLOAT32_ATOL * scale, rtol=0)
  chex.assert_trees_all_close(model_lib.unscan_state(cfg, whole_state), plain_state,
                              atol=FLOAT32_ATOL * scale, rtol=1e-5)
  assert len(model_lib.unscan_state(cfg, model_lib.init_state(cfg, 2))) == n_layers


def test_scanned_parameters_are_stacked_with_a_layer_axis_and_initialised_per_layer():
  cfg = micro_config(layer_pattern="RA", n_layers=6, scan_layers=True).model
  params = model_lib.init_params(cfg, jax.random.key(0))
  # The module's own init has the same tree and shapes (so `param_axes` describes `init_params`).
  own = jax.eval_shape(lambda: nn.meta.unbox(model_lib._init_variables(cfg, None, jax.random.key(0))["params"]))
  chex.assert_trees_all_equal_shapes_and_dtypes(params, own)
  assert params[model_lib.SCANNED]["block_0"]["mixer"]["key"]["kernel"].shape == (3, 32, 32)
  # Same key, same model as unscanned: RWKV-4's depth-dependent initialisation survives stacking.
  plain = model_lib.init_params(dataclasses.replace(cfg, scan_layers=False), jax.random.key(0))
  chex.assert_trees_all_equal(model_lib.unscan_params(cfg, params), plain)
  chex.assert_trees_all_equal(model_lib.scan_params(cfg, plain), params)
  mixes = params[model_lib.SCANNED]["block_0"]["mixer"]["mix_k"]
  assert not np.allclose(mixes[0], mixes[1])
  axes = model_lib.param_axes(cfg)
  for path, names in jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]:
    assert set(names) <= set(LOGICAL_AXES)
    assert (names[0] == model_lib.LAYER_AXIS) == model_lib.is_stacked(path), jax.tree_util.keystr(path)


def _residual_bytes(cfg, latent, inputs, targets, z, wrt: str) -> int:
  """Bytes the forward pass keeps for the backward pass to `wrt` ("params" or "z"): the arrays the VJP closure holds
  (traced abstractly: no compilation)."""
  loss = _loss_fn(cfg, latent, inputs, targets)

  def vjp(params, z):
    if wrt == "params":
      return jax.vjp(lambda p: loss(p, z)[0], params)[1]
    return jax.vjp(lambda zz: loss(params, zz)[0], z)[1]

  params = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0), latent))
  residuals = jax.eval_shape(vjp, params, z)
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(residuals))


def test_remat_policies_trade_memory_as_named():
  """What each policy keeps between forward and backward (their values are checked against no remat above)."""
  cfg = micro_config(layer_pattern="RA", n_layers=2).model
  inputs, targets = _batch(cfg, length=64)
  z = jax.ShapeDtypeStruct(model_lib.latent_shape(cfg, LATENT, 2), jnp.float32)
  saved = {p: _residual_bytes(dataclasses.replace(cfg, remat=p), LATENT, inputs, targets, z, "params")
           for p in REMAT_POLICIES}
  assert saved["full"] < saved["minimal"] < saved["none"], saved
  for policy in ("save_mixer", "save_ffn", "save_cross_attention"):
    assert saved["full"] < saved[policy] < saved["save_mixer_ffn"] < saved["none"], (policy, saved)
  # The latent inner loop differentiates the same model with respect to z: the policy applies there too.
  z_saved = {p: _residual_bytes(dataclasses.replace(cfg, remat=p), LATENT, inputs, targets, z, "z")
             for p in ("none", "full")}
  assert z_saved["full"] < z_saved["none"] / 2, z_saved


def test_float16_compute_keeps_float32_params_logits_and_gradients():
  cfg = micro_config(layer_pattern="RWA", n_layers=3, rwkv7_head_size=8).model  # Every mixer and FFN kind.
  params = _random_params(cfg, None)
  inputs, targets = _batch(cfg, length=24)
  results = {}
  for dtype in ("float32", "float16"):
    fn = _loss_fn(dataclasses.replace(cfg, dtype=dtype), None, inputs, targets)
    results[dtype] = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, None)
  (loss, logits), grads = results["float16"]
  (loss32, logits32), grads32 = results["float32"]
  assert logits.dtype == jnp.float32 and {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  # float16 has an 11-bit significand: ~1e-3 relative per rounding, 8x finer than bfloat16's 8 bits; three layers of
  # rounding on random weights leave a few logits off by ~1e-2 of the largest, the mean far less.
  scale = float(np.abs(logits32).max())
  np.testing.assert_allclose(logits, logits32, atol=1.5e-2 * scale, rtol=0)
  assert float(np.abs(logits - logits32).mean()) < 1.5e-3 * scale
  np.testing.assert_allclose(loss, loss32, rtol=1e-3)
  error = optax.tree.norm(jax.tree.map(jnp.subtract, grads, grads32)) / optax.tree.norm(grads32)
  assert error < 4e-2, error  # Measured: 2.1% (bfloat16: 8%); one layer alone: 0.1-0.2% (bfloat16: ~1%).


@pytest.mark.parametrize("override, message", [
    ("model.remat=everything", "model.remat='everything' is not one of none, full, minimal"),
    ("model.dtype=float64", "model.dtype='float64' is not one of float32, bfloat16, float16"),
])
def test_bad_settings_are_refused(override, message):
  with pytest.raises(ConfigError, match=message):
    validate(apply_overrides(micro_config(), [override]))
