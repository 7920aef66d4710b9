"""Causal multi-head self-attention with RoPE, optional sliding window, GQA and a ring-buffer key/value cache."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax import ops
from ltm_jax.layers.common import dense, plain_kernels
from ltm_jax.layers.rope import apply_rope

EMPTY_POSITION = jnp.iinfo(jnp.int32).max  # An empty cache slot: causally invisible to every query.


class KVCache(NamedTuple):
  """A ring buffer of `capacity` keys/values: the token at position p lives in slot p % capacity.

  Once more than `capacity` tokens have been seen the oldest are overwritten: exactly the sliding window for windowed
  layers (capacity = window); for full attention the capacity must cover the whole sequence (the API checks).

  k, v: [B, capacity, Hkv, D] (RoPE already applied to k); positions: [B, capacity] int32, each slot's absolute
  position (EMPTY_POSITION when empty); next_position: [B] int32, the position of the row's next token.
  """
  k: jax.Array
  v: jax.Array
  positions: jax.Array
  next_position: jax.Array

  @classmethod
  def empty(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    kv = jnp.zeros((batch, capacity, kv_heads, head_dim), dtype)
    return cls(kv, kv, jnp.full((batch, capacity), EMPTY_POSITION, jnp.int32), jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def write(self, k, v, positions, keep) -> KVCache:
    """Stores the tokens k, v [B, T, Hkv, D] at `positions` [B, T] where `keep` [B, T] holds, in their ring slots.
    `keep` must select at most `capacity` consecutive positions per row, so no two writes share a slot."""
    rows = jnp.arange(k.shape[0])[:, None]
    slots = jnp.where(keep, positions % self.capacity, self.capacity)  # Out of range: dropped.
    put = lambda buffer, x: buffer.at[rows, slots].set(x.astype(buffer.dtype), mode="drop")
    return KVCache(put(self.k, k), put(self.v, v), put(self.positions, positions), self.next_position)


def token_positions(next_position, valid, length: int):
  """[B, T] int32 absolute positions of a chunk: valid tokens continue from next_position [B] one by one; padding
  (valid [B, T] False, or None for none) takes its row's next valid position, harmless for RoPE and never stored."""
  if valid is None:
    return next_position[:, None] + jnp.arange(length, dtype=jnp.int32)
  before = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - valid.astype(jnp.int32)
  return next_position[:, None] + before


class Attention(nn.Module):
  """x [B, T, d_model] -> (y [B, T, d_model], cache). Queries continue from `cache.next_position` (0 without a
  cache) and see the cached keys; the returned cache holds the last `capacity` keys (`window` for sliding-window
  layers, else `capacity`), so segment-wise processing equals a single call.

  `valid` [B, T] bool (None: all valid) marks left padding of ragged prompts: padded tokens are never seen by any
  query, never cached, and do not advance the row's positions.
  """
  n_heads: int
  kv_heads: int
  head_dim: int
  window: int | None
  capacity: int  # Ring size of a cache made here (window layers: the window); a given cache keeps its own.
  rope_theta: float
  std: float
  out_std: float
  impl: str = "auto"
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, cache: KVCache | None = None, valid=None):
    batch, length, d_model = x.shape
    q, k, v = self._project(x)
    fresh = cache is None
    if fresh:
      cache = KVCache.empty(batch, self.capacity, self.kv_heads, self.head_dim, k.dtype)
    positions = token_positions(cache.next_position, valid, length)
    q = apply_rope(q, positions, self.rope_theta)
    k = apply_rope(k, positions, self.rope_theta)
    keep = jnp.ones((batch, length), bool) if valid is None else valid
    count = jnp.sum(keep, axis=1, dtype=jnp.int32)
    end = cache.next_position + count
    decode_step = not fresh and length == 1 and valid is None
    if fresh:
      # Nothing cached: attend within the segment with the fast kernels. Left padding shifts every row's positions
      # uniformly, so index-based causal/window masks hold, and a padding segment keeps it apart.
      segments = None if valid is None else valid.astype(jnp.int32)
      y = ops.attention(q, k, v, causal=True, window=self.window, segment_ids=segments,
                        impl=ops.attention_impl_for(self.impl, segments=segments is not None))
    elif decode_step:
      # One decoding step: store first, then attend over the ring alone. The overwritten slot held position
      # p - capacity, which no query at p may see (window) or which never existed (full attention within capacity).
      cache = cache.write(k, v, positions, keep)
      y = ops.attention(q, cache.k, cache.v, causal=True, window=self.window, q_positions=positions,
                        kv_positions=cache.positions, impl=ops.attention_impl_for(self.impl, positions=True))
    else:
      key_positions = jnp.where(keep, positions, EMPTY_POSITION)
      y = ops.attention(q, jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1),
                        jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1), causal=True,
                        window=self.window, q_positions=positions,
                        kv_positions=jnp.concatenate([cache.positions, key_positions], axis=1),
                        impl=ops.attention_impl_for(self.impl, positions=True))
    if not decode_step:
      # Only the last `capacity` valid tokens of each row can still be seen; writing just those keeps slots unique.
      cache = cache.write(k, v, positions, keep & (positions >= (end - cache.capacity)[:, None]))
    y = dense(d_model, ("heads", "head_dim", "embed"), self.out_std, self.dtype, "out", in_axis=(-2, -1),
              fp8=self.fp8)(y)
    return y, cache._replace(next_position=end)

  def _project(self, x):
    """(q [B, T, Hq, D], k, v [B, T, Hkv, D]) = x [B, T, d_model] times the "q", "k" and "v" kernels.

    Where all three are plain arrays they are one product: x times [d_model, Hkv, G + 2, D], each key/value head's
    G = Hq / Hkv query heads (query head h reads key/value head h // G) with its key and value beside them. x is then
    read once, and the backward's gradient of x is one product instead of three partial ones that the norm's
    backward before the layer would add. A tensor-parallel mesh splits heads and key/value heads over the same axis,
    so grouping by key/value head splits the stacked kernel as it splits the three. Kernels stored quantised, and FP8
    projections, take each projection through its `Dense`."""
    kernels = plain_kernels(self, ("q", "k", "v"), self.fp8)
    if kernels is None:
      q = dense((self.n_heads, self.head_dim), ("embed", "heads", "head_dim"), self.std, self.dtype, "q",
                fp8=self.fp8)(x)
      k = dense((self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), self.std, self.dtype, "k",
                fp8=self.fp8)(x)
      v = dense((self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), self.std, self.dtype, "v",
                fp8=self.fp8)(x)
      return q, k, v
    batch, length, d_model = x.shape
    group = self.n_heads // self.kv_heads
    w_q, w_k, w_v = (w.astype(self.dtype) for w in kernels)
    grouped = w_q.reshape(d_model, self.kv_heads, group, self.head_dim)
    stacked = jnp.concatenate([grouped, w_k[:, :, None], w_v[:, :, None]], axis=2)  # [d_model, Hkv, G + 2, D]
    qkv = jnp.einsum("btc,cgkd->btgkd", x.astype(self.dtype), stacked)
    q = qkv[:, :, :, :group].reshape(batch, length, self.n_heads, self.head_dim)
    return q, qkv[:, :, :, group], qkv[:, :, :, group + 1]
