"""Flash attention from the top-level `ltm_pallas.attention` kernels (Triton lowering on GPU, interpreted on CPU).

Takes every mask of `ltm_jax.ops.attention.attention` that is defined by indices: causal (end-aligned when T != S),
sliding windows, segment ids (self or cross), non-causal attention of any T and S, grouped key/value heads, any head
dim. It does not take explicit q_positions/kv_positions (key/value caches): positions are data, so the kernel could
not skip blocks by index, and cache calls are short queries over a cache, where the kernel gains little. Such calls
go to xla under impl="auto" and raise ValueError under impl="pallas".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ltm_pallas.attention import flash_attention

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Beyond this the f32 accumulator tiles no longer fit a GPU program's registers at useful block sizes.
MAX_HEAD_DIM = 256


def unsupported_reason(head_dim: int, dtype: Any, *, has_positions: bool) -> str | None:
  """Why the Pallas kernel cannot run this call (a sentence), or None if it can."""
  if has_positions:
    return ("explicit q_positions/kv_positions are not supported by the Pallas kernel (its masks come from indices); "
            "use impl='xla' or 'auto'")
  if jnp.dtype(dtype) not in [jnp.dtype(x) for x in _DTYPES]:
    return f"the Pallas kernel takes float16, bfloat16 or float32, got {jnp.dtype(dtype)}"
  if head_dim > MAX_HEAD_DIM:
    return f"the Pallas kernel takes head dims <= {MAX_HEAD_DIM}, got {head_dim}"
  return None


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    window: int | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    scale: float,
) -> jax.Array:
  """The caller has checked `unsupported_reason`; arguments as in `ltm_jax.ops.attention.attention`.

  Args:
    q: [B, T, Hq, D].
    k: [B, S, Hkv, D].
    v: [B, S, Hkv, D].
    q_segment_ids: [B, T] int or None (given together with kv_segment_ids).
    kv_segment_ids: [B, S] int or None.

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  segments = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  return flash_attention(q, k, v, segments, causal=causal, window=window, scale=scale)
