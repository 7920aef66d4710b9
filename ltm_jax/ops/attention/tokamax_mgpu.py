"""Flash attention on Hopper by tokamax's Pallas Mosaic GPU kernels (`tokamax.dot_product_attention`,
implementation "mosaic"): forward and backward kernels for sm_90, no Triton.

tokamax is an optional dependency (`pip install tokamax`, which needs jax >= 0.11.1 and Python >= 3.12); without it
this backend refuses every call and `impl="auto"` never picks it. Its kernels choose their code by the default
device (sm_80, sm_90 or sm_100), so they run where that device is the GPU being compiled for.

Masks map onto tokamax's `local_window_size=(before, after)`, which keeps keys i - before <= j <= i + after for
query index i: ours keep j <= i + S - T (causal, end-aligned) and j > i + S - T - W (window W). Segment ids become a
dense [B, 1, T, S] boolean mask, which the kernels read tile by tile: O(B T S) bytes of memory traffic and storage,
where the index masks cost nothing. Explicit positions (key/value caches) and float32 inputs are not taken (the
kernels' backward takes float16/bfloat16 only); head dims are those compiled for sm_90a (`HEAD_DIMS`).
Like every fused backend it is differentiable once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp

from ltm_jax.ops.attention import cudnn
from ltm_pallas import backend as kernel_backend

_DTYPES = (jnp.float16, jnp.bfloat16)
# The head dims whose forward and backward kernels were compiled for sm_90a (docs/kernels.md, attention on Hopper).
HEAD_DIMS = (64, 128)
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
    has_positions: bool,
    missing: str | None = None,
) -> str | None:
  """Why tokamax's kernels cannot run this call (a sentence), or None if they can. `missing` is `missing_reason()`'s
  answer (passed in so that the argument checks are tested without the package)."""
  t, d = q_shape[1], q_shape[3]
  s = kv_shape[1]
  if missing is not None:
    return missing
  if has_positions:
    return "explicit q_positions/kv_positions are not mapped onto tokamax's masks; impl='xla' takes them"
  if jnp.dtype(dtype) not in [jnp.dtype(x) for x in _DTYPES]:
    return f"tokamax's Mosaic GPU backward takes float16 or bfloat16, got {jnp.dtype(dtype)}"
  if d not in HEAD_DIMS:
    return f"impl='tokamax' takes head dims {HEAD_DIMS} (those compiled for sm_90a), got {d}"
  if causal and t > s:
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
    implementation: "mosaic" (the Mosaic GPU kernels); "xla" runs the same mapped arguments through tokamax's own
      XLA reference (for tests off GPU).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  import tokamax  # pylint: disable=g-import-not-at-top

  t, s = q.shape[1], k.shape[1]
  window_size = local_window(causal=causal, window=window, t=t, s=s)
  # T == S without a window is tokamax's plain causal mask, for which its kernels skip blocks past the diagonal
  # without per-row bounds.
  plain_causal = causal and t == s and (window is None or window >= s)
  kwargs = dict(scale=scale, is_causal=plain_causal, local_window_size=None if plain_causal else window_size,
                implementation=implementation)

  def call(q, k, v, *segments):
    mask = None
    if segments:
      q_ids, kv_ids = segments
      mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    return tokamax.dot_product_attention(q, k, v, mask=mask, **kwargs)

  segments = () if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  return cudnn.first_order(call, _SECOND_ORDER)(q, k, v, *segments)
