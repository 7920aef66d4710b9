"""Int8 weight-only quantisation: the rounding bound against a float64 reference, per-channel (and per-layer)
scales, which leaves of every model kind are quantised, logits drift, memory, jit and the unclassifiable-leaf error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import classic_latent, micro_config
from ltm_jax import model as model_lib
from ltm_jax.inference.quantize import Int4Weight, Int8Weight, dequantize_params, has_int8_weights
from ltm_jax.inference.quantize import fake_quantize_params, has_quantized_weights, param_bytes, quantization_error
from ltm_jax.inference import quantize as quantize_lib
from ltm_jax.inference.quantize import quantization_plan, quantize_params

ROUNDING = 0.5 / 127  # The worst relative (to the channel's max|W|) error of rounding to 255 symmetric levels.
LATENT = classic_latent(n_per_layer=2)
KINDS = {  # name: (model overrides, latent)
    "rwkv4_attention_untied": ({"layer_pattern": "RA", "tie_embeddings": False}, None),
    "rwkv7_scanned_tied": ({"layer_pattern": "W", "rwkv7_head_size": 16, "n_layers": 3, "scan_layers": True,
                            "tie_embeddings": True}, None),
    "attention_latent_untied": ({"layer_pattern": "A", "tie_embeddings": False}, LATENT),
    "titans_untied": ({"layer_pattern": "MG", "window": 8, "tie_embeddings": False}, None),
}


def _name(path) -> str:
  return "/".join(str(entry.key) for entry in path)


@functools.cache
def _model(kind: str):
  """(cfg, latent, params, axes) with every weight matrix moved away from its init by N(0, 0.05^2) noise: RWKV-7's
  zero-initialised LoRA downs and outputs would otherwise make their layers (and their quantisation) trivially
  exact. (Much more noise makes the tiny RWKV-7 ill-conditioned: any rounding-size change then moves some logits a
  lot.) Initialised under jit: eager initialisation compiles every op separately and takes several times longer."""
  overrides, latent = KINDS[kind]
  cfg = micro_config(**overrides).model
  params = jax.jit(model_lib.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), latent)
  rng = np.random.default_rng(1)

  def perturb(path, leaf):
    if leaf.ndim - model_lib.is_stacked(path) < 2:
      return leaf
    return jnp.asarray(np.asarray(leaf) + 0.05 * rng.normal(size=leaf.shape), jnp.float32)

  return cfg, latent, jax.tree_util.tree_map_with_path(perturb, params), model_lib.param_axes(cfg, latent)


@functools.cache
def _float_forward(kind: str):
  """(forward, reference): one jitted forward pass of float parameters on fixed random tokens (and latents), shared
  by the int8 and int4 logit checks so each kind compiles it once, and its logits for the float parameters."""
  cfg, latent, params, _ = _model(kind)
  lm = model_lib.LM(cfg, latent)
  tokens = jax.random.randint(jax.random.key(8), (2, 16), 0, cfg.vocab_size)
  z = None if latent is None else jax.random.normal(jax.random.key(9), model_lib.latent_shape(cfg, latent, 2))
  forward = jax.jit(lambda p: lm.apply({"params": p}, tokens, latents=z)[0])
  return forward, np.asarray(forward(params), np.float64)


def _expected_contraction(name: str, tied: bool):
  """Independently of the axis rule, by parameter name: which leaves are matmul weights and their contraction
  axes. Kernels [in..., out...]: `out` has two input axes (heads, head_dim); LoRA matrices are [in, out], as is the
  Titans memory's initial MLP, and its convolution taps are reduced over the taps, per channel; the tied
  embedding [vocab, embed] is the head, so it is reduced over embed (one scale per vocabulary row)."""
  shift = 1 if name.startswith(model_lib.SCANNED + "/") else 0
  last = name.split("/")[-1]
  if name.endswith("/out/kernel"):
    axes = (0, 1)
  elif last == "kernel" or last.endswith(("_down", "_up")):
    axes = (0,)
  elif last.startswith(("memory_", "conv_")):  # Titans: the initial memory [in, out]; conv taps [tap, heads, N].
    axes = (0,)
  elif name == "embed/embedding" and tied:
    axes = (1,)
  else:
    return None
  return tuple(a + shift for a in axes)


def _reference(w: np.ndarray, contract: tuple[int, ...]):
  """Plain float64 symmetric per-channel int8 quantiser: (values, scale)."""
  w = np.asarray(w, np.float64)
  absmax = np.max(np.abs(w), axis=contract, keepdims=True)
  scale = np.where(absmax > 0, absmax / 127, 1.0)
  return np.clip(np.round(w / scale), -127, 127), scale


def _check_against_reference(w, q: Int8Weight, contract: tuple[int, ...]):
  values, scale = _reference(w, contract)
  got_values, got_scale = np.asarray(q.values), np.asarray(q.scale, np.float64)
  assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
  assert got_values.shape == np.shape(w) and got_scale.shape == scale.shape
  np.testing.assert_allclose(got_scale, scale, rtol=1e-6)
  # The rounding bound, elementwise: |values * scale - W| <= scale / 2 (up to float32 rounding of the product).
  err = np.abs(got_values * got_scale - np.asarray(w, np.float64))
  assert np.all(err <= got_scale * (0.5 + 1e-5)), float(np.max(err / got_scale))
  # The same integers as the reference, except that float32 may round a ratio within 1e-3 of a half either way.
  ratio = np.asarray(w, np.float64) / scale
  near_half = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-3
  differs = got_values != values
  assert not np.any(differs & ~near_half) and np.all(np.abs(got_values - values) <= 1)
  # Every non-zero channel uses the full range: its largest weight maps to +-127.
  peak = np.max(np.abs(got_values), axis=contract, keepdims=True)
  assert np.all((peak == 127) | (scale == 1.0))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_leaf_is_quantised_or_deliberately_kept(kind):
  cfg, _, params, axes = _model(kind)
  tree = quantize_params(params, axes)
  plan = quantization_plan(params, axes)
  flat_params = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  flat_tree = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, Int8Weight))[0]}
  assert flat_tree.keys() == flat_params.keys() == plan.keys()
  expected = {name: _expected_contraction(name, cfg.tie_embeddings) for name in flat_params}
  assert plan == expected
  quantised = {name for name, leaf in flat_tree.items() if isinstance(leaf, Int8Weight)}
  assert quantised == {name for name, axes_ in expected.items() if axes_ is not None}
  assert ("embed/embedding" in quantised) == cfg.tie_embeddings
  assert ("head/kernel" in quantised) == (not cfg.tie_embeddings)
  for name, leaf in flat_tree.items():
    if name in quantised:
      _check_against_reference(flat_params[name], leaf, expected[name])
      if name.startswith(model_lib.SCANNED + "/"):  # One scale row per stacked layer.
        assert leaf.scale.shape[0] == flat_params[name].shape[0] == 2
    else:  # Norms, per-channel vectors and the untied (gathered) embedding stay float32 and untouched.
      assert leaf.dtype == jnp.float32 and leaf is flat_params[name]
  errors = quantization_error(params, tree)
  assert errors.keys() == quantised and max(errors.values()) <= ROUNDING + 1e-6


def _per_channel_relative_error(w, q: Int8Weight, contract):
  w = np.asarray(w, np.float64)
  err = np.max(np.abs(np.asarray(dequantize_params(q)) - w), axis=contract)
  return err / np.max(np.abs(w), axis=contract)


OUTLIER_CASES = {  # name: (shape, logical axes, contraction axes, the loud output channel)
    "ffn_up": ((48, 24), ("embed", "mlp"), (0,), (slice(None), 5)),
    "attention_out": ((4, 8, 24), ("heads", "head_dim", "embed"), (0, 1), (slice(None), slice(None), 5)),
    "attention_q": ((32, 4, 6), ("embed", "heads", "head_dim"), (0,), (slice(None), 2, 3)),
}


def test_an_outlier_channel_does_not_hurt_the_others():
  """One output channel 10^4 times larger: a per-tensor scale would round every other channel to 0 (relative error
  1), and a per-input-channel scale would too; per output channel, every channel keeps the rounding bound."""
  weights = {}
  for i, (name, (shape, _, _, channel)) in enumerate(OUTLIER_CASES.items()):
    weights[name] = np.array(jax.random.normal(jax.random.key(3 + i), shape), np.float32)
    weights[name][channel] *= 1e4
  tree = quantize_params({name: {"kernel": jnp.asarray(w)} for name, w in weights.items()},
                         {name: {"kernel": case[1]} for name, case in OUTLIER_CASES.items()})
  for name, (_, _, contract, _) in OUTLIER_CASES.items():
    q = tree[name]["kernel"]
    _check_against_reference(weights[name], q, contract)
    rel = _per_channel_relative_error(weights[name], q, contract)
    assert np.all(rel <= ROUNDING + 1e-6), (name, rel.max())
    assert np.all(np.max(np.abs(q.values), axis=contract) == 127), name


def test_tied_embedding_is_quantised_per_vocabulary_row():
  """Without a head, the table is the head: a huge row keeps its own scale and the gather reads exact-scale rows."""
  table = np.array(jax.random.normal(jax.random.key(4), (20, 16)), np.float32)
  table[7] *= 1e4
  table[3] = 0.0  # An all-zero row (an unused token): scale 1, values 0, no NaN.
  tree = quantize_params({"embed": {"embedding": jnp.asarray(table)}}, {"embed": {"embedding": ("vocab", "embed")}})
  q = tree["embed"]["embedding"]
  assert q.scale.shape == (20, 1)
  _check_against_reference(table, q, (1,))
  deq = np.asarray(dequantize_params(tree)["embed"]["embedding"])
  assert np.all(np.isfinite(deq)) and np.all(deq[3] == 0) and float(q.scale[3, 0]) == 1.0
  rows = np.delete(np.arange(20), 3)
  assert np.all(_per_channel_relative_error(table[rows], Int8Weight(q.values[rows], q.scale[rows]), (1,))
                <= ROUNDING + 1e-6)
  # With a head present, the same table is only gathered, so it stays float32.
  head = jnp.asarray(jax.random.normal(jax.random.key(5), (16, 20)))
  gathered = jnp.asarray(table)
  untied = quantize_params({"embed": {"embedding": gathered}, "head": {"kernel": head}},
                           {"embed": {"embedding": ("vocab", "embed")}, "head": {"kernel": ("embed", "vocab")}})
  assert untied["embed"]["embedding"] is gathered
  assert untied["head"]["kernel"].scale.shape == (1, 20)


def test_stacked_layers_keep_their_own_scales():
  w = np.array(jax.random.normal(jax.random.key(6), (3, 32, 16)), np.float32)
  w[1] *= 1e3  # A loud layer must not coarsen the other layers' grids.
  tree = quantize_params({"blocks": {"ffn": {"kernel": jnp.asarray(w)}}},
                         {"blocks": {"ffn": {"kernel": ("layers", "embed", "mlp")}}})
  q = tree["blocks"]["ffn"]["kernel"]
  assert q.scale.shape == (3, 1, 16)
  for layer in range(3):
    _check_against_reference(w[layer], Int8Weight(q.values[layer], q.scale[layer]), (0,))
  _check_against_reference(w, q, (1,))


def test_new_dense_layers_are_covered_and_unknown_ones_raise():
  rng = np.random.default_rng(7)
  params = {"new": {"proj": {"kernel": jnp.asarray(rng.normal(size=(8, 2, 4)), jnp.float32)},
                    "merge": {"kernel": jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)},
                    "gain": jnp.asarray(rng.normal(size=(8,)), jnp.float32)},
            "step": jnp.asarray(3, jnp.int32)}
  axes = {"new": {"proj": {"kernel": ("embed", "kv_heads", "head_dim")},
                  "merge": {"kernel": ("heads", "head_dim", "embed_out")}, "gain": ("norm",)}, "step": ()}
  plan = quantization_plan(params, axes)
  assert plan == {"new/proj/kernel": (0,), "new/merge/kernel": (0, 1), "new/gain": None, "step": None}
  bad_axes = [("embed", "mlp", "vocab"),  # Three features: no single input/output split.
              (),  # No logical axes at all.
              ("embed", None, "head_dim"),  # An unnamed axis.
              ("mlp", "layers", "embed")]  # A layer axis that is not leading.
  for bad in bad_axes:
    with pytest.raises(ValueError, match="cannot quantise new/odd"):
      quantize_params({"new": {"odd": jnp.ones((2, 3, 4))}}, {"new": {"odd": bad}})


@pytest.mark.parametrize("kind", ["rwkv4_attention_untied", "rwkv7_scanned_tied", "attention_latent_untied"])
def test_logits_from_dequantised_params_stay_close(kind):
  """On random tokens, logits from dequantised weights (inside jit) drift by < 4% of the float logits' standard
  deviation in RMS and < 25% at worst (measured over three token draws: RMS 1.0-2.2%, worst 4.3-18%). A control
  that moves every weight by independent uniform noise of the rounding size (+-scale/2) drifts as much: int8 costs
  no more than its step size, so a wrong scale or axis (distorting whole channels) shows up as a multiple of it."""
  _, _, params, axes = _model(kind)
  tree = quantize_params(params, axes)
  forward, reference = _float_forward(kind)
  rng = np.random.default_rng(10)
  control = jax.tree.map(
      lambda w, q: jnp.asarray(np.asarray(w) + rng.uniform(-0.5, 0.5, w.shape) * np.asarray(q.scale), jnp.float32)
      if isinstance(q, Int8Weight) else w, params, tree, is_leaf=lambda x: isinstance(x, Int8Weight))
  logits = np.asarray(forward(jax.jit(dequantize_params)(tree)), np.float64)
  rms = lambda d: float(np.sqrt(np.mean(d ** 2)))
  spread, drift = reference.std(), logits - reference
  control_drift = np.asarray(forward(control), np.float64) - reference
  assert np.all(np.isfinite(logits)) and spread > 0.1
  assert rms(drift) < 0.04 * spread, (rms(drift), spread)
  assert 0 < np.max(np.abs(drift)) < 0.25 * spread, (np.max(np.abs(drift)), spread)
  assert rms(drift) < 2 * rms(control_drift), (rms(drift), rms(control_drift))


def test_matmul_weights_take_about_a_quarter_of_the_bytes():
  _, _, params, axes = _model("rwkv7_scanned_tied")
  tree = quantize_params(params, axes)
  plan = quantization_plan(params, axes)
  leaves = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  matmul = {name: leaves[name] for name, axes_ in plan.items() if axes_ is not None}
  kept = {name: leaves[name] for name, axes_ in plan.items() if axes_ is None}
  assert param_bytes(params) == 4 * model_lib.count_params(params)
  saved = param_bytes(params) - param_bytes(tree)
  float_matmul = 4 * sum(w.size for w in matmul.values())
  int8_matmul = float_matmul - saved
  assert param_bytes(tree) == param_bytes(kept) + int8_matmul
  # 1 byte per weight plus a 4-byte scale per output channel (fan-in weights): 3.56x for fan-in 32, 3.88x for 128.
  fan_in = {name: np.prod([matmul[name].shape[a] for a in plan[name]]) for name in matmul}
  assert int8_matmul == sum(w.size + 4 * w.size // fan_in[name] for name, w in matmul.items())
  assert 3.5 < float_matmul / int8_matmul < 4


def test_dequantize_runs_under_jit_on_int8_inputs():
  _, _, params, axes = _model("rwkv4_attention_untied")
  tree = quantize_params(params, axes)
  eager = dequantize_params(tree)
  fn = jax.jit(dequantize_params, static_argnums=1)
  jitted = fn(tree, jnp.float32)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), eager, jitted)
  assert "xi8>" in fn.lower(tree, jnp.float32).as_text()  # The compiled function's inputs are int8 arrays.
  half = fn(tree, jnp.bfloat16)
  assert half["head"]["kernel"].dtype == jnp.bfloat16 and half["final_norm"]["scale"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(half["head"]["kernel"], np.float32), np.asarray(eager["head"]["kernel"]),
                             rtol=1e-2, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------- int4

GROUP = 8  # Divides every fan-in of the micro models (32, 64, the LoRA ranks, head_dim x heads) or exceeds it.
ROUNDING4 = 0.5 / 7  # The worst error relative to the group's max|W| of rounding to 15 symmetric levels.


def _reference_int4(w: np.ndarray, contract: tuple[int, ...], group: int, stacked: int):
  """Plain float64 group-wise int4: the weight as [layers..., K, N] cut into [layers..., K / g, g, N] groups, and
  (values, scale) in that layout, scale = max|group| / 7."""
  w = np.asarray(w, np.float64)
  order = tuple(range(stacked)) + contract + tuple(i for i in range(stacked, w.ndim) if i not in contract)
  lead = w.shape[:stacked]
  fan_in = int(np.prod([w.shape[i] for i in contract]))
  g = min(group, fan_in)
  blocks = np.transpose(w, order).reshape(*lead, fan_in // g, g, -1)
  absmax = np.max(np.abs(blocks), axis=-2, keepdims=True)
  scale = np.where(absmax > 0, absmax / 7, 1.0)
  return blocks, np.clip(np.round(blocks / scale), -7, 7), scale


def _unpack(packed) -> np.ndarray:
  """Nibbles written out plainly: byte i of a group holds input i (low) and input i + g/2 (high), two's complement."""
  p = np.asarray(packed).astype(np.int64) & 0xFF
  low, high = p & 0xF, p >> 4
  signed = lambda v: np.where(v >= 8, v - 16, v)
  return np.concatenate([signed(low), signed(high)], axis=-2)


def _check_int4(w, q: Int4Weight, contract, stacked: int):
  blocks, values, scale = _reference_int4(w, contract, GROUP, stacked)
  assert q.packed.dtype == jnp.int8 and q.scale.dtype == jnp.float32 and q.shape == np.shape(w)
  got_values, got_scale = _unpack(q.packed), np.asarray(q.scale, np.float64)[..., None, :]
  assert got_values.shape == values.shape and got_scale.shape == scale.shape
  np.testing.assert_allclose(got_scale, scale, rtol=1e-6)
  err = np.abs(got_values * got_scale - blocks)  # The rounding bound, elementwise: half a step.
  assert np.all(err <= got_scale * (0.5 + 1e-5)), float(np.max(err / got_scale))
  ratio = blocks / scale
  near_half = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-3
  assert not np.any((got_values != values) & ~near_half) and np.all(np.abs(got_values - values) <= 1)
  peak = np.max(np.abs(got_values), axis=-2, keepdims=True)  # Every non-zero group spans the full range.
  assert np.all((peak == 7) | (scale == 1.0))


def _undo_blocks(blocks: np.ndarray, q: Int4Weight) -> np.ndarray:
  """[layers..., G, g, N] back to the weight's own axis order."""
  permuted = tuple(q.shape[i] for i in q.perm)
  return np.transpose(blocks.reshape(permuted), np.argsort(q.perm))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_int4_quantises_the_same_leaves_in_groups_and_logits_stay_close(kind):
  """The same leaves as int8 (the one rule), each against the float64 group-wise reference, stacked layers kept
  apart, the worst group's error within the rounding bound; then the logits (see `_check_int4_logits`)."""
  cfg, _, params, axes = _model(kind)
  tree = quantize_params(params, axes, "int4", GROUP)
  flat_params = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  flat_tree = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, Int4Weight))[0]}
  expected = {name: _expected_contraction(name, cfg.tie_embeddings) for name in flat_params}
  quantised = {name for name, leaf in flat_tree.items() if isinstance(leaf, Int4Weight)}
  assert quantised == {name for name, axes_ in expected.items() if axes_ is not None}
  for name in quantised:
    stacked = 1 if name.startswith(model_lib.SCANNED + "/") else 0
    _check_int4(flat_params[name], flat_tree[name], expected[name], stacked)
  errors = quantization_error(params, tree)
  assert errors.keys() == quantised and max(errors.values()) <= ROUNDING4 + 1e-6
  assert has_quantized_weights(tree) and not has_int8_weights(tree)
  # dequantize_params (under jit, as the forward pass runs it) puts every value back in its own axis order.
  deq = jax.jit(dequantize_params)(tree)
  for name, leaf in flat_tree.items():
    got = np.asarray(functools.reduce(lambda t, k: t[k], name.split("/"), deq), np.float64)
    if name in quantised:
      stacked = 1 if name.startswith(model_lib.SCANNED + "/") else 0
      blocks, values, scale = _reference_int4(flat_params[name], expected[name], GROUP, stacked)
      assert np.max(np.abs(got - _undo_blocks(values * scale, leaf))) <= 1e-6 * np.max(np.abs(blocks)), name
    else:
      np.testing.assert_array_equal(got, np.asarray(flat_params[name]))
  _check_int4_logits(kind, params, tree, deq)


def test_int4_an_outlier_input_costs_only_its_group():
  """One input weight 10^4 times larger: per output channel, int4 would round every other weight of the channel to 0
  (relative error 1 against their own scale); in groups of 8, only its group coarsens and every other group keeps
  the rounding bound against its own max|W|."""
  w = np.array(jax.random.normal(jax.random.key(11), (4, 8, 24)), np.float32)  # `out`: [heads, head_dim, embed]
  w[1, 2, 5] *= 1e4
  q = quantize_params({"out": {"kernel": jnp.asarray(w)}}, {"out": {"kernel": ("heads", "head_dim", "embed")}},
                      "int4", GROUP)["out"]["kernel"]
  _check_int4(w, q, (0, 1), 0)
  blocks = w.reshape(4, GROUP, 24).astype(np.float64)  # Fan-in heads x head_dim = 32: group g is head g.
  deq = np.asarray(dequantize_params({"w": q})["w"], np.float64).reshape(4, GROUP, 24)
  rel = np.max(np.abs(deq - blocks), axis=1) / np.max(np.abs(blocks), axis=1)  # [groups, channels]
  loud = np.zeros_like(rel, bool)
  loud[1, 5] = True  # Input 1 * 8 + 2 = 10 lies in group 1.
  assert np.all(rel[~loud] <= ROUNDING4 + 1e-6)
  others = np.delete(blocks[:, :, 5].reshape(-1), 10)
  assert np.max(np.abs(others)) < 0.5 / 7 * np.max(np.abs(blocks[:, :, 5]))  # One scale per channel: all round to 0.


def test_int4_bad_group_sizes_are_refused_with_the_weight_named():
  params = {"ffn": {"kernel": jnp.ones((48, 16))}}
  axes = {"ffn": {"kernel": ("embed", "mlp")}}
  with pytest.raises(ValueError, match="cannot quantise ffn/kernel to int4 with group size 32: its fan-in 48"):
    quantize_params(params, axes, "int4", 32)
  for bad in (3, 0, 2.0):
    with pytest.raises(ValueError, match="group size must be an even int"):
      quantize_params(params, axes, "int4", bad)
  with pytest.raises(ValueError, match="unknown quantization 'int3'; choose from int8, int4"):
    quantize_params(params, axes, "int3")
  q = quantize_params(params, axes, "int4", 64)["ffn"]["kernel"]  # Longer than the fan-in: one group.
  assert q.scale.shape == (1, 16) and q.packed.shape == (1, 24, 16)


def test_keep_int8_stores_the_named_weights_as_int8_and_the_rest_as_int4():
  """keep_int8=("head", "v"): the head and attention's value projection are int8 per output channel, every other
  matmul weight int4 in groups, each against its float64 reference; the kept weights are exactly those with a path
  component of a given name (RWKV-4's "value" is not "v"); the model reads the mixed tree as stored as it reads it
  dequantised."""
  cfg, latent, params, axes = _model("rwkv4_attention_untied")
  tree = quantize_params(params, axes, "int4", GROUP, keep_int8=("head", "v"))
  flat = dict((_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0])
  quantized = dict((_name(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, (Int8Weight, Int4Weight)))[0])
  eights = sorted(name for name, leaf in quantized.items() if isinstance(leaf, Int8Weight))
  assert eights == ["block_1/mixer/v/kernel", "head/kernel"]
  fours = [name for name, leaf in quantized.items() if isinstance(leaf, Int4Weight)]
  assert "block_0/mixer/value/kernel" in fours and len(fours) > 8
  for name in eights:
    _check_against_reference(flat[name], quantized[name], _expected_contraction(name, tied=False))
  for name in fours:
    _check_int4(flat[name], quantized[name], _expected_contraction(name, tied=False), 0)
  assert param_bytes(quantize_params(params, axes, "int4", GROUP)) < param_bytes(tree)
  # The mixed tree's kernels multiplied as stored give the logits of its weights dequantised ahead (1e-5 of spread).
  tokens = jax.random.randint(jax.random.key(8), (2, 16), 0, cfg.vocab_size)
  forward = jax.jit(lambda t, keep: model_lib.LM(cfg, latent).apply(
      {"params": dequantize_params(t, jnp.float32, keep)}, tokens)[0], static_argnums=1)
  stored, ahead = (np.asarray(forward(tree, keep), np.float64) for keep in (("int8", "int4"), ()))
  np.testing.assert_allclose(stored, ahead, rtol=0, atol=1e-5 * ahead.std())


def test_keep_int8_refuses_names_that_match_nothing_and_int8():
  params = {"ffn": {"up": {"kernel": jnp.ones((16, 8))}}, "head": {"kernel": jnp.ones((8, 32))}}
  axes = {"ffn": {"up": {"kernel": ("embed", "mlp")}}, "head": {"kernel": ("embed", "vocab")}}
  with pytest.raises(ValueError, match=r"^keep_int8 name 'out' matches no quantised weight; names: ffn, head, up$"):
    quantize_params(params, axes, "int4", 8, keep_int8=("head", "out"))
  with pytest.raises(ValueError, match="keep_int8 keeps some int4 weights at int8; it does not apply to int8"):
    quantize_params(params, axes, "int8", keep_int8=("head",))
  tree = quantize_params(params, axes, "int4", 8, keep_int8="head")  # One name as a string.
  assert isinstance(tree["head"]["kernel"], Int8Weight) and isinstance(tree["ffn"]["up"]["kernel"], Int4Weight)


def _check_int4_logits(kind, params, tree, dequantized):
  """Logits from int4 weights (groups of 8; `dequantized`: the tree's dequantize_params) against float logits, on
  random tokens: RMS drift < 35% of the float logits' standard deviation (measured 14-27%; 16 levels on a tiny
  random model) and no more than 1.5x a control that moves every weight by independent uniform noise of its rounding
  size (+-scale/2; measured ratio 0.92-1.06): a wrong group, scale or nibble order would distort whole channels, many
  times the step size. All three run through one compiled forward pass of float parameters."""
  forward, reference = _float_forward(kind)
  rng = np.random.default_rng(14)

  scales = jax.tree.map(lambda w, q: _undo_blocks(np.broadcast_to(np.asarray(q.scale, np.float64)[..., None, :],
                                                                  _unpack(q.packed).shape), q)
                        if isinstance(q, Int4Weight) else None, params, tree,
                        is_leaf=lambda x: isinstance(x, Int4Weight))
  control = jax.tree.map(lambda w, s: w if s is None else jnp.asarray(
      np.asarray(w) + rng.uniform(-0.5, 0.5, w.shape) * s, jnp.float32), params, scales,
      is_leaf=lambda x: x is None)
  logits, control_logits = (np.asarray(forward(t), np.float64) for t in (dequantized, control))
  rms = lambda d: float(np.sqrt(np.mean(d ** 2)))
  spread, drift = reference.std(), rms(logits - reference)
  assert np.all(np.isfinite(logits)) and spread > 0.1
  assert drift < 0.35 * spread, (drift, spread)
  assert drift < 1.5 * rms(control_logits - reference), (drift, rms(control_logits - reference))


def test_int4_takes_about_an_eighth_of_the_bytes():
  """Half a byte per weight plus a 4-byte scale per group of g inputs: 4 / (0.5 + 4 / g) times fewer than float32."""
  w = jnp.asarray(np.random.default_rng(15).normal(size=(256, 64)), jnp.float32)
  for group in (32, 128):
    q = quantize_params({"k": w}, {"k": ("embed", "mlp")}, "int4", group)["k"]
    assert param_bytes(q) == 256 * 64 // 2 + 4 * (256 // group) * 64
  assert param_bytes(quantize_params({"k": w}, {"k": ("embed", "mlp")}, "int4", 128)) * 7.5 < param_bytes(w)


def test_fake_quantisation_rounds_forward_and_passes_gradients_straight_through():
  """QAT's view of the weights: the forward value is exactly what quantize_params + dequantize_params give (int8 and
  int4), non-matmul leaves pass through, and the gradient of sum(c * W_fake) is c (straight through the rounding)."""
  rng = np.random.default_rng(16)
  params = {"ffn": {"kernel": jnp.asarray(rng.normal(size=(2, 32, 16)), jnp.float32)},
            "norm": {"scale": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}}
  axes = {"ffn": {"kernel": ("layers", "embed", "mlp")}, "norm": {"scale": ("norm",)}}
  cotangent = jnp.asarray(rng.normal(size=(2, 32, 16)), jnp.float32)
  for kind in ("int8", "int4"):
    fake = lambda p, kind=kind: fake_quantize_params(p, axes, kind, 8)
    loss = lambda p, fake=fake: jnp.sum(cotangent * fake(p)["ffn"]["kernel"])
    (value, got), grad = jax.jit(lambda p: (jax.value_and_grad(loss)(p)[0], fake(p)))(params), jax.jit(
        jax.grad(loss))(params)
    expected = dequantize_params(quantize_params(params, axes, kind, 8))
    np.testing.assert_array_equal(np.asarray(got["ffn"]["kernel"]), np.asarray(expected["ffn"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(got["norm"]["scale"]), np.asarray(params["norm"]["scale"]))
    assert not np.array_equal(np.asarray(got["ffn"]["kernel"]), np.asarray(params["ffn"]["kernel"]))
    np.testing.assert_allclose(float(value), float(jnp.sum(cotangent * expected["ffn"]["kernel"])), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(grad["ffn"]["kernel"]), np.asarray(cotangent))
    np.testing.assert_array_equal(np.asarray(grad["norm"]["scale"]), 0.0)


# -------------------------------------------------------------------------------- kernels read as they are stored

# Each kind once, the kinds split between int8 and int4 so that both formats meet multi-axis kernels, an untied
# head, scanned slices (rwkv7_scanned_tied) and Titans' projections; the op reads both formats alike (test_quant_matmul).
STORED_CASES = [("rwkv4_attention_untied", "int8"), ("attention_latent_untied", "int4"),
                ("rwkv7_scanned_tied", "int4"), ("titans_untied", "int8")]


@pytest.mark.parametrize("kind, quant", STORED_CASES)
def test_kernels_multiplied_as_stored_give_the_logits_of_their_dequantised_values(kind, quant):
  """Every layer whose kernel stays quantised (`keep_kernels`: q/k/v/out, RWKV projections, the FFNs, Titans' and
  the untied head, stacked or not) multiplies it through the quantised matmul, scales after the product. Its logits
  equal those of the same weights dequantised ahead, to float32 rounding (1e-5 of their spread): the layouts of the
  stored values (the kernels' multi-axis inputs and outputs, a scanned layer's slice, int4's nibble halves) are read
  as `dequantize` reads them."""
  cfg, latent, params, axes = _model(kind)
  tree = quantize_params(params, axes, quant, GROUP)
  tokens = jax.random.randint(jax.random.key(8), (2, 16), 0, cfg.vocab_size)
  z = None if latent is None else jax.random.normal(jax.random.key(9), model_lib.latent_shape(cfg, latent, 2))
  lm = model_lib.LM(cfg, latent)
  forward = jax.jit(lambda t, keep: lm.apply({"params": dequantize_params(t, jnp.float32, keep)}, tokens,
                                             latents=z)[0], static_argnums=1)
  stored, ahead = (np.asarray(forward(tree, keep), np.float64) for keep in ((quant,), ()))
  kept = [path for path, leaf in jax.tree_util.tree_flatten_with_path(
      dequantize_params(tree, jnp.float32, (quant,)), is_leaf=quantize_lib.is_quantized)[0]
          if quantize_lib.is_quantized(leaf)]
  assert len(kept) >= 4 and all(_name(path).endswith("kernel") for path in kept)
  np.testing.assert_allclose(stored, ahead, rtol=0, atol=1e-5 * ahead.std())


@pytest.mark.parametrize("quant, group", [("int8", None), ("int4", 32)])
def test_decoding_with_kernels_read_as_stored_runs_the_kernel_and_holds_no_float_copy(quant, group, monkeypatch):
  """`generate.decode(kernels_as_stored=(quant,))` (the GPU's default, `kernels_read_quantized`) multiplies a scanned
  model's kernels as stored through the quantised-matmul kernel that the GPU runs (`impl="auto"` resolves to the
  Pallas kernel here as on a GPU, interpreted on a CPU; int4 group 32 gives 16-row packed halves, a shape it takes):
  the kernel is traced for int8 and for packed int4 weights, the compiled decoding program computes no float32 array
  of a stacked kernel's shape, and the prefill logits and greedy tokens equal those of the same weights dequantised
  ahead (CPU's default, where the XLA reference does the products): the control."""
  from ltm_jax.inference import generate  # pylint: disable=g-import-not-at-top
  from ltm_jax.ops import quant_matmul as quant_matmul_lib  # pylint: disable=g-import-not-at-top
  cfg, latent, params, axes = _model("rwkv7_scanned_tied")
  assert quantize_lib.kernels_read_quantized("gpu") == ("int8", "int4")
  assert quantize_lib.kernels_read_quantized("cpu") == ()
  traced = []  # (packed, K, N) of each trace of the Pallas kernel.
  kernel = quant_matmul_lib._BACKENDS["pallas"]  # pylint: disable=protected-access

  def counted(x, values, scale, packed):
    traced.append((packed, x.shape[-1], values.shape[-1]))
    return kernel(x, values, scale, packed=packed)

  monkeypatch.setitem(quant_matmul_lib._BACKENDS, "pallas", counted)  # pylint: disable=protected-access
  monkeypatch.setattr(quant_matmul_lib, "AUTO", {**quant_matmul_lib.AUTO, "cpu": "pallas"})
  tree = quantize_params(params, axes, quant, *(() if group is None else (group,)))
  weight = Int8Weight if quant == "int8" else Int4Weight
  shape = lambda leaf: leaf.values.shape if isinstance(leaf, Int8Weight) else leaf.shape  # Int4: the original shape.
  stacked = {f"f32[{','.join(map(str, shape(leaf)))}]" for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, weight))[0]
             if isinstance(leaf, weight) and model_lib.is_stacked(path) and _name(path).endswith("kernel")}
  assert stacked
  lm = model_lib.LM(cfg, latent, cache_capacity=24)
  tokens, lengths = generate.left_pad([[3, 5, 7, 2], [4, 1]])
  programs, outputs, logits = [], [], []
  for keep in ((quant,), ()):
    traced.clear()
    decoding = generate.prefill(lm, tree, tokens, lengths, kernels_as_stored=keep)
    logits.append(np.asarray(decoding.logits, np.float64))
    compiled = generate.decode.lower(lm, tree, decoding, jax.random.key(0), steps=6, temperature=0.0,
                                     kernels_as_stored=keep).compile()
    programs.append(compiled.as_text())
    outputs.append(np.asarray(compiled(tree, decoding, jax.random.key(0), temperature=0.0)[0]))
    if keep:
      assert traced and all(packed == (quant == "int4") for packed, _, _ in traced), traced
    else:
      assert not traced  # The control multiplies float weights: no quantised matmul at all.
  # An instruction computing a float32 array of a stacked kernel's shape from a kernel's values (the RWKV-7 LoRAs,
  # which are not "kernel" leaves, are dequantised ahead and may share the shape).
  dequantised = lambda hlo: [line for line in hlo.splitlines()
                             if any(f"= {shape}" in line for shape in stacked) and "kernel" in line.split("=", 1)[1]]
  as_stored, control = programs
  assert not dequantised(as_stored)
  assert dequantised(control)
  spread = logits[1].max() - logits[1].min()
  np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-5 * spread)
  np.testing.assert_array_equal(outputs[0], outputs[1])
