"""RWKV-7 ("Goose", x070) time-mix and channel-mix, each carrying its state.

The time-mix follows the official x070 definition: a token shift with six per-channel mixes, projections r, k, v, a
low-rank decay w (tanh), in-context learning rate a (sigmoid), value-residual gate (sigmoid) and output gate g, the
normalised key kk with the delta rule's a = -kk and b = kk * a, WKV-7, a per-head group norm, the r.k bonus and the
output gate. Parameter names describe what they do; `ltm_jax/convert/rwkv.py` maps them to the official names
(x_r.. -> shift_r.., w0/w1/w2 -> decay_base/decay_down/decay_up, a* -> iclr_*, v* -> value_residual_*, g1/g2 ->
gate_down/gate_up, k_k -> key_norm_scale, k_a -> key_iclr_mix, r_k -> bonus, ln_x -> out_norm).

Value residual: the first RWKV-7 layer of the stack returns its values `v_first` [B, T, C]; every later RWKV-7
layer mixes them into its own values through a learned gate, so the caller threads v_first from block to block.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.layers.common import (
  Dense,
  depth_ratios,
  plain_kernels,
  projection_dot_general,
  shift_inputs,
  token_shift,
)
from ltm_jax.layers.rwkv4 import ChannelMixState
from ltm_jax.ops.add_norm import normalize
from ltm_jax.ops.ffn import ffn
from ltm_jax.ops.norm_mix import norm_mix
from ltm_jax.ops.rwkv7_key import rwkv7_key
from ltm_jax.ops.rwkv7_out import rwkv7_out
from ltm_jax.ops.wkv7 import empty_state as wkv7_empty_state
from ltm_jax.ops.wkv7 import wkv7

# Official x070 constants. The decay is e^w with w = -e^{-1/2} sigmoid(.), so every step keeps between
# e^{-0.61} = 0.545 and 1 of the state; the group norm of the WKV output uses eps = 64e-5 (not the usual 1e-5).
MAX_LOG_DECAY = math.exp(-0.5)
# A bound on every log-decay the layer passes WKV-7 (its w_min): room for any float dtype's rounding of -e^{-1/2}
# (bfloat16: -0.609), and within every chunked kernel's exact range (the Mosaic GPU kernels' chunks of 64 take
# w >= -0.9375), so that none of them reads w to check it at run time.
LOG_DECAY_BOUND = -0.75
GROUP_NORM_EPS = 64e-5
NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's floor on the key norm.


class TimeMix7State(NamedTuple):
  """wkv: [B, H, N, N] float32 (S[i, j], i = value index, j = key index); last_x: [B, d_model] float32, the last
  input token (for the token shift)."""
  wkv: jax.Array
  last_x: jax.Array

  @classmethod
  def empty(cls, batch: int, d_model: int, head_size: int) -> TimeMix7State:
    return cls(wkv7_empty_state(batch, d_model // head_size, head_size), jnp.zeros((batch, d_model), jnp.float32))


def _constant_init(values: np.ndarray, axes: tuple[str, ...]):
  def init(key, shape, dtype=jnp.float32):
    del key
    assert tuple(shape) == values.shape, (shape, values.shape)
    return jnp.asarray(values, dtype)
  return nn.with_logical_partitioning(init, axes)


def _shift_fraction(d: int, power: float) -> np.ndarray:
  """1 - (i / C) ** power: how much of the previous token channel i takes (early channels lean on the past)."""
  return 1.0 - (np.arange(d) / d) ** power


def _centered_uniform(bound: float, axes: tuple[str, ...]):
  """U(-bound, bound) annotated with logical axes (flax's uniform starts at 0)."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return nn.with_logical_partitioning(init, axes)


def _projection(features: int, init, dtype, name: str, fp8: bool) -> Dense:
  """A bias-free projection of the last axis; `init` carries the logical axes (the official inits are uniform or
  zero, not the normal of common.dense); with `fp8` it multiplies in FP8."""
  return Dense(features, use_bias=False, dtype=dtype, param_dtype=jnp.float32, kernel_init=init,
               dot_general=projection_dot_general(fp8), name=name)


class TimeMix7(nn.Module):
  """x [B, T, d_model] -> (y [B, T, d_model], new state, v_first [B, T, d_model]); heads of `head_size` channels.
  The low-rank widths come from ModelConfig.rwkv7_lora_dims() in the model (the official suggestions by default).

  `first`: this is the first RWKV-7 layer of the stack, which produces v_first (the `v_first` argument is ignored);
  later layers need the first layer's v_first.

  With `norm_kind` set, x is the residual stream and the call's `norm` = (scale, bias) are the parameters of the norm
  before the layer (bias None for rmsnorm): the layer normalises x itself, with its token-shift mixes, as one op
  (`ltm_jax.ops.norm_mix`), the same values as normalising before the call, and returns the stream as a fourth
  output for the block's residual add (the same values; its gradient then joins the op's backward).
  """
  layer: int
  n_layers: int
  head_size: int = 64
  decay_lora: int = 32
  iclr_lora: int = 32
  value_lora: int = 32
  gate_lora: int = 32
  first: bool = True
  impl: str = "auto"
  out_impl: str = "auto"  # The output stage's backend (ltm_jax.ops.rwkv7_out): group norm, bonus and gate.
  key_impl: str = "auto"  # The key side's backend (ltm_jax.ops.rwkv7_key): key norm, delta-rule keys, bonus sums.
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.
  norm_kind: str | None = None  # "layernorm" or "rmsnorm": x is the stream, normalised here (see above).
  norm_eps: float = 1e-5
  norm_impl: str = "auto"  # The ltm_jax.ops.norm_mix backend.

  @nn.compact
  def __call__(self, x, state: TimeMix7State | None = None, v_first=None, valid=None, norm=None):
    """`valid` [B, T] bool (None: all valid) marks left padding, which leaves the state as it was."""
    batch, length, d = x.shape
    n = self.head_size
    if d % n:
      raise ValueError(f"TimeMix7: d_model={d} is not a multiple of head_size={n}")
    heads = d // n
    if state is None:
      state = TimeMix7State.empty(batch, d, n)
    if not self.first and v_first is None:
      raise ValueError("TimeMix7: a layer after the first RWKV-7 layer needs the first layer's v_first")
    up, down = depth_ratios(self.layer, self.n_layers)
    channel = np.arange(d)
    linear = channel / max(d - 1, 1) - 0.5  # -0.5 .. 0.5 across channels.
    zigzag = ((channel % n) - (n - 1) / 2) / max((n - 1) / 2, 1)
    zigzag = zigzag * np.abs(zigzag)  # -1 .. 1 within each head, denser near 0.

    def vector(name, values, axes=("wkv",)):
      return self.param(name, _constant_init(np.asarray(values, np.float32), axes), (d,))

    def lora(name, rank, out_axes=("wkv",)):
      """The (down [C, rank], up [rank, C]) of one LoRA; down starts at zero, up orthogonal * 0.1."""
      down_w = self.param(f"{name}_down", nn.with_logical_partitioning(nn.initializers.zeros, ("embed", "lora")),
                          (d, rank))
      up_w = self.param(f"{name}_up", nn.with_logical_partitioning(nn.initializers.orthogonal(0.1),
                                                                   ("lora", *out_axes)), (rank, d))
      return down_w, up_w

    # Token shift: x + (previous - x) * shift, a per-channel interpolation toward the previous token.
    last = state.last_x
    powers = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
    shifts = {name: vector(f"shift_{name}", _shift_fraction(d, p * down), ("embed",)) for name, p in powers.items()}
    if self.norm_kind is not None and norm is None:
      raise ValueError("TimeMix7: with norm_kind set, the call needs the norm's parameters (norm=(scale, bias))")
    stream = x
    if self.norm_kind is not None and valid is None:  # The norm and the r, k, v mixes as one op.
      stream, x, mixes = norm_mix(x, last, *norm, jnp.stack([shifts[name] for name in "rkv"]), kind=self.norm_kind,
                                  eps=self.norm_eps, dtype=self.dtype, impl=self.norm_impl)
      mixed = dict(zip("rkv", mixes))
    else:
      if self.norm_kind is not None:
        x = normalize(x, *norm, kind=self.norm_kind, eps=self.norm_eps, dtype=self.dtype)
      x, shifted = shift_inputs(x.astype(self.dtype), last, valid)
      delta = shifted - x
      mixed = {name: x + delta * shifts[name].astype(x.dtype) for name in "rkv"}

    scale = 1 / math.sqrt(d)
    r = _projection(d, _centered_uniform(0.5 * scale, ("embed", "wkv")), self.dtype, "receptance", self.fp8)(
        mixed["r"])
    k = _projection(d, _centered_uniform(0.05 * scale, ("embed", "wkv")), self.dtype, "key", self.fp8)(mixed["k"])
    v = _projection(d, _centered_uniform(0.5 * scale, ("embed", "wkv")), self.dtype, "value", self.fp8)(mixed["v"])

    decay_base = vector("decay_base", -6 + 6 * (channel / max(d - 1, 1)) ** (1 + up ** 0.3) + 0.5 + 2.5 * zigzag)
    loras = [(*lora("decay", self.decay_lora), shifts["w"], jnp.tanh)]
    iclr_base = vector("iclr_base", -0.19 + 0.3 * zigzag + 0.4 * linear)
    loras.append((*lora("iclr", self.iclr_lora), shifts["a"], None))
    if not self.first:
      value_residual_base = vector("value_residual_base", 0.73 - 0.4 * linear)
      loras.append((*lora("value_residual", self.value_lora), shifts["v"], None))
    loras.append((*lora("gate", self.gate_lora), shifts["g"], nn.sigmoid))
    decay_lora, iclr_lora, *value_lora, gate = _shifted_loras(x, last, loras)

    log_decay = -MAX_LOG_DECAY * nn.sigmoid(decay_base + decay_lora.astype(jnp.float32))  # float32, in (-0.61, 0).
    if self.first:
      v_first = v
    else:
      gate_v = nn.sigmoid(value_residual_base.astype(x.dtype) + value_lora[0])
      v = v + (v_first.astype(v.dtype) - v) * gate_v

    key_norm_scale = vector("key_norm_scale", 0.71 - 0.1 * linear)
    key_iclr_mix = vector("key_iclr_mix", np.full(d, 1.02))
    to_heads = lambda t: t.reshape(batch, length, heads, n)
    norm_scale = self.param("out_norm_scale", nn.with_logical_partitioning(nn.initializers.ones, ("wkv",)), (d,))
    norm_bias = self.param("out_norm_bias", nn.with_logical_partitioning(nn.initializers.zeros, ("wkv",)), (d,))
    bonus = vector("bonus", np.full(d, -0.04))  # [C], official r_k [H, N]; a vector: no decay.
    # The in-context learning rate iclr = sigmoid(iclr_base + iclr_lora) in (0, 1), the normalised key kk (the delta
    # rule's a = -kk and b = kk * iclr), the key WKV-7 writes and the r.k bonus sums [B, T, H] (ops.rwkv7_key).
    neg_kk, kk_iclr, k, rk = rwkv7_key(k, iclr_lora, r, iclr_base, key_norm_scale, key_iclr_mix, bonus, head_size=n,
                                       eps=NORMALIZE_EPS, impl=self.key_impl)
    if valid is not None:  # Padding: no decay, no delta-rule correction (a = b = 0), no new key, no bonus.
      log_decay = jnp.where(valid[..., None], log_decay, 0.0)
      k, rk = jnp.where(valid[..., None], k, 0), jnp.where(valid[..., None], rk, 0)
      neg_kk, kk_iclr = (jnp.where(valid[..., None, None], t, 0) for t in (neg_kk, kk_iclr))
    y, wkv_state = wkv7(to_heads(r), to_heads(log_decay), to_heads(k), to_heads(v), neg_kk, kk_iclr, state.wkv,
                        impl=self.impl, w_min=LOG_DECAY_BOUND)

    # Per-head group norm of y with a per-channel affine, plus the r.k bonus times v, times the gate (ops.rwkv7_out).
    y = rwkv7_out(y, rk, v, gate, norm_scale, norm_bias, eps=GROUP_NORM_EPS, impl=self.out_impl)
    out = _projection(d, nn.with_logical_partitioning(nn.initializers.zeros, ("wkv", "embed")), self.dtype,
                      "output", self.fp8)(y)
    new_state = TimeMix7State(wkv_state, x[:, -1].astype(jnp.float32))
    return (out, new_state, v_first) if self.norm_kind is None else (out, new_state, v_first, stream)


def _shifted_loras(x, last, loras):
  """LoRAs of token-shift mixes: [up(act(mix @ down)) for (down, up, shift, act) in loras], each [B, T, C], where
  mix = x + (previous - x) * shift, x [B, T, C], last [B, C] the token before x (act None: none).

  mix @ down = x @ ((1 - shift) down) + previous @ (shift down), and previous @ M is x @ M one token later (last @ M
  first), so one matmul of x against every LoRA's two scaled downs stands for all the down projections: x is read
  once and no mix is written, forward or backward."""
  dtype = x.dtype
  downs = jnp.concatenate([down for down, *_ in loras], axis=1)  # [C, R], R the summed ranks.
  shift = jnp.concatenate([jnp.broadcast_to(s[:, None], down.shape) for down, _, s, _ in loras], axis=1)
  now_w, prev_w = (downs * (1 - shift)).astype(dtype), (downs * shift).astype(dtype)
  rank = downs.shape[1]
  both = x @ jnp.concatenate([now_w, prev_w], axis=1)  # [B, T, 2R]
  h = both[..., :rank] + token_shift(both[..., rank:], last.astype(dtype) @ prev_w)
  outs, start = [], 0
  for down, up, _, act in loras:
    h_i = h[..., start:start + down.shape[1]]
    start += down.shape[1]
    outs.append((h_i if act is None else act(h_i)) @ up.astype(dtype))
  return outs


class ChannelMix7(nn.Module):
  """RWKV-7 FFN: W_v relu(W_k x_k)^2 with a token-shifted input (no receptance gate); x, y: [B, T, d_model]. Where
  both kernels are plain arrays (not FP8, not stored quantised) the two products and the activation are one
  `ltm_jax.ops.ffn` op.

  With `norm_kind` set, x is the residual stream and the call's `norm` = (scale, bias) the parameters of the norm
  before the layer (bias None for rmsnorm): the layer normalises x with its token shift as one op
  (`ltm_jax.ops.norm_mix`, which keeps only the carried token of the normalised input), the same values as
  normalising before the call, and returns the stream as a third output for the block's residual add."""
  layer: int
  n_layers: int
  hidden: int
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.
  impl: str = "auto"  # The ltm_jax.ops.ffn backend.
  norm_kind: str | None = None  # "layernorm" or "rmsnorm": x is the stream, normalised here (see above).
  norm_eps: float = 1e-5
  norm_impl: str = "auto"  # The ltm_jax.ops.norm_mix backend.

  @nn.compact
  def __call__(self, x, state: ChannelMixState | None = None, valid=None, norm=None):
    batch, _, d = x.shape
    if self.norm_kind is not None and norm is None:
      raise ValueError("ChannelMix7: with norm_kind set, the call needs the norm's parameters (norm=(scale, bias))")
    _, down = depth_ratios(self.layer, self.n_layers)
    shift = self.param("shift_k", _constant_init(_shift_fraction(d, down ** 4).astype(np.float32), ("embed",)), (d,))
    state = ChannelMixState.empty(batch, d) if state is None else state
    stream = x
    if self.norm_kind is not None and valid is None:  # The norm and the token shift as one op.
      stream, carried, (xk,) = norm_mix(x, state.last_x, *norm, shift[None], kind=self.norm_kind, eps=self.norm_eps,
                                        dtype=self.dtype, impl=self.norm_impl, xn_rows="last")
    else:
      if self.norm_kind is not None:
        x = normalize(x, *norm, kind=self.norm_kind, eps=self.norm_eps, dtype=self.dtype)
      x, shifted = shift_inputs(x.astype(self.dtype), state.last_x, valid)
      xk, carried = x + (shifted - x) * shift.astype(x.dtype), x[:, -1]
    new_state = ChannelMixState(carried.astype(jnp.float32))
    kernels = plain_kernels(self, ("key", "value"), self.fp8)
    if kernels is not None:  # One ltm_jax.ops.ffn op (backend `impl`).
      key, value = (k.astype(self.dtype) for k in kernels)
      out = ffn(xk, key[:, None], value, activation="relu2", impl=self.impl)
    else:
      key = _projection(self.hidden, _centered_uniform(0.5 / math.sqrt(d), ("embed", "mlp")), self.dtype, "key",
                        self.fp8)
      hidden = jnp.square(nn.relu(key(xk)))
      value = _projection(d, nn.with_logical_partitioning(nn.initializers.zeros, ("mlp", "embed")), self.dtype,
                          "value", self.fp8)
      out = value(hidden)
    return (out, new_state) if self.norm_kind is None else (out, new_state, stream)
