"""RWKV-7 (x070) time-mix and channel-mix against a float64 numpy statement of the official definition written out
below token by token, segment-wise calls with carried state, and the official initialisation schedule."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.layers.rwkv4 import ChannelMixState
from ltm_jax.config import ModelConfig
from ltm_jax.layers.rwkv7 import ChannelMix7, TimeMix7, TimeMix7State

B, T, C, N = 2, 13, 32, 8  # Four heads of 8; T is odd so chunked backends see a ragged last chunk.
LORA = dict(decay_lora=8, iclr_lora=8, value_lora=4, gate_lora=12)
# float32 layer vs float64 reference: a few dozen terms per output through two normalisations; measured ~2e-6.
F32_ATOL = 2e-5


def _sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _time_mix_reference(p, x, x_prev, wkv, v_first, first):
  """x070 time-mix in float64, one token at a time, with the official names: x [T, C] of one sequence,
  x_prev [C], wkv [H, N, N]; returns (y [T, C], last x [C], wkv, v_first [T, C])."""
  x, x_prev, wkv = (np.asarray(a, np.float64) for a in (x, x_prev, wkv))
  heads = C // N
  out, vs = np.zeros_like(x), np.zeros_like(x)
  for t in range(x.shape[0]):
    xx = x_prev - x[t]
    xr, xw, xk, xv, xa, xg = (x[t] + xx * p[name] for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r, k, v = xr @ p["receptance"], xk @ p["key"], xv @ p["value"]
    w = np.tanh(xw @ p["w1"]) @ p["w2"]
    a = _sigmoid(p["a0"] + (xa @ p["a1"]) @ p["a2"])
    g = _sigmoid(xg @ p["g1"]) @ p["g2"]
    kk = (k * p["k_k"]).reshape(heads, N)
    kk = (kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)).reshape(C)
    k = k * (1 + (a - 1) * p["k_a"])
    if first:
      vs[t] = v
    else:
      v = v + (v_first[t] - v) * _sigmoid(p["v0"] + (xv @ p["v1"]) @ p["v2"])
      vs[t] = v_first[t]
    decay = np.exp(-math.exp(-0.5) * _sigmoid(p["w0"] + w))
    vk = v.reshape(heads, N, 1) @ k.reshape(heads, 1, N)
    ab = (-kk).reshape(heads, N, 1) @ (kk * a).reshape(heads, 1, N)
    wkv = wkv * decay.reshape(heads, 1, N) + wkv @ ab + vk
    y = (wkv @ r.reshape(heads, N, 1)).reshape(heads, N)
    y = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 64e-5)
    y = y.reshape(C) * p["ln_x_w"] + p["ln_x_b"]
    y = y + ((r * k * p["r_k"].reshape(C)).reshape(heads, N).sum(-1, keepdims=True) * v.reshape(heads, N)).reshape(C)
    out[t] = (y * g) @ p["output"]
    x_prev = x[t]
  return out, x_prev, wkv, vs


def _official_names(params):
  """Our parameter tree in float64 under the names the reference uses."""
  q = {k: np.asarray(v, np.float64) for k, v in params.items() if not isinstance(v, dict)}
  kernel = lambda name: np.asarray(params[name]["kernel"], np.float64)
  p = {f"x_{c}": q[f"shift_{c}"] for c in "rwkvag"}
  p.update(receptance=kernel("receptance"), key=kernel("key"), value=kernel("value"), output=kernel("output"),
           w0=q["decay_base"], w1=q["decay_down"], w2=q["decay_up"], a0=q["iclr_base"], a1=q["iclr_down"],
           a2=q["iclr_up"], g1=q["gate_down"], g2=q["gate_up"], k_k=q["key_norm_scale"], k_a=q["key_iclr_mix"],
           r_k=q["bonus"], ln_x_w=q["out_norm_scale"], ln_x_b=q["out_norm_bias"])
  if "value_residual_base" in q:
    p.update(v0=q["value_residual_base"], v1=q["value_residual_down"], v2=q["value_residual_up"])
  return p


def _random_params(module, x, *args, seed=0):
  """Random parameters of the module's shapes at their natural scales (no initialiser runs: orthogonal
  initialisers compile a QR per shape, seconds each on CPU), so zero-initialised projections (output, LoRA down) and
  constant vectors all take part in the comparison."""
  shapes = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), x, *args)["params"])
  rng = np.random.default_rng(seed)

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    if "shift_" in name:
      return jnp.asarray(rng.uniform(0, 1, x.shape), jnp.float32)
    if x.ndim == 2:
      return jnp.asarray(rng.normal(0, 1 / math.sqrt(x.shape[0]), x.shape), jnp.float32)
    return jnp.asarray(rng.normal(0, 1, x.shape), jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _random_state(seed):
  rng = np.random.default_rng(seed)
  return TimeMix7State(jnp.asarray(rng.normal(0, 0.5, (B, C // N, N, N)), jnp.float32),
                       jnp.asarray(rng.normal(0, 1, (B, C)), jnp.float32))


def _layer(first, impl="scan", **kw):
  return TimeMix7(layer=0 if first else 1, n_layers=3, head_size=N, first=first, impl=impl, **LORA, **kw)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("impl", ["scan", "chunked"])
def test_time_mix_matches_float64_reference(first, impl):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  v_first = None if first else jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  state = _random_state(2)
  layer = _layer(first, impl)
  params = _random_params(layer, x, state, v_first)
  y, new_state, v_out = layer.apply({"params": params}, x, state, v_first)
  p = _official_names(params)
  for i in range(B):
    ref_y, ref_last, ref_wkv, ref_v = _time_mix_reference(p, x[i], state.last_x[i], state.wkv[i],
                                                          None if first else np.asarray(v_first[i]), first)
    scale = np.abs(ref_y).max()
    assert scale > 0.1  # The output is not trivially small.
    np.testing.assert_allclose(y[i], ref_y, atol=F32_ATOL * scale, rtol=0)
    np.testing.assert_allclose(new_state.wkv[i], ref_wkv, atol=F32_ATOL * np.abs(ref_wkv).max(), rtol=0)
    np.testing.assert_array_equal(new_state.last_x[i], ref_last.astype(np.float32))
    np.testing.assert_allclose(v_out[i], ref_v, atol=F32_ATOL * np.abs(ref_v).max(), rtol=0)


def test_later_layer_uses_v_first_and_requires_it():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  v1, v2 = (jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32) for _ in range(2))
  layer = _layer(first=False)
  params = _random_params(layer, x, None, v1)
  y1, _, _ = layer.apply({"params": params}, x, None, v1)
  y2, _, _ = layer.apply({"params": params}, x, None, v2)
  assert not np.allclose(y1, y2)
  with pytest.raises(ValueError, match="v_first"):
    layer.apply({"params": params}, x)
  assert "value_residual_base" not in _random_params(_layer(first=True), x)  # Official layer 0 has them, unused.
  assert params["gate_up"].shape == (LORA["gate_lora"], C) and params["value_residual_down"].shape == (C, 4)


def test_channel_mix_matches_float64_reference():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  state = ChannelMixState(jnp.asarray(rng.normal(0, 1, (B, C)), jnp.float32))
  ffn = ChannelMix7(layer=1, n_layers=3, hidden=4 * C)
  params = _random_params(ffn, x, state)
  y, new_state = ffn.apply({"params": params}, x, state)
  xs, prev = np.asarray(x, np.float64), np.asarray(state.last_x, np.float64)
  shifted = np.concatenate([prev[:, None], xs[:, :-1]], axis=1)
  xk = xs + (shifted - xs) * np.asarray(params["shift_k"], np.float64)
  expected = np.maximum(xk @ np.asarray(params["key"]["kernel"], np.float64), 0) ** 2 @ np.asarray(
      params["value"]["kernel"], np.float64)
  np.testing.assert_allclose(y, expected, atol=F32_ATOL * np.abs(expected).max(), rtol=0)
  np.testing.assert_array_equal(new_state.last_x, x[:, -1])


def test_segments_with_carried_state_equal_one_call(impl="chunked"):  # Backend-level segmenting: tests/ops.
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  v_first = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  layer, ffn = _layer(first=False, impl=impl), ChannelMix7(layer=1, n_layers=3, hidden=64)
  params = _random_params(layer, x, None, v_first)
  ffn_params = _random_params(ffn, x, seed=1)
  whole, whole_state, _ = layer.apply({"params": params}, x, None, v_first)
  whole_ffn, whole_ffn_state = ffn.apply({"params": ffn_params}, x)
  state, ffn_state, pieces, ffn_pieces = None, None, [], []
  for start, stop in [(0, 5), (5, 6), (6, 13)]:  # Includes a one-token step, as decoding does.
    y, state, _ = layer.apply({"params": params}, x[:, start:stop], state, v_first[:, start:stop])
    h, ffn_state = ffn.apply({"params": ffn_params}, x[:, start:stop], ffn_state)
    pieces.append(y)
    ffn_pieces.append(h)
  np.testing.assert_allclose(np.concatenate(pieces, 1), whole, atol=F32_ATOL * np.abs(whole).max(), rtol=0)
  np.testing.assert_allclose(state.wkv, whole_state.wkv, atol=F32_ATOL * np.abs(whole_state.wkv).max(), rtol=0)
  np.testing.assert_array_equal(state.last_x, whole_state.last_x)
  np.testing.assert_allclose(np.concatenate(ffn_pieces, 1), whole_ffn, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(ffn_state.last_x, whole_ffn_state.last_x)


def test_bfloat16_compute_is_close_to_float32():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  params = _random_params(_layer(first=True), x)
  full, full_state, _ = _layer(first=True).apply({"params": params}, x)
  low, low_state, v = _layer(first=True, dtype="bfloat16").apply({"params": params}, x)
  assert low.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16 and low_state.wkv.dtype == jnp.float32
  # bfloat16 keeps 8 mantissa bits; errors of a few units in the last place through two projections.
  np.testing.assert_allclose(np.asarray(low, np.float32), full, atol=0.05 * np.abs(full).max(), rtol=0)


def test_initialisation_follows_the_official_schedule():
  x = jnp.zeros((1, 3, C), jnp.float32)
  lora = dict(decay_lora=8, iclr_lora=8, value_lora=8, gate_lora=8)  # One shape: one QR to compile.
  layer = TimeMix7(layer=1, n_layers=4, head_size=N, first=False, **lora)
  p = jax.tree.map(np.asarray, nn.meta.unbox(layer.init(jax.random.key(0), x, None, x)["params"]))
  i = np.arange(C)
  np.testing.assert_allclose(p["shift_r"], 1 - (i / C) ** (0.2 * 0.75), rtol=1e-6)
  np.testing.assert_allclose(p["shift_w"], 1 - (i / C) ** (0.9 * 0.75), rtol=1e-6)
  zig = ((i % N) - (N - 1) / 2) / ((N - 1) / 2)
  zig = zig * np.abs(zig)
  np.testing.assert_allclose(p["decay_base"], -6 + 6 * (i / (C - 1)) ** (1 + (1 / 3) ** 0.3) + 0.5 + 2.5 * zig,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(p["bonus"], np.full(C, -0.04))
  np.testing.assert_allclose(p["key_iclr_mix"], np.full(C, 1.02))
  for zero in ("decay_down", "iclr_down", "value_residual_down", "gate_down"):
    assert p[zero].shape[0] == C and not p[zero].any()
  assert not p["output"]["kernel"].any()
  np.testing.assert_allclose(p["decay_up"] @ p["decay_up"].T, 0.01 * np.eye(8), atol=1e-6)
  assert np.abs(p["key"]["kernel"]).max() <= 0.05 / math.sqrt(C)
  # The official suggested LoRA widths of RWKV-7 0.1B (C = 768): 64, 64, 32, 128.
  assert ModelConfig(d_model=768).rwkv7_lora_dims() == {"decay": 64, "iclr": 64, "value": 32, "gate": 128}


def test_the_decay_bound_holds_and_lets_every_chunked_kernel_run_unchecked(monkeypatch, dtype="bfloat16"):
  """The log-decays the layer hands WKV-7 stay above the w_min it declares, even with the decay's pre-activation far
  past saturation (a decay_base of +40: sigmoid rounds to 1), in bfloat16 compute (w itself is float32 in every
  dtype); and that bound lies
  within the exact range of every chunked kernel (Triton chunks of 16 and 32, Mosaic GPU chunks of 64), so none of
  them reads w to check it at run time."""
  from ltm_jax.layers import rwkv7 as rwkv7_layer  # pylint: disable=g-import-not-at-top
  from ltm_pallas import wkv7_chunked, wkv7_mgpu  # pylint: disable=g-import-not-at-top
  original, seen = rwkv7_layer.wkv7, []

  def spy(r, w, k, v, a, b, state, *, impl, w_min):
    seen.append((float(jnp.min(w)), w_min))
    return original(r, w, k, v, a, b, state, impl="scan")

  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), dtype)
  layer = _layer(True, dtype=dtype)
  params = _random_params(layer, x, _random_state(4), None)
  params["decay_base"] = jnp.full_like(params["decay_base"], 40.0)
  monkeypatch.setattr(rwkv7_layer, "wkv7", spy)
  layer.apply({"params": params}, x, _random_state(4), None)
  (smallest, bound), = seen
  assert bound == rwkv7_layer.LOG_DECAY_BOUND and smallest >= bound
  assert smallest < -0.6  # Saturated: the strongest decay the layer can produce.
  assert wkv7_mgpu.bounded(bound) and wkv7_chunked.bounded(bound, 16) and wkv7_chunked.bounded(bound, 32)
  assert not wkv7_mgpu.bounded(-1.0)  # The range check itself still refuses a bound the kernels cannot take.
