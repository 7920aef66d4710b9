"""What a block builds for each mixer kind (config.MIXERS: attention, RWKV-4, RWKV-7, Titans MAL and MAG, MM-Rec) and
each FFN kind: the layer module with its arguments from the model config, and its state before any token. A new
mixer or FFN is one entry here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.config import ModelConfig
from ltm_jax.layers import Attention, ChannelMix, ChannelMix7, ChannelMixState, KVCache, MemoryAsGate, MemoryAsLayer
from ltm_jax.layers import MMRec, MMRecState, NeuralMemoryState, SwiGLU, TimeMix, TimeMix7, TimeMix7State
from ltm_jax.layers import TimeMixState, TitansState


class Site(NamedTuple):
  """Where a sub-layer is built: the model config, the block's layer index, the initialisation scales of input and
  output projections, and the attention cache's slots."""
  cfg: ModelConfig
  layer: int
  std: float
  out_std: float
  capacity: int


Build = Callable[[Site], tuple[type[nn.Module], dict[str, Any]]]
EmptyState = Callable[[ModelConfig, int, int], Any]  # (cfg, batch, cache slots) -> the state before any token.


class Mixer(NamedTuple):
  build: Build
  empty_state: EmptyState
  value_residual: bool = False  # Takes and returns v_first, the first RWKV-7 layer's values.
  token_shift: bool = False  # Its input is token-shifted (each position also reads the previous one's).
  # Takes the residual stream and the parameters of the norm before it (`norm=(scale, bias)`), normalises the stream
  # itself and returns it last, for the residual add; its build sets norm_kind and norm_eps.
  normalizes_input: bool = False


class Ffn(NamedTuple):
  build: Build
  empty_state: EmptyState
  token_shift: bool = False  # Its input is token-shifted (each position also reads the previous one's).
  # As Mixer's: takes the residual stream (after the previous sub-layer's add) and the norm's parameters, normalises
  # the stream itself and returns it last, for the residual add.
  normalizes_input: bool = False


def _attention_args(s: Site) -> dict[str, Any]:
  cfg = s.cfg
  return dict(n_heads=cfg.n_heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, window=cfg.window,
              capacity=s.capacity, rope_theta=cfg.rope_theta, std=s.std, out_std=s.out_std, impl=cfg.attention_impl,
              fp8=cfg.fp8)


def _memory_args(s: Site) -> dict[str, Any]:
  cfg = s.cfg
  return dict(n_heads=cfg.n_heads, head_dim=cfg.head_dim, depth=cfg.memory_depth, expansion=cfg.memory_expansion,
              chunk=cfg.memory_chunk, max_lr=cfg.memory_max_lr, std=s.std, out_std=s.out_std, impl=cfg.memory_impl,
              fp8=cfg.fp8)


def _attention(s: Site):
  return Attention, dict(_attention_args(s), dtype=s.cfg.dtype)


def _titans_mal(s: Site):
  return MemoryAsLayer, dict(memory=_memory_args(s), attention=_attention_args(s), norm_kind=s.cfg.norm,
                             norm_eps=s.cfg.norm_eps, dtype=s.cfg.dtype)


def _titans_mag(s: Site):
  return MemoryAsGate, dict(memory=_memory_args(s), attention=_attention_args(s), std=s.std, dtype=s.cfg.dtype,
                            fp8=s.cfg.fp8)


def _mmrec(s: Site):
  cfg = s.cfg
  return MMRec, dict(n_heads=cfg.n_heads, slots=cfg.mmrec_slots, segment=cfg.mmrec_segment,
                     precompute=cfg.mmrec_precompute, remat=cfg.mmrec_remat, std=s.std, out_std=s.out_std,
                     impl=cfg.mmrec_impl, dtype=cfg.dtype, fp8=cfg.fp8)


def _rwkv7(s: Site):
  cfg, lora = s.cfg, s.cfg.rwkv7_lora_dims()
  return TimeMix7, dict(layer=s.layer, n_layers=cfg.n_layers, head_size=cfg.rwkv7_head_size,
                        decay_lora=lora["decay"], iclr_lora=lora["iclr"], value_lora=lora["value"],
                        gate_lora=lora["gate"], first=cfg.mixers.index("rwkv7") == s.layer, impl=cfg.wkv7_impl,
                        dtype=cfg.dtype, fp8=cfg.fp8, norm_kind=cfg.norm, norm_eps=cfg.norm_eps,
                        norm_impl=cfg.norm_mix_impl)


def _rwkv4(s: Site):
  cfg = s.cfg
  return TimeMix, dict(layer=s.layer, n_layers=cfg.n_layers, std=s.std, out_std=s.out_std, impl=cfg.wkv_impl,
                       dtype=cfg.dtype, fp8=cfg.fp8)


def _kv_cache(cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
  return KVCache.empty(batch, capacity, cfg.kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))


def _titans_state(cfg: ModelConfig, batch: int, capacity: int) -> TitansState:
  memory = NeuralMemoryState.empty(batch, cfg.n_heads, cfg.head_dim, cfg.memory_depth, cfg.memory_expansion)
  return TitansState(memory, _kv_cache(cfg, batch, capacity))


MIXER_KINDS: dict[str, Mixer] = {
    "attention": Mixer(_attention, _kv_cache),
    "rwkv4": Mixer(_rwkv4, lambda cfg, batch, capacity: TimeMixState.empty(batch, cfg.d_model), token_shift=True),
    "rwkv7": Mixer(_rwkv7, lambda cfg, batch, capacity: TimeMix7State.empty(batch, cfg.d_model, cfg.rwkv7_head_size),
                   value_residual=True, normalizes_input=True),
    "titans_mal": Mixer(_titans_mal, _titans_state),
    "titans_mag": Mixer(_titans_mag, _titans_state),
    "mmrec": Mixer(_mmrec, lambda cfg, batch, capacity: MMRecState.empty(batch, cfg.d_model, cfg.mmrec_slots)),
}


def _channel_mix(s: Site):
  return ChannelMix, dict(layer=s.layer, n_layers=s.cfg.n_layers, hidden=s.cfg.ffn_dim("channel_mix"), std=s.std,
                          out_std=s.out_std, dtype=s.cfg.dtype, fp8=s.cfg.fp8)


def _channel_mix7(s: Site):
  return ChannelMix7, dict(layer=s.layer, n_layers=s.cfg.n_layers, hidden=s.cfg.ffn_dim("channel_mix7"),
                           dtype=s.cfg.dtype, fp8=s.cfg.fp8, impl=s.cfg.ffn_impl, norm_kind=s.cfg.norm,
                           norm_eps=s.cfg.norm_eps, norm_impl=s.cfg.norm_mix_impl)


def _swiglu(s: Site):
  return SwiGLU, dict(hidden=s.cfg.ffn_dim("swiglu"), std=s.std, out_std=s.out_std, dtype=s.cfg.dtype, fp8=s.cfg.fp8,
                      impl=s.cfg.ffn_impl)


def _token_shift(cfg: ModelConfig, batch: int, capacity: int) -> ChannelMixState:
  return ChannelMixState.empty(batch, cfg.d_model)


FFN_KINDS: dict[str, Ffn] = {
    "swiglu": Ffn(_swiglu, lambda cfg, batch, capacity: None),
    "channel_mix": Ffn(_channel_mix, _token_shift, token_shift=True),
    "channel_mix7": Ffn(_channel_mix7, _token_shift, token_shift=True, normalizes_input=True),
}
