"""Flash attention on Hopper by tokamax's Pallas Mosaic GPU kernels (`tokamax.dot_product_attention`,
implementation "mosaic"): forward and backward kernels for sm_90, no Triton.

tokamax is an optional dependency (`pip install tokamax`, which needs jax >= 0.11.1 and Python >= 3.12); without it
this backend refuses every call and `impl="auto"` never picks it. Its kernels choose their code by the default
device (sm_80, sm_90 or sm_100), so they run where that device is the GPU being compiled for.

Masks map onto tokamax's `local_window_size=(before, after)`, which keeps keys i - before <= j <= i + after for
query index i: ours keep j <= i + S - T (causal, end-aligned) and j > i + S - T - W (window W). Segment ids become a
dense [B, 1, T, S] boolean mask, which the kernels read tile by tile: O(B T S) bytes of memory traffic and storage,
where the index masks cost nothing; so do explicit positions (calls over a key/value cache), whose causal and window
masks are built from them. Windows much shorter than the sequence run blocked (`uses_blocks`): tokamax's backward
does not skip key blocks outside a window. float32 inputs are not taken (the kernels' backward takes
float16/bfloat16 only); head dims are those compiled for sm_90a (`HEAD_DIMS`).
Like every fused backend it is differentiable once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp

from ltm_jax.ops.attention import cudnn, xla
from ltm_pallas import backend as kernel_backend

_DTYPES = (jnp.float16, jnp.bfloat16)
# The head dims whose forward and backward kernels were compiled for sm_90a (docs/kernels.md, attention on Hopper).
HEAD_DIMS = (64, 128)
# Queries per program of tokamax's sm_90 forward kernel (two compute warpgroups of 64 rows).
QUERY_TILE = 128
# tokamax 0.0.17 declares jax >= 0.11.1.
MIN_JAX = (0, 11)
INSTALL = "pip install tokamax (needs jax >= 0.11.1 and Python >= 3.12)"

_SECOND_ORDER = ("attention: impl='tokamax' (tokamax's Mosaic GPU kernels) has no second derivative; impl='xla' is "
                 "differentiable to any order")


@functools.cache
def missing_reason() -> str | None:
  """Why this process cannot use tokamax (a sentence naming what to install), or None when it can."""
  if kernel_backend.jax_version() < MIN_JAX:
    return f"tokamax needs jax >= 0.11.1, this is jax {jax.__version__}; {INSTALL}"
  if importlib.util.find_spec("tokamax") is None:
    return f"tokamax is not installed; {INSTALL}"
  try:  # Installed is not enough: a dependency it needs may be missing.
    importlib.import_module("tokamax")
  except ImportError as e:
    return f"tokamax does not import ({e}); {INSTALL}"
  return None


def unsupported_reason(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    dtype: Any,
    *,
    causal: bool,
    has_positions: bool = False,
    missing: str | None = None,
) -> str | None:
  """Why tokamax's kernels cannot run this call (a sentence), or None if they can. `missing` is `missing_reason()`'s
  answer (passed in so that the argument checks are tested without the package)."""
  t, d = q_shape[1], q_shape[3]
  s = kv_shape[1]
  if missing is not None:
    return missing
  if jnp.dtype(dtype) not in [jnp.dtype(x) for x in _DTYPES]:
    return f"tokamax's Mosaic GPU backward takes float16 or bfloat16, got {jnp.dtype(dtype)}"
  if d not in HEAD_DIMS:
    return f"impl='tokamax' takes head dims {HEAD_DIMS} (those compiled for sm_90a), got {d}"
  if t == 1:
    return f"one query (a decoding step) would fill 1 of the kernels' {QUERY_TILE}-query tiles; impl='xla' runs it"
  if causal and t > s and not has_positions:
    return f"causal attention with T > S ({t} vs {s}) leaves queries without keys"
  return None


def local_window(*, causal: bool, window: int | None, t: int, s: int) -> tuple[int, int] | None:
  """Our causal/window mask as tokamax's `local_window_size=(before, after)` (None: no index mask).

  Ours, with query i at position S - T + i: key j is visible iff j <= i + (S - T) and, with a window W,
  j > i + (S - T) - W. tokamax keeps i - before <= j <= i + after, so after = S - T and before = W - 1 - (S - T),
  which may be negative. Without a window, before = S + T keeps every key from the start.
  """
  if not causal:
    return None
  after = s - t
  before = s + t if window is None or window >= s else window - 1 - after
  return before, after


def block_size(window: int) -> int:
  """The query block of the blocked form (`uses_blocks`): the window rounded up to a multiple of QUERY_TILE."""
  return -(-window // QUERY_TILE) * QUERY_TILE


def uses_blocks(causal: bool, window: int | None, t: int, s: int) -> bool:
  """Whether a call runs blocked: causal self-attention (T == S) whose window is short enough that two key blocks
  per query block are fewer keys than the whole sequence.

  Why: tokamax 0.0.17's backward kernels narrow their loops only for its plain causal mask, so under a window they
  visit every key block of every query block, O(T S) work. Cut into query blocks of c >= W positions, each reading
  only its own and the previous key block (as `xla.local_attention` does), a call does O(T c) work forward and
  backward, at the cost of a second copy of k and v (and a dense segment mask of [T, 2c] instead of [T, S]).
  """
  return causal and window is not None and t == s and 2 * block_size(window) < s


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    window: int | None,
    scale: float,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    implementation: str = "mosaic",
) -> jax.Array:
  """Attention through `tokamax.dot_product_attention`; the caller has checked `unsupported_reason`.

  Args:
    q: [B, T, Hq, D].
    k: [B, S, Hkv, D].
    v: [B, S, Hkv, D].
    causal, window, scale: as in `ltm_jax.ops.attention.attention`.
    q_segment_ids: [B, T] int or None (given together with kv_segment_ids).
    kv_segment_ids: [B, S] int or None.
    q_positions: [B, T] int or None (given together with kv_positions, with causal=True).
    kv_positions: [B, S] int or None.
    implementation: "mosaic" (the Mosaic GPU kernels); "xla" runs the same mapped arguments through tokamax's own
      XLA reference (for tests off GPU).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  t, s = q.shape[1], k.shape[1]
  segments = () if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  settings = dict(window=window, scale=scale, implementation=implementation)
  if q_positions is not None:
    run = functools.partial(_by_positions, **settings)
    return cudnn.first_order(run, _SECOND_ORDER)(q, k, v, q_positions, kv_positions, *segments)
  run = functools.partial(_blocked if uses_blocks(causal, window, t, s) else _whole, causal=causal, **settings)
  return cudnn.first_order(run, _SECOND_ORDER)(q, k, v, *segments)


def _call(q, k, v, mask, *, causal, window, scale, implementation):
  """`tokamax.dot_product_attention` with our causal/window mask on [B, T, ...] x [B, S, ...] and `mask` ([B, 1, T
  or 1, S] bool or None) on top."""
  import tokamax  # pylint: disable=g-import-not-at-top

  t, s = q.shape[1], k.shape[1]
  # T == S without a window is tokamax's plain causal mask, for which its kernels skip blocks past the diagonal
  # without per-row bounds.
  plain_causal = causal and t == s and (window is None or window >= s)
  window_size = None if plain_causal else local_window(causal=causal, window=window, t=t, s=s)
  return tokamax.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=plain_causal,
                                       local_window_size=window_size, implementation=implementation)


def _whole(q, k, v, *segments, **kwargs):
  mask = None
  if segments:
    q_ids, kv_ids = segments
    mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  return _call(q, k, v, mask, **kwargs)


def _by_positions(q, k, v, q_positions, kv_positions, *segments, window, scale, implementation):
  """Causal (and window) masks from explicit positions, as one dense mask; positions are non-negative, so the
  differences below cannot overflow int32."""
  q_pos = q_positions.astype(jnp.int32)[:, :, None]
  kv_pos = kv_positions.astype(jnp.int32)[:, None, :]
  mask = kv_pos <= q_pos
  if window is not None:
    mask = mask & (q_pos - kv_pos < window)
  if segments:
    q_ids, kv_ids = segments
    mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])
  return _call(q, k, v, mask[:, None], causal=False, window=None, scale=scale, implementation=implementation)


def _blocked(q, k, v, *segments, causal, window, scale, implementation):
  """`uses_blocks`' form: query block i of c positions against key blocks i - 1 and i, as a batch of B n calls
  with T = c, S = 2c; the end-aligned causal/window mapping then places query j of a block at position c + j."""
  b, t, hq, d = q.shape
  c = block_size(window)
  n = -(-t // c)
  blocks = lambda x: xla.split_blocks(x, c)
  flat = lambda x: x.reshape(b * n, *x.shape[2:])
  # Block 0's previous block lies before the sequence: its keys are hidden by a mask broadcast over the queries.
  before_start = (jnp.arange(n) == 0)[:, None] & (jnp.arange(2 * c) < c)[None, :]  # [n, 2c]
  mask = jnp.broadcast_to(~before_start[:, None, :], (b, n, 1, 2 * c))
  if segments:
    q_ids, kv_ids = segments
    mask = mask & (blocks(q_ids)[..., :, None] == xla.with_previous(blocks(kv_ids))[..., None, :])
  out = _call(flat(blocks(q)), flat(xla.with_previous(blocks(k))), flat(xla.with_previous(blocks(v))),
              flat(mask)[:, None], causal=causal, window=window, scale=scale, implementation=implementation)
  return out.reshape(b, n * c, hq, d)[:, :t]
