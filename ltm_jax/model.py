"""The decoder LM: token embedding, a stack of pre-norm blocks (mixer, latent cross-attention, FFN), final norm and
LM head.

Every block maps (x, state) -> (y, new_state), so a long sequence can be processed segment by segment:
`logits, state = model.apply(params, tokens_a)` then `model.apply(params, tokens_b, state)` equals one call on both.
With `latent.enabled`, every block also reads its layer's latent thought vectors z[:, l] through cross-attention, and
every call takes z [B, n_layers, n_per_layer, d_model] (see ltm_jax/latent.py for how z is inferred).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.config import LatentConfig, ModelConfig
from ltm_jax.layers import Attention, ChannelMix, ChannelMixState, CrossAttention, KVCache, SwiGLU, TimeMix, TimeMixState
from ltm_jax.layers import ChannelMix7, TimeMix7, TimeMix7State
from ltm_jax.layers.common import init, norm


class BlockState(NamedTuple):
  mixer: Any  # KVCache for attention, TimeMixState for RWKV-4, TimeMix7State for RWKV-7.
  ffn: Any  # ChannelMixState for both channel-mixes, None for SwiGLU.


def _std(cfg: ModelConfig) -> tuple[float, float]:
  """(input projections, output projections): outputs scaled by 1/sqrt(2 L) so the residual stream starts small."""
  return cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)


def _cache_capacity(cfg: ModelConfig) -> int:
  return cfg.window if cfg.window is not None else cfg.max_seq_len


class Block(nn.Module):
  """x + mixer(norm(x)), then x + cross_attention(norm(x), z_l) when latents are on, then x + ffn(norm(x));
  x: [B, T, d_model], z_l: [B, n_per_layer, d_model], positions: [B, T] (only for latent RoPE).

  Returns (x, state, v_first): v_first [B, T, d_model] is the first RWKV-7 layer's values, made by that layer and
  read by every later RWKV-7 layer (value residual); other blocks pass it through."""
  cfg: ModelConfig
  layer: int
  latent: LatentConfig | None = None

  @nn.compact
  def __call__(self, x, state: BlockState | None = None, z=None, positions=None, v_first=None):
    cfg, mixer_kind = self.cfg, self.cfg.mixers[self.layer]
    std, out_std = _std(cfg)
    if mixer_kind == "attention":
      mixer = Attention(n_heads=cfg.n_heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, window=cfg.window,
                        capacity=_cache_capacity(cfg), rope_theta=cfg.rope_theta, std=std, out_std=out_std,
                        impl=cfg.attention_impl, dtype=cfg.dtype, name="mixer")
    elif mixer_kind == "rwkv7":
      lora = cfg.rwkv7_lora_dims()
      mixer = TimeMix7(layer=self.layer, n_layers=cfg.n_layers, head_size=cfg.rwkv7_head_size,
                       decay_lora=lora["decay"], iclr_lora=lora["iclr"], value_lora=lora["value"],
                       gate_lora=lora["gate"], first=cfg.mixers.index("rwkv7") == self.layer, impl=cfg.wkv7_impl,
                       dtype=cfg.dtype, name="mixer")
    else:
      mixer = TimeMix(layer=self.layer, n_layers=cfg.n_layers, std=std, out_std=out_std, impl=cfg.wkv_impl,
                      dtype=cfg.dtype, name="mixer")
    ffn_kind = cfg.ffn_kind(mixer_kind)
    if ffn_kind == "channel_mix":
      ffn = ChannelMix(layer=self.layer, n_layers=cfg.n_layers, hidden=cfg.ffn_dim(ffn_kind), std=std,
                       out_std=out_std, dtype=cfg.dtype, name="ffn")
    elif ffn_kind == "channel_mix7":
      ffn = ChannelMix7(layer=self.layer, n_layers=cfg.n_layers, hidden=cfg.ffn_dim(ffn_kind), dtype=cfg.dtype,
                        name="ffn")
    else:
      ffn = SwiGLU(hidden=cfg.ffn_dim(ffn_kind), std=std, out_std=out_std, dtype=cfg.dtype, name="ffn")
    mixer_state, ffn_state = (None, None) if state is None else state
    h = norm(cfg.norm, cfg.norm_eps, cfg.dtype, "mixer_norm")(x)
    if mixer_kind == "rwkv7":
      h, mixer_state, v_first = mixer(h, mixer_state, v_first)
    else:
      h, mixer_state = mixer(h, mixer_state)
    x = x + h.astype(x.dtype)
    if self.latent is not None:
      cross = CrossAttention(n_heads=cfg.n_heads, head_dim=cfg.head_dim, std=std, out_std=out_std,
                             rope_span=self.latent.rope_span if self.latent.rope else None,
                             rope_theta=cfg.rope_theta, impl=cfg.attention_impl, dtype=cfg.dtype,
                             name="cross_attention")
      h = cross(norm(cfg.norm, cfg.norm_eps, cfg.dtype, "cross_norm")(x), z, positions)
      x = x + h.astype(x.dtype)
    h, ffn_state = ffn(norm(cfg.norm, cfg.norm_eps, cfg.dtype, "ffn_norm")(x), ffn_state)
    return x + h.astype(x.dtype), BlockState(mixer_state, ffn_state), v_first


class LM(nn.Module):
  """tokens [B, T] int -> (logits [B, T, vocab_size] float32, state). The LM head is padded to a multiple of 128
  for fast matmuls; the padded columns are sliced off, so they never enter the softmax. The residual stream stays
  float32 whatever `dtype` is (sub-layers compute in `dtype` and their outputs are added in float32), as PyTorch
  autocast does, so deep bfloat16 models do not accumulate rounding in the residual sum.

  `latent`: None (or disabled) for the plain decoder; enabled adds a cross-attention sub-layer to every block, and
  `latents` [B, n_layers, n_per_layer, d_model] must then be given. `positions` [B, T] are the tokens' absolute
  positions, needed only by latent RoPE when decoding past position 0 (default: 0..T-1)."""
  cfg: ModelConfig
  latent: LatentConfig | None = None

  @nn.compact
  def __call__(self, tokens, state: tuple[BlockState, ...] | None = None, latents=None, positions=None):
    cfg, latent = self.cfg, uses_latents(self.latent)
    if latent is not None:
      expected = latent_shape(cfg, latent, tokens.shape[0])
      if latents is None or latents.shape != expected:
        got = None if latents is None else latents.shape
        raise ValueError(f"this model reads latent thought vectors: pass latents of shape {expected}, got {got}")
    elif latents is not None:
      raise ValueError("latents were given to a model without latent cross-attention (latent.enabled=false)")
    embed = nn.Embed(cfg.padded_vocab_size, cfg.d_model, dtype=jnp.float32, param_dtype=jnp.float32,
                     embedding_init=init(cfg.init_std, ("vocab", "embed")), name="embed")
    x = embed(tokens)
    if cfg.ln0:  # In float32: it feeds the residual stream.
      x = norm(cfg.norm, cfg.norm_eps, jnp.float32, "embed_norm")(x)
    new_state, v_first = [], None
    for i in range(cfg.n_layers):
      z = None if latent is None else latents[:, i]
      x, block_state, v_first = Block(cfg, i, latent, name=f"block_{i}")(
          x, None if state is None else state[i], z, positions, v_first)
      new_state.append(block_state)
    x = norm(cfg.norm, cfg.norm_eps, cfg.dtype, "final_norm")(x)
    if cfg.tie_embeddings:
      logits = x @ embed.embedding.astype(cfg.dtype).T  # In the compute dtype, as the untied head.
    else:
      logits = nn.Dense(cfg.padded_vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=jnp.float32,
                        kernel_init=init(cfg.init_std, ("embed", "vocab")), name="head")(x)
    return logits[..., :cfg.vocab_size].astype(jnp.float32), tuple(new_state)


def uses_latents(latent: LatentConfig | None) -> LatentConfig | None:
  """`latent` when it turns latent cross-attention on, else None."""
  return latent if latent is not None and latent.enabled else None


def latent_shape(cfg: ModelConfig, latent: LatentConfig, batch: int) -> tuple[int, int, int, int]:
  """The shape of z for a batch: [B, n_layers, n_per_layer, d_model]."""
  return (batch, cfg.n_layers, latent.n_per_layer, cfg.d_model)


def init_state(cfg: ModelConfig, batch: int) -> tuple[BlockState, ...]:
  """The state before any token: empty caches and recurrent states for every layer."""
  states = []
  for mixer_kind in cfg.mixers:
    if mixer_kind == "attention":
      mixer = KVCache.empty(batch, _cache_capacity(cfg), cfg.kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
    elif mixer_kind == "rwkv7":
      mixer = TimeMix7State.empty(batch, cfg.d_model, cfg.rwkv7_head_size)
    else:
      mixer = TimeMixState.empty(batch, cfg.d_model)
    has_shift = cfg.ffn_kind(mixer_kind) in ("channel_mix", "channel_mix7")
    ffn = ChannelMixState.empty(batch, cfg.d_model) if has_shift else None
    states.append(BlockState(mixer, ffn))
  return tuple(states)


def _init_variables(cfg: ModelConfig, latent: LatentConfig | None, key: jax.Array, seq_len: int = 8):
  latent = uses_latents(latent)
  latents = None if latent is None else jnp.zeros(latent_shape(cfg, latent, 1), jnp.float32)
  return LM(cfg, latent).init(key, jnp.zeros((1, seq_len), jnp.int32), latents=latents)


def init_params(cfg: ModelConfig, key: jax.Array, latent: LatentConfig | None = None):
  """Float32 parameters (unboxed) of `LM(cfg, latent)`; logical axis names stay available via `param_axes`.

  The decoder's parameters do not depend on `latent`: the same key gives the same decoder with or without latents,
  which only add each block's cross-attention (so comparisons start from identical decoders)."""
  return nn.meta.unbox(_init_variables(cfg, latent, key)["params"])


def param_axes(cfg: ModelConfig, latent: LatentConfig | None = None):
  """The logical axis names of every parameter, as a pytree of PartitionSpec-like tuples (no computation)."""
  variables = jax.eval_shape(lambda: _init_variables(cfg, latent, jax.random.key(0)))
  return nn.get_partition_spec(variables["params"])


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
