"""Reference attention: a dense [T, S] mask, einsums and a float32 softmax.

This is the definition the other backends are tested against, and the backend used wherever no faster one applies
(CPU, TPU, float32 on GPU, custom positions, packed segments).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility_mask(
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    causal: bool,
    window: int | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> jax.Array | None:
  """Which keys each query may see; None when every key is visible.

  Args:
    q_positions: [B, T] int32 (or [1, T], shared by the batch); non-negative.
    kv_positions: [B, S] int32 (or [1, S]).
    causal: key visible only if kv_pos <= q_pos.
    window: additionally q_pos - kv_pos < window (requires causal).
    q_segment_ids: [B, T] int or None.
    kv_segment_ids: [B, S] int or None.

  Returns:
    [B, T, S] bool (leading 1 when nothing is per-row), or None.
  """
  mask = None
  if causal:
    q_pos = q_positions[:, :, None]
    kv_pos = kv_positions[:, None, :]
    mask = kv_pos <= q_pos
    if window is not None:
      # Evaluated only where kv_pos <= q_pos matters: there both are bounded by q_pos, so the difference cannot
      # overflow even when empty cache slots carry int32 max.
      mask = mask & (q_pos - kv_pos < window)
  if q_segment_ids is not None:
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask = same if mask is None else mask & same
  return mask


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None,
    scale: float,
) -> jax.Array:
  """Softmax attention with grouped key/value heads, never repeating k or v.

  Args:
    q: [B, T, Hq, D].
    k: [B, S, Hkv, D]; query head h reads key/value head h // (Hq // Hkv).
    v: [B, S, Hkv, D].
    mask: [B, T, S] bool (True = visible) or None.
    scale: multiplies the logits.

  Returns:
    [B, T, Hq, D] in q's dtype. Query rows with no visible key are zero.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  # Inputs keep their dtype (bf16 runs at bf16 matmul speed); accumulation and everything after is float32.
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  if mask is None:
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    mask = mask[:, None, None, :, :]
    # A finite fill keeps fully masked rows NaN-free (their softmax is uniform); the outer where then zeroes them,
    # and zeroes their gradient too.
    filled = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jnp.where(mask, jax.nn.softmax(filled, axis=-1), 0.0)
  # Probabilities are rounded to v's dtype for the second matmul, as fused kernels do; a no-op for float32.
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, hq, d).astype(q.dtype)


def local_block_size(window: int) -> int:
  """The query block of `local_attention`: the window rounded up to a multiple of 16 (so tiny windows still give
  matmuls of a useful size)."""
  return -(-window // 16) * 16


def split_blocks(x: jax.Array, c: int) -> jax.Array:
  """[B, T, ...] -> [B, n, c, ...] with n = ceil(T / c), zero-padded at the end (for causal attention padded keys
  lie in every query's future)."""
  b, t = x.shape[:2]
  n = -(-t // c)
  x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(b, n, c, *x.shape[2:])


def with_previous(x: jax.Array) -> jax.Array:
  """[B, n, c, ...] -> [B, n, 2c, ...]: block i - 1 then block i (zeros before block 0)."""
  previous = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  return jnp.concatenate([previous, x], axis=2)


def local_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    window: int,
    scale: float,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Causal sliding-window self-attention (query i sees keys i - window < j <= i) in O(T * window), not O(T^2).

  The queries are cut into blocks of c = `local_block_size(window)` >= window positions; since no key is further
  back than the window, block i reads only key blocks i - 1 and i, so each query scores 2c keys instead of T. The
  same masked softmax as `attention` runs on those [c, 2c] tiles, so the results agree to rounding.

  Args:
    q, k, v: [B, T, Hq, D] and [B, T, Hkv, D]: self-attention with default positions (T == S).
    window: W >= 1.
    scale: multiplies the logits.
    q_segment_ids, kv_segment_ids: [B, T] int or None (packed segments / padding).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  b, t, hq, d = q.shape
  c = local_block_size(window)
  n = -(-t // c)
  blocks = lambda x: split_blocks(x, c)

  q_pos = jnp.arange(n)[:, None] * c + jnp.arange(c)[None, :]  # [n, c]
  kv_pos = q_pos[:, :1] - c + jnp.arange(2 * c)[None, :]  # [n, 2c]; negative before the sequence.
  diff = q_pos[:, :, None] - kv_pos[:, None, :]
  mask = jnp.broadcast_to((kv_pos[:, None, :] >= 0) & (diff >= 0) & (diff < window), (b, n, c, 2 * c))
  if q_segment_ids is not None:
    q_seg, kv_seg = blocks(q_segment_ids), with_previous(blocks(kv_segment_ids))
    mask = mask & (q_seg[..., :, None] == kv_seg[..., None, :])
  flat = lambda x: x.reshape(b * n, *x.shape[2:])
  out = attention(flat(blocks(q)), flat(with_previous(blocks(k))), flat(with_previous(blocks(v))),
                  mask=flat(mask), scale=scale)
  return out.reshape(b, n * c, hq, d)[:, :t]
