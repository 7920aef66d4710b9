"""RWKV-4 time-mix (token shift, r/k/v, WKV recurrence, output gate) and channel-mix, each carrying its state."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import ops
from ltm_jax.layers.common import dense, depth_ratios, start_token_shift


class TimeMixState(NamedTuple):
  """wkv: the WKV (num, den, max) triple, each [B, C] float32; last_x: [B, d_model] float32, the last input token."""
  wkv: ops.Wkv4State
  last_x: jax.Array

  @classmethod
  def empty(cls, batch: int, d_model: int) -> TimeMixState:
    return cls(ops.wkv4_empty_state(batch, d_model), jnp.zeros((batch, d_model), jnp.float32))


class ChannelMixState(NamedTuple):
  """last_x: [B, d_model] float32, the last input token (for the token shift)."""
  last_x: jax.Array

  @classmethod
  def empty(cls, batch: int, d_model: int) -> ChannelMixState:
    return cls(jnp.zeros((batch, d_model), jnp.float32))


def _mix_init(power: float, offset: float = 0.0):
  """Token-shift mix coefficients (channel i / C) ** power + offset: later channels lean on the current token."""
  def init(key, shape, dtype=jnp.float32):
    del key
    return jnp.asarray((np.arange(shape[0]) / shape[0]) ** power + offset, dtype)
  return nn.with_logical_partitioning(init, ("embed",))


def _shift_mix(module: nn.Module, x, shifted, name: str, init) -> jax.Array:
  mix = module.param(name, init, (x.shape[-1],)).astype(x.dtype)
  return x * mix + shifted * (1 - mix)


class TimeMix(nn.Module):
  """x [B, T, d_model] -> y [B, T, d_model]; the WKV runs over d_model channels."""
  layer: int
  n_layers: int
  std: float
  out_std: float
  impl: str = "auto"
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state: TimeMixState | None = None, valid=None):
    """`valid` [B, T] bool (None: all valid) marks left padding, which leaves the state as it was."""
    _, length, d = x.shape
    state, x, shifted = start_token_shift(x, state, TimeMixState.empty, valid)
    up, down = depth_ratios(self.layer, self.n_layers)
    xk = _shift_mix(self, x, shifted, "mix_k", _mix_init(down))
    xv = _shift_mix(self, x, shifted, "mix_v", _mix_init(down, 0.3 * up))
    xr = _shift_mix(self, x, shifted, "mix_r", _mix_init(0.5 * down))

    def decay_init(key, shape, dtype=jnp.float32):  # Per-channel speeds from fast (-5) to slow (+3), in log-log space.
      del key
      c = np.arange(shape[0]) / max(shape[0] - 1, 1)
      return jnp.asarray(-5 + 8 * c ** (0.7 + 1.3 * up), dtype)

    def bonus_init(key, shape, dtype=jnp.float32):
      del key
      zigzag = ((np.arange(shape[0]) + 1) % 3 - 1) * 0.5
      return jnp.asarray(np.log(0.3) + zigzag, dtype)

    time_decay = self.param("time_decay", nn.with_logical_partitioning(decay_init, ("wkv",)), (d,))
    time_first = self.param("time_first", nn.with_logical_partitioning(bonus_init, ("wkv",)), (d,))
    k = dense(d, ("embed", "wkv"), self.std, self.dtype, "key", fp8=self.fp8)(xk)
    v = dense(d, ("embed", "wkv"), self.std, self.dtype, "value", fp8=self.fp8)(xv)
    r = dense(d, ("embed", "wkv"), self.std, self.dtype, "receptance", fp8=self.fp8)(xr)
    wkv_in = state.wkv
    if valid is not None:
      # A padded token adds nothing (weight e^k = 0) but still decays the state by e^w, w = -e^time_decay: start
      # that many steps' decay higher so the first real token sees the state exactly as it was.
      k = jnp.where(valid[..., None], k.astype(jnp.float32), jnp.finfo(jnp.float32).min)  # Below EMPTY_MAX.
      v = v.astype(jnp.float32)
      padding = (length - jnp.sum(valid, axis=1)).astype(jnp.float32)
      wkv_in = wkv_in._replace(max=wkv_in.max + padding[:, None] * jnp.exp(time_decay))
    wkv, wkv_state = ops.wkv4(-jnp.exp(time_decay), time_first, k, v, wkv_in, impl=self.impl)
    if valid is not None:  # Padding reads the state before the row's first token: its output is not the token's.
      wkv = jnp.where(valid[..., None], wkv, 0).astype(r.dtype)
    y = dense(d, ("wkv", "embed"), self.out_std, self.dtype, "output", fp8=self.fp8)(nn.sigmoid(r) * wkv)
    return y, TimeMixState(wkv_state, x[:, -1].astype(jnp.float32))


class ChannelMix(nn.Module):
  """RWKV-4 FFN: sigmoid(W_r x_r) * W_v relu(W_k x_k)^2, with token-shifted inputs; x, y: [B, T, d_model]."""
  layer: int
  n_layers: int
  hidden: int
  std: float
  out_std: float
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state: ChannelMixState | None = None, valid=None):
    d = x.shape[-1]
    state, x, shifted = start_token_shift(x, state, ChannelMixState.empty, valid)
    _, down = depth_ratios(self.layer, self.n_layers)
    xk = _shift_mix(self, x, shifted, "mix_k", _mix_init(down))
    xr = _shift_mix(self, x, shifted, "mix_r", _mix_init(down))
    hidden = jnp.square(nn.relu(dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "key", fp8=self.fp8)(xk)))
    value = dense(d, ("mlp", "embed"), self.out_std, self.dtype, "value", fp8=self.fp8)(hidden)
    gate = nn.sigmoid(dense(d, ("embed", "embed_out"), self.std, self.dtype, "receptance", fp8=self.fp8)(xr))
    return gate * value, ChannelMixState(x[:, -1].astype(jnp.float32))
