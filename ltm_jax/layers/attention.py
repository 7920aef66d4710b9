"""Causal multi-head self-attention with RoPE, optional sliding window, GQA and a key/value cache as its state."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax import ops
from ltm_jax.layers.common import dense
from ltm_jax.layers.rope import apply_rope

EMPTY_POSITION = jnp.iinfo(jnp.int32).max  # An empty cache slot: causally invisible to every query.


class KVCache(NamedTuple):
  """The last `capacity` keys/values in time order (empty slots first), with their absolute positions.

  Older keys fall out once more than `capacity` tokens have been seen: exactly the sliding window for windowed
  layers; for full attention `capacity` is model.max_seq_len and callers must stay within it (the API checks).

  k, v: [B, capacity, Hkv, D] (RoPE already applied to k); positions: [B, capacity] int32 (EMPTY_POSITION when
  empty); next_position: [B] int32, the position of the next token.
  """
  k: jax.Array
  v: jax.Array
  positions: jax.Array
  next_position: jax.Array

  @classmethod
  def empty(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    kv = jnp.zeros((batch, capacity, kv_heads, head_dim), dtype)
    return cls(kv, kv, jnp.full((batch, capacity), EMPTY_POSITION, jnp.int32), jnp.zeros((batch,), jnp.int32))


class Attention(nn.Module):
  """x [B, T, d_model] -> y [B, T, d_model]. Without a cache the segment starts at position 0; with one, queries
  continue from `cache.next_position` and see the cached keys. The returned cache holds the last `capacity` keys
  (`window` for sliding-window layers, else `max_seq_len`), so segment-wise processing equals a single call."""
  n_heads: int
  kv_heads: int
  head_dim: int
  window: int | None
  capacity: int
  rope_theta: float
  std: float
  out_std: float
  impl: str = "auto"
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x, cache: KVCache | None = None):
    batch, length, d_model = x.shape
    q = dense((self.n_heads, self.head_dim), ("embed", "heads", "head_dim"), self.std, self.dtype, "q")(x)
    k = dense((self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), self.std, self.dtype, "k")(x)
    v = dense((self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), self.std, self.dtype, "v")(x)
    if cache is None:
      cache = KVCache.empty(batch, self.capacity, self.kv_heads, self.head_dim, k.dtype)
      fresh = True
    else:
      fresh = False
    positions = cache.next_position[:, None] + jnp.arange(length, dtype=jnp.int32)
    q = apply_rope(q, positions, self.rope_theta)
    k = apply_rope(k, positions, self.rope_theta)
    keys = jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1)
    values = jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1)
    key_positions = jnp.concatenate([cache.positions, positions], axis=1)
    if fresh:  # Nothing cached: attend within the segment only (no wasted work on empty slots while training).
      y = ops.attention(q, k, v, causal=True, window=self.window, impl=self.impl)
    else:
      y = ops.attention(q, keys, values, causal=True, window=self.window, q_positions=positions,
                        kv_positions=key_positions, impl=self.impl)
    y = dense(d_model, ("heads", "head_dim", "embed"), self.out_std, self.dtype, "out", in_axis=(-2, -1))(y)
    new_cache = KVCache(keys[:, -self.capacity:], values[:, -self.capacity:], key_positions[:, -self.capacity:],
                        cache.next_position + length)
    return y, new_cache
