"""Multi-head softmax attention with grouped key/value heads, causal and sliding-window masks, packed segments and
explicit positions for key/value caches.

Backends: "xla" (reference, any platform, every option; sliding windows much shorter than the sequence run
blockwise in O(T * window), `xla.local_attention`), "cudnn" (fused flash attention on NVIDIA GPUs, for the
calls `cudnn.unsupported_reason` accepts), "tokamax" (tokamax's Pallas Mosaic GPU flash attention for Hopper,
forward and backward kernels without Triton, for the calls `tokamax_mgpu.unsupported_reason` accepts, explicit
positions included; needs the optional tokamax package) and "pallas" (the flash-attention kernels of `ltm_pallas`,
the pallas/ folder, through the Triton lowering: every option but explicit positions; interpreted, so slow, off
GPU). `impl="auto"` is xla off GPU; on GPU it picks per shape class from `GPU_AUTO` among the fused backends that
accept the call (tokamax only on sm_90 and newer), and xla when none does (explicit positions without tokamax;
float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.attention import cudnn, pallas, tokamax_mgpu, xla
from ltm_pallas import backend as kernel_backend

IMPLS = ("xla", "cudnn", "pallas", "tokamax")
# Compiled for a GPU, "auto" resolves per call through `GPU_AUTO` (see `_auto_gpu`); elsewhere it is the xla
# reference.

# (mask kind, head dim) -> the fused backend `impl="auto"` prefers on GPU, for calls both cudnn and pallas accept.
# Mask kind: "causal", "window" (causal + a window shorter than S) or "full" (non-causal). Shape classes not listed
# prefer cudnn. On one H100 (bfloat16, benchmarks/attention.py's lengths) the Pallas kernel's forward+backward took
# 1.9-2.6x cuDNN's time under a causal mask at D=64, 1.4-2.0x at D=128, and 0.9-1.6x under a 256-token window, so
# cuDNN is preferred wherever it takes the call; pallas serves what cuDNN refuses (segment ids, causal T != S,
# float32, head dims that are not a multiple of 8 or too large).
# Where cuDNN refuses a call, the Triton-lowered Pallas kernels come next while this jax can compile them (their
# compiled tests passed on an H100 and an H200), then tokamax's Mosaic GPU kernels on sm_90 and newer (when
# installed): they serve the calls the Pallas kernels refuse (explicit positions) and every call once the Triton
# lowering is gone. tokamax's kernels have not run on a GPU here (`pytest -m gpu tests/ops/test_attention_tokamax.py`
# checks them); move "tokamax" ahead of "pallas" where they pass and measure faster. Neither is timed on a GPU yet.
# `python benchmarks/attention.py` on a GPU prints this table from its forward+backward timings ("suggested
# GPU_AUTO"); paste that here together with the results file it names.
GPU_AUTO = {
    ("causal", 64): "cudnn",
    ("causal", 128): "cudnn",
    ("window", 64): "cudnn",
    ("window", 128): "cudnn",
    ("full", 64): "cudnn",
    ("full", 128): "cudnn",
}

# The fused backends `_auto_gpu` tries, in this order, after the shape class's `GPU_AUTO` choice.
FALLBACK_ORDER = ("cudnn", "pallas", "tokamax")

SegmentIds = jax.Array | tuple[jax.Array, jax.Array]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    segment_ids: SegmentIds | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> jax.Array:
  """softmax(scale * q k^T + mask) v, per head; logits and softmax in float32.

  Positions: query i has position S - T + i and key j position j, i.e. the queries are the last T of the S keys'
  positions (plain self-attention when T == S; a cache-less call on the last T queries otherwise). `q_positions` and
  `kv_positions` replace both, so that a key/value cache can hold keys at their absolute positions. Positions only
  matter to the causal and window masks. A cache slot that holds no key must be invisible: give it a position larger
  than any query's, e.g. `jnp.iinfo(jnp.int32).max`. Positions must be non-negative.

  Masks (a key is visible when all that apply hold):
    causal: kv_pos <= q_pos.
    window=W (needs causal): q_pos - kv_pos < W, so with default positions query i sees keys i - W < j <= i.
    segment_ids: equal segment ids (packed sequences).
  A query that sees no key outputs zeros (and gets zero gradients), never NaN.

  Args:
    q: [B, T, Hq, D] float.
    k: [B, S, Hkv, D], q's dtype. Hq must be a multiple of Hkv; query head h reads key/value head h // (Hq // Hkv)
      (grouped-query attention; Hkv == 1 is multi-query attention).
    v: [B, S, Hkv, D], q's dtype.
    causal: apply the causal mask.
    window: sliding window length W >= 1, or None for no window. Needs causal=True.
    segment_ids: [B, T] int for self-attention (needs T == S), or a pair ([B, T], [B, S]) of query and key ids.
    q_positions: [B, T] int; given together with kv_positions, and only with causal=True.
    kv_positions: [B, S] int.
    scale: a static Python float multiplying the logits; None means D ** -0.5.
    impl: "auto", "xla", "cudnn", "pallas" or "tokamax". An explicit fused backend that cannot run the call raises
      ValueError (pallas refuses explicit positions, dtypes other than float16/bfloat16/float32 and head dims > 256;
      tokamax refuses float32 and head dims other than 64 and 128, and runs only where tokamax is installed).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  _check_qkv(q, k, v)
  b, t, _, d = q.shape
  s = k.shape[1]
  window = _check_window(window, causal)
  has_positions = _check_positions(q_positions, kv_positions, causal, b, t, s)
  q_segment_ids, kv_segment_ids = _split_segment_ids(segment_ids, b, t, s)
  scale = d**-0.5 if scale is None else float(scale)

  backend.resolve("attention", impl, IMPLS, {})  # A ValueError for an unknown impl.
  reasons = {
      "cudnn": lambda: _cudnn_unsupported_reason(q, k, causal, has_positions, q_segment_ids is not None),
      "pallas": lambda: pallas.unsupported_reason(d, q.dtype, has_positions=has_positions),
      "tokamax": lambda: tokamax_mgpu.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal,
                                                         has_positions=has_positions,
                                                         missing=tokamax_mgpu.missing_reason()),
  }
  if impl == "auto":  # xla unless compiled for a GPU, where the shape class picks (see _auto_gpu).
    # The shape-class choice (device queries included) only where a GPU compilation can happen.
    gpu = _auto_gpu(mask_kind(causal, window, s), d, reasons) if kernel_backend.may_compile_for_gpu() else "xla"
    names = {"xla": "xla", gpu: gpu}
  else:
    reason = reasons[impl]() if impl in reasons else None
    if reason is not None:
      raise ValueError(f"attention: impl={impl!r} cannot run this call: {reason}")
    names = {impl: impl}

  def runner(name):
    return lambda arrays: _run_backend(name, causal=causal, window=window, scale=scale, **arrays)

  run = backend.select("attention", impl, {n: runner(n) for n in names}, {"gpu": gpu} if impl == "auto" else {})

  # Rows and (groups of) heads are independent: under a mesh each device runs its block (ltm_jax/ops/sharding.py).
  # Query and key/value heads share one split, so each block keeps whole query groups with their key/value head.
  arrays = {"q": q, "k": k, "v": v, "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
            "q_positions": q_positions, "kv_positions": kv_positions}
  arrays = {key: x for key, x in arrays.items() if x is not None}
  heads, rows = ("batch", None, "heads", None), ("batch", None)
  in_axes = {key: heads if key in ("q", "k", "v") else rows for key in arrays}
  return sharding.per_shard(run, (arrays,), in_axes=(in_axes,), out_axes=heads,
                            sizes={"batch": b, "heads": k.shape[2]})


def impl_for(impl: str, *, positions: bool = False, segments: bool = False) -> str:
  """The backend a layer configured with `impl` gives a call with explicit positions (over a cache: segment-wise
  processing, decoding) or segment ids (left-padded prompts, masked time series): `impl` where it takes them, else
  "auto", which picks one that does (pallas takes no positions, cudnn neither positions nor segment ids). A model
  trained with either kernel still prefills and decodes; a language model's training calls have neither, so there
  an explicit kernel that cannot run them still raises."""
  refuses = {"pallas": positions, "cudnn": positions or segments}
  return "auto" if refuses.get(impl, False) else impl


def _run_backend(name: str, q, k, v, *, causal, window, scale, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_positions=None) -> jax.Array:
  """The chosen backend on (a shard of) checked inputs."""
  if name == "cudnn":
    return cudnn.attention(q, k, v, causal=causal, window=window, scale=scale)
  if name == "tokamax":
    return tokamax_mgpu.attention(q, k, v, causal=causal, window=window, scale=scale, q_segment_ids=q_segment_ids,
                                  kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_positions=kv_positions)
  if name == "pallas":
    return pallas.attention(q, k, v, causal=causal, window=window, q_segment_ids=q_segment_ids,
                            kv_segment_ids=kv_segment_ids, scale=scale)
  t, s = q.shape[1], k.shape[1]
  if uses_local_blocks(causal, window, t, s, has_positions=q_positions is not None):
    return xla.local_attention(q, k, v, window=window, scale=scale, q_segment_ids=q_segment_ids,
                               kv_segment_ids=kv_segment_ids)
  if q_positions is None:
    # Shaped [1, ...]: the same for every batch row, broadcast by the mask.
    q_positions = (jnp.arange(t, dtype=jnp.int32) + (s - t))[None]
    kv_positions = jnp.arange(s, dtype=jnp.int32)[None]
  mask = xla.visibility_mask(
      q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32), causal=causal, window=window,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  return xla.attention(q, k, v, mask=mask, scale=scale)


def uses_local_blocks(causal: bool, window: int | None, t: int, s: int, *, has_positions: bool) -> bool:
  """Whether the xla backend runs a call as blocked sliding-window attention (`xla.local_attention`): causal
  self-attention with default positions whose window is short enough that two key blocks per query block are
  fewer keys than the whole sequence."""
  return (causal and window is not None and not has_positions and t == s
          and 2 * xla.local_block_size(window) < s)


def mask_kind(causal: bool, window: int | None, s: int) -> str:
  """The mask part of a `GPU_AUTO` shape class: "window", "causal" or "full"."""
  if causal and window is not None and window < s:
    return "window"
  return "causal" if causal else "full"


def _auto_gpu(kind: str, head_dim: int, reasons, lowering: kernel_backend.GpuLowering | None = None,
              capability: tuple[int, int] | None = None) -> str:
  """The `GPU_AUTO` choice for the shape class if it accepts the call, else the first of `FALLBACK_ORDER` that
  does, else xla. tokamax is a candidate only on a target of sm_90 or newer (`capability`, by default the default
  device's: `ltm_pallas.backend.gpu_lowering(mosaic_gpu=True, ...)` says "mosaic_gpu"); a deviceless compilation,
  whose target is unknown, does not take it. Where this jax cannot compile the Triton-lowered Pallas kernels
  (`lowering`, by default `ltm_pallas.backend.gpu_lowering()`, is "xla") pallas is no candidate, which is said once
  per process."""
  lowering = kernel_backend.gpu_lowering() if lowering is None else lowering
  capability = kernel_backend.device_capability() if capability is None else capability
  mosaic_gpu = kernel_backend.gpu_lowering(mosaic_gpu=True, capability=capability).name == "mosaic_gpu"
  preferred = GPU_AUTO.get((kind, head_dim), "cudnn")
  for name in (preferred, *(n for n in FALLBACK_ORDER if n != preferred)):
    if name == "tokamax" and not mosaic_gpu:
      continue
    if name == "pallas" and lowering.name == "xla":
      kernel_backend.notice_once(lowering.notice, kernel_backend.SAID, stacklevel=4)
      continue
    if reasons[name]() is None:
      return name
  return "xla"


def _cudnn_unsupported_reason(q, k, causal, has_positions, has_segment_ids) -> str | None:
  reason, max_head_dim = cudnn.device_unsupported_reason()
  if reason is None:
    reason = cudnn.unsupported_reason(q.shape, k.shape, q.dtype, causal=causal, has_positions=has_positions,
                                      has_segment_ids=has_segment_ids, max_head_dim=max_head_dim)
  return reason


def _check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"attention: {name} must be [B, len, heads, head_dim], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"attention: {name} must be floating point, got {x.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"attention: k and v must have the same shape, got {k.shape} and {v.shape}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"attention: q {q.shape} and k {k.shape} must agree on batch and head_dim")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")


def _check_window(window: int | None, causal: bool) -> int | None:
  if window is None:
    return None
  window = backend.static_int("attention", "window", window, low=1)
  if not causal:
    raise ValueError("attention: window needs causal=True")
  return window


def _check_positions(
    q_positions: jax.Array | None, kv_positions: jax.Array | None, causal: bool, b: int, t: int, s: int
) -> bool:
  """Whether positions were given; raises ValueError on bad ones."""
  if q_positions is None and kv_positions is None:
    return False
  if q_positions is None or kv_positions is None:
    raise ValueError("attention: give both q_positions and kv_positions or neither")
  if not causal:
    # Positions mask nothing without causal; refusing them keeps empty cache slots from being attended silently.
    raise ValueError("attention: q_positions/kv_positions only take effect with causal=True")
  for name, x, length in (("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
    if x.shape != (b, length):
      raise ValueError(f"attention: {name} must have shape {(b, length)}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"attention: {name} must be integers, got {x.dtype}")
  return True


def _split_segment_ids(
    segment_ids: SegmentIds | None, b: int, t: int, s: int
) -> tuple[jax.Array | None, jax.Array | None]:
  """(query ids [B, T], key ids [B, S]) from either accepted form, checked."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, Sequence):
    if len(segment_ids) != 2:
      raise ValueError(f"attention: segment_ids pair must have 2 entries, got {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if t != s:
      raise ValueError(f"attention: a single segment_ids array needs T == S (got {t} and {s}); pass a pair")
    q_ids = kv_ids = segment_ids
  for name, x, length in (("query segment_ids", q_ids, t), ("key segment_ids", kv_ids, s)):
    if x.shape != (b, length):
      raise ValueError(f"attention: {name} must have shape {(b, length)}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"attention: {name} must be integers, got {x.dtype}")
  return q_ids, kv_ids
