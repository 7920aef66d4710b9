"""The decoder LM: token embedding, a stack of pre-norm blocks (mixer then FFN), final norm and LM head.

Every block maps (x, state) -> (y, new_state), so a long sequence can be processed segment by segment:
`logits, state = model.apply(params, tokens_a)` then `model.apply(params, tokens_b, state)` equals one call on both.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.config import ModelConfig
from ltm_jax.layers import Attention, ChannelMix, ChannelMixState, KVCache, SwiGLU, TimeMix, TimeMixState
from ltm_jax.layers.common import init, norm


class BlockState(NamedTuple):
  mixer: Any  # KVCache for attention, TimeMixState for RWKV-4.
  ffn: Any  # ChannelMixState for channel-mix, None for SwiGLU.


def _std(cfg: ModelConfig) -> tuple[float, float]:
  """(input projections, output projections): outputs scaled by 1/sqrt(2 L) so the residual stream starts small."""
  return cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)


def _cache_capacity(cfg: ModelConfig) -> int:
  return cfg.window if cfg.window is not None else cfg.max_seq_len


class Block(nn.Module):
  """x + mixer(norm(x)), then x + ffn(norm(x)); x: [B, T, d_model]."""
  cfg: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, x, state: BlockState | None = None):
    cfg, mixer_kind = self.cfg, self.cfg.mixers[self.layer]
    std, out_std = _std(cfg)
    if mixer_kind == "attention":
      mixer = Attention(n_heads=cfg.n_heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, window=cfg.window,
                        capacity=_cache_capacity(cfg), rope_theta=cfg.rope_theta, std=std, out_std=out_std,
                        impl=cfg.attention_impl, dtype=cfg.dtype, name="mixer")
    else:
      mixer = TimeMix(layer=self.layer, n_layers=cfg.n_layers, std=std, out_std=out_std, impl=cfg.wkv_impl,
                      dtype=cfg.dtype, name="mixer")
    ffn_kind = cfg.ffn_kind(mixer_kind)
    if ffn_kind == "channel_mix":
      ffn = ChannelMix(layer=self.layer, n_layers=cfg.n_layers, hidden=cfg.ffn_dim(ffn_kind), std=std,
                       out_std=out_std, dtype=cfg.dtype, name="ffn")
    else:
      ffn = SwiGLU(hidden=cfg.ffn_dim(ffn_kind), std=std, out_std=out_std, dtype=cfg.dtype, name="ffn")
    mixer_state, ffn_state = (None, None) if state is None else state
    h, mixer_state = mixer(norm(cfg.norm, cfg.norm_eps, cfg.dtype, "mixer_norm")(x), mixer_state)
    x = x + h.astype(x.dtype)
    h, ffn_state = ffn(norm(cfg.norm, cfg.norm_eps, cfg.dtype, "ffn_norm")(x), ffn_state)
    return x + h.astype(x.dtype), BlockState(mixer_state, ffn_state)


class LM(nn.Module):
  """tokens [B, T] int -> (logits [B, T, vocab_size] float32, state). The LM head is padded to a multiple of 128
  for fast matmuls; the padded columns are sliced off, so they never enter the softmax. The residual stream stays
  float32 whatever `dtype` is (sub-layers compute in `dtype` and their outputs are added in float32), as PyTorch
  autocast does, so deep bfloat16 models do not accumulate rounding in the residual sum."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, state: tuple[BlockState, ...] | None = None):
    cfg = self.cfg
    embed = nn.Embed(cfg.padded_vocab_size, cfg.d_model, dtype=jnp.float32, param_dtype=jnp.float32,
                     embedding_init=init(cfg.init_std, ("vocab", "embed")), name="embed")
    x = embed(tokens)
    new_state = []
    for i in range(cfg.n_layers):
      x, block_state = Block(cfg, i, name=f"block_{i}")(x, None if state is None else state[i])
      new_state.append(block_state)
    x = norm(cfg.norm, cfg.norm_eps, cfg.dtype, "final_norm")(x)
    if cfg.tie_embeddings:
      logits = x @ embed.embedding.astype(cfg.dtype).T  # In the compute dtype, as the untied head.
    else:
      logits = nn.Dense(cfg.padded_vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=jnp.float32,
                        kernel_init=init(cfg.init_std, ("embed", "vocab")), name="head")(x)
    return logits[..., :cfg.vocab_size].astype(jnp.float32), tuple(new_state)


def init_state(cfg: ModelConfig, batch: int) -> tuple[BlockState, ...]:
  """The state before any token: empty caches and recurrent states for every layer."""
  states = []
  for mixer_kind in cfg.mixers:
    if mixer_kind == "attention":
      mixer = KVCache.empty(batch, _cache_capacity(cfg), cfg.kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    else:
      mixer = TimeMixState.empty(batch, cfg.d_model)
    ffn = ChannelMixState.empty(batch, cfg.d_model) if cfg.ffn_kind(mixer_kind) == "channel_mix" else None
    states.append(BlockState(mixer, ffn))
  return tuple(states)


def init_params(cfg: ModelConfig, key: jax.Array, seq_len: int = 8):
  """Float32 parameters (unboxed) of `LM(cfg)`; logical axis names stay available via `param_axes(cfg)`."""
  variables = LM(cfg).init(key, jnp.zeros((1, seq_len), jnp.int32))
  return nn.meta.unbox(variables["params"])


def param_axes(cfg: ModelConfig):
  """The logical axis names of every parameter, as a pytree of PartitionSpec-like tuples (no computation)."""
  variables = jax.eval_shape(lambda: LM(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  return nn.get_partition_spec(variables["params"])


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
