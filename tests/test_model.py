"""The LM: causality, segment-wise processing with carried state, parameters and their logical axes."""

from __future__ import annotations

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax import sublayers
from ltm_jax.layers.common import LOGICAL_AXES

# Every mixer alone, with its options, and hybrids.
VARIANTS = {
    "attention": dict(layer_pattern="A"),
    "attention_window_gqa": dict(layer_pattern="A", window=5, n_kv_heads=2),
    "rwkv4": dict(layer_pattern="R"),
    "hybrid": dict(layer_pattern="RA"),
    "hybrid_swiglu_layernorm_tied": dict(layer_pattern="RA", ffn="swiglu", norm="layernorm", tie_embeddings=True),
}
FLOAT32_ATOL = 2e-5  # Different association of the same float32 sums (chunked vs whole).


def _setup(variant: str, seed: int = 0):
  cfg = micro_config(**VARIANTS[variant]).model
  params = model_lib.init_params(cfg, jax.random.key(seed))
  return cfg, model_lib.LM(cfg), params


def _tokens(key, batch, length, cfg):
  return jax.random.randint(key, (batch, length), 0, cfg.vocab_size)


def test_every_mixer_letter_and_ffn_choice_has_a_sublayer_entry():
  assert set(sublayers.MIXER_KINDS) == set(config_lib.MIXERS.values())
  assert set(sublayers.FFN_KINDS) == set(config_lib.FFNS) - {"auto"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_future_tokens_never_change_earlier_logits(variant):
  cfg, model, params = _setup(variant)
  tokens = _tokens(jax.random.key(1), 2, 23, cfg)
  cut = 11
  changed = tokens.at[:, cut:].set(_tokens(jax.random.key(2), 2, 23 - cut, cfg))
  apply = jax.jit(lambda t: model.apply({"params": params}, t)[0])
  a, b = apply(tokens), apply(changed)
  np.testing.assert_array_equal(np.asarray(a[:, :cut]), np.asarray(b[:, :cut]))
  assert not np.allclose(a[:, cut:], b[:, cut:])  # The change is visible where it should be.


@pytest.mark.parametrize("variant", VARIANTS)
def test_segments_with_carried_state_equal_whole_sequence(variant):
  cfg, model, params = _setup(variant)
  apply = jax.jit(model.apply)  # Half the time of op-by-op (measured), even compiling once per segment length.
  tokens = _tokens(jax.random.key(3), 2, 29, cfg)
  whole, whole_state = apply({"params": params}, tokens)
  state, pieces = model_lib.init_state(cfg, 2), []
  for start, stop in [(0, 7), (7, 8), (8, 20), (20, 29)]:  # Includes one-token steps, as decoding does.
    logits, state = apply({"params": params}, tokens[:, start:stop], state)
    pieces.append(logits)
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=FLOAT32_ATOL, rtol=0)
  chex.assert_trees_all_close(state, whole_state, atol=FLOAT32_ATOL, rtol=1e-5)  # Final states agree too.


def test_window_cache_holds_exactly_window_entries():
  cfg, model, params = _setup("attention_window_gqa")
  state = model_lib.init_state(cfg, 1)
  assert state[0].mixer.k.shape == (1, cfg.window, cfg.kv_heads, cfg.head_dim)
  _, state = model.apply({"params": params}, _tokens(jax.random.key(4), 1, 12, cfg), state)
  positions = np.asarray(state[0].mixer.positions[0])  # A ring buffer: position p sits in slot p % window.
  np.testing.assert_array_equal(np.sort(positions), np.arange(12 - cfg.window, 12))
  np.testing.assert_array_equal(positions % cfg.window, np.arange(cfg.window))


def test_state_none_equals_initial_state():
  cfg, model, params = _setup("hybrid")
  tokens = _tokens(jax.random.key(5), 3, 9, cfg)
  a, _ = model.apply({"params": params}, tokens)
  b, _ = model.apply({"params": params}, tokens, model_lib.init_state(cfg, 3))
  np.testing.assert_allclose(a, b, atol=FLOAT32_ATOL, rtol=0)


def test_each_block_adds_its_last_output_with_the_next_norm():
  """Between blocks the residual add joins the next block's first norm (and the last block's the final norm) as one
  AddNorm op; under whole-block remat each block adds its own. The logits agree either way, and a block that drops
  the pending output (or adds it twice) would not."""
  cfg, model, params = _setup("hybrid")
  tokens = _tokens(jax.random.key(6), 2, 9, cfg)
  joined = lambda m, _: m.name in ("mixer_norm", "final_norm")
  outputs = {}
  for remat in ("none", "full"):
    lm = model_lib.LM(dataclasses.replace(cfg, remat=remat))
    logits, captured = lm.apply({"params": params}, tokens, capture_intermediates=joined, mutable=["intermediates"])
    found = captured["intermediates"]
    joins = lambda calls: isinstance(calls["__call__"][0], tuple)  # AddNorm returns (stream, its norm).
    kinds = [joins(found["block_0"]["mixer_norm"]), joins(found["block_1"]["mixer_norm"]), joins(found["final_norm"])]
    assert kinds == ([False, True, True] if remat == "none" else [False, False, False]), (remat, kinds)
    outputs[remat] = np.asarray(logits[0])
  scale = np.abs(outputs["full"]).max()
  np.testing.assert_allclose(outputs["none"], outputs["full"], atol=FLOAT32_ATOL * scale, rtol=0)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  cfg = micro_config(dtype="bfloat16").model
  params = model_lib.init_params(cfg, jax.random.key(0))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  tokens = _tokens(jax.random.key(6), 2, 16, cfg)
  low, _ = model_lib.LM(cfg).apply({"params": params}, tokens)
  full, _ = model_lib.LM(micro_config().model).apply({"params": params}, tokens)
  assert low.dtype == jnp.float32
  # Measured against the logits' own spread (their standard deviation, about 0.11 at initialisation; float32 is the
  # reference, its rounding ~1e-7 of bfloat16's): bfloat16's 8-bit mantissa leaves the largest difference at about
  # 1.1% of it and the mean at about 0.2%; the bounds allow ~3x that. A block computed wrongly in bfloat16 (a
  # dropped norm, a lost residual) moves logits by a sizeable part of the spread.
  low, full = np.asarray(low, np.float64), np.asarray(full, np.float64)
  spread = full.std()
  difference = np.abs(low - full)
  assert difference.max() < 0.03 * spread, (difference.max(), spread)
  assert difference.mean() < 0.006 * spread, (difference.mean(), spread)


def test_bfloat16_residual_stream_stays_near_float32():
  """model.residual_dtype=bfloat16 adds the sub-layers' outputs in bfloat16: against the float32 model, measured at
  about 1.9% of the logits' spread at most and 0.34% on average (the float32 stream's 1.1% and 0.2%, tested above),
  the bounds ~2.5x that; it differs from the float32 stream by about as much, so the setting takes effect."""
  cfg = micro_config(dtype="bfloat16", residual_dtype="bfloat16").model
  params = model_lib.init_params(cfg, jax.random.key(3))
  tokens = _tokens(jax.random.key(8), 2, 16, cfg)
  low, _ = model_lib.LM(cfg).apply({"params": params}, tokens)
  stream32, _ = model_lib.LM(micro_config(dtype="bfloat16").model).apply({"params": params}, tokens)
  full, _ = model_lib.LM(micro_config().model).apply({"params": params}, tokens)
  low, stream32, full = (np.asarray(a, np.float64) for a in (low, stream32, full))
  spread = full.std()
  assert np.abs(low - full).max() < 0.05 * spread and np.abs(low - full).mean() < 0.01 * spread
  assert np.abs(low - stream32).max() > 0.005 * spread
  with pytest.raises(config_lib.ConfigError, match="residual_dtype"):
    micro_config(residual_dtype="bfloat16")  # A bfloat16 stream needs bfloat16 compute.


def test_logits_cover_the_vocabulary_and_head_is_padded():
  cfg, model, params = _setup("hybrid")
  logits, _ = model.apply({"params": params}, _tokens(jax.random.key(7), 1, 4, cfg))
  assert logits.shape == (1, 4, cfg.vocab_size)
  assert params["embed"]["embedding"].shape == (384, cfg.d_model)
  assert params["head"]["kernel"].shape == (cfg.d_model, 384)


def test_every_parameter_has_logical_axes():
  for variant in VARIANTS:
    cfg = micro_config(**VARIANTS[variant]).model
    variables = jax.eval_shape(lambda: model_lib.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
    leaves = jax.tree_util.tree_flatten_with_path(variables["params"],
                                                  is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    for path, leaf in leaves:
      assert isinstance(leaf, nn.Partitioned), f"{variant}: {jax.tree_util.keystr(path)} has no logical axes"
      assert len(leaf.names) == leaf.value.ndim
      assert set(leaf.names) <= set(LOGICAL_AXES), leaf.names
      assert len(set(leaf.names)) == len(leaf.names), f"{jax.tree_util.keystr(path)} repeats an axis name"


def test_init_is_deterministic_and_seed_dependent():
  cfg = micro_config().model
  a = model_lib.init_params(cfg, jax.random.key(0))
  b = model_lib.init_params(cfg, jax.random.key(0))
  c = model_lib.init_params(cfg, jax.random.key(1))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert not np.array_equal(a["embed"]["embedding"], c["embed"]["embedding"])


# RWKV-7 (W) with the official ln0, in a hybrid where v_first crosses an attention layer. Its official initialisation
# zeroes the output projections, so these tests move every parameter to random values first.
RWKV7_MODEL = dict(layer_pattern="WAW", n_layers=3, rwkv7_head_size=16, ln0=True, norm="layernorm")


def _rwkv7_setup():
  cfg = micro_config(**RWKV7_MODEL).model
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  leaves, tree = jax.tree.flatten(shapes)
  # One jitted draw: drawing leaf by leaf eagerly compiles a program per distinct shape.
  draw = lambda key: tree.unflatten([0.3 * jax.random.normal(k, x.shape)
                                     for k, x in zip(jax.random.split(key, len(leaves)), leaves)])
  return cfg, model_lib.LM(cfg), jax.jit(draw)(jax.random.key(1))


def test_rwkv7_segments_with_carried_state_equal_whole_sequence():
  cfg, model, params = _rwkv7_setup()
  apply = jax.jit(model.apply)  # Faster than op-by-op here, even compiling once per segment length.
  tokens = _tokens(jax.random.key(3), 2, 29, cfg)
  whole, whole_state = apply({"params": params}, tokens)
  state, pieces = model_lib.init_state(cfg, 2), []
  for start, stop in [(0, 7), (7, 8), (8, 29)]:
    logits, state = apply({"params": params}, tokens[:, start:stop], state)
    pieces.append(logits)
  scale = float(np.abs(whole).max())
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=FLOAT32_ATOL * scale, rtol=0)
  chex.assert_trees_all_close(state, whole_state, atol=FLOAT32_ATOL * scale, rtol=1e-5)


def test_rwkv7_future_tokens_never_change_earlier_logits_and_v_first_reaches_later_layers():
  cfg, model, params = _rwkv7_setup()
  apply = jax.jit(model.apply)
  tokens = _tokens(jax.random.key(1), 2, 23, cfg)
  changed = tokens.at[:, 11:].set(_tokens(jax.random.key(2), 2, 12, cfg))
  a, _ = apply({"params": params}, tokens)
  b, _ = apply({"params": params}, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :11]), np.asarray(b[:, :11]))
  assert not np.allclose(a[:, 11:], b[:, 11:])
  # Only the last layer (W after A) reads v_first: its value-residual gate changes the logits.
  block = dict(params["block_2"]["mixer"], value_residual_base=params["block_2"]["mixer"]["value_residual_base"] + 3)
  c, _ = apply({"params": dict(params, block_2=dict(params["block_2"], mixer=block))}, tokens)
  assert "value_residual_base" not in params["block_0"]["mixer"] and not np.allclose(a, c)
  ln0 = dict(params, embed_norm=dict(params["embed_norm"], bias=params["embed_norm"]["bias"] + 1))
  assert not np.allclose(a, apply({"params": ln0}, tokens)[0])  # ln0 is applied.


def test_rwkv7_parameters_have_logical_axes_and_state_matches_layout():
  cfg = micro_config(**RWKV7_MODEL).model
  variables = jax.eval_shape(lambda: model_lib.LM(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  leaves = jax.tree_util.tree_flatten_with_path(variables["params"], is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
  for path, leaf in leaves:
    assert isinstance(leaf, nn.Partitioned), f"{jax.tree_util.keystr(path)} has no logical axes"
    assert len(leaf.names) == leaf.value.ndim and len(set(leaf.names)) == len(leaf.names)
    assert set(leaf.names) <= set(LOGICAL_AXES), leaf.names
  state = model_lib.init_state(cfg, 3)
  assert state[0].mixer.wkv.shape == (3, cfg.d_model // 16, 16, 16) and state[0].ffn.last_x.shape == (3, cfg.d_model)
  assert state[1].ffn is None and "embed_norm" in variables["params"]


@pytest.mark.parametrize("tie", [False, True], ids=["head", "tied"])
def test_bfloat16_model_keeps_float32_logits(tie):
  """The head multiplies bfloat16 activations and weights but accumulates into float32: each logit matches the
  float64 product of the same bfloat16 operands far inside bfloat16's rounding (2^-9 relative), which a head that
  rounds its result to bfloat16 misses."""
  cfg = micro_config(dtype="bfloat16", tie_embeddings=tie)
  params = model_lib.init_params(cfg.model, jax.random.key(4))
  tokens = _tokens(jax.random.key(5), 2, 16, cfg.model)
  model = model_lib.LM(cfg.model)
  (logits, _), captured = model.apply({"params": params}, tokens, capture_intermediates=lambda m, _: m.name == "final_norm",
                                      mutable=["intermediates"])
  _, hidden = captured["intermediates"]["final_norm"]["__call__"][0]  # (stream, its norm): the last block's add.
  hidden = np.asarray(hidden, np.float64)
  weight = params["embed"]["embedding"].T if tie else params["head"]["kernel"]
  weight = np.asarray(jnp.asarray(weight).astype(jnp.bfloat16), np.float64)
  expected = (hidden @ weight)[..., :cfg.model.vocab_size]
  assert logits.dtype == jnp.float32
  scale = np.abs(expected).max()
  np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=0, atol=1e-5 * scale)
  assert np.abs(np.asarray(logits, np.float64) - expected).max() < 2.0**-12 * scale


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_matmul_precision_reaches_every_float32_matmul(precision):
  cfg = micro_config(matmul_precision=precision, layer_pattern="WA", rwkv7_head_size=16).model
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = _tokens(jax.random.key(1), 2, 16, cfg)
  text = jax.jit(lambda p, t: model_lib.LM(cfg).apply({"params": p}, t)[0]).lower(params, tokens).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  expected = f"precision = [{precision.upper()}, {precision.upper()}]"
  assert len(dots) > 10 and all(expected in line for line in dots), [d for d in dots if expected not in d][:2]
