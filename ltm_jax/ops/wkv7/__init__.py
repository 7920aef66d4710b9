"""The RWKV-7 WKV op: a generalized delta rule with a matrix-valued state per head.

For every batch row and head, with S the [N, N] float32 state (row i = value index, column j = key index):

  sa_i   = sum_j S[i, j] a_j                        (the state before the token)
  S[i, j] = S[i, j] e^{w_j} + sa_i b_j + v_i k_j
  y_i    = sum_j S[i, j] r_j                        (the state after it)

RWKV-7 passes a = -kk and b = kk·a_lr with kk a unit key per head and a_lr in (0, 1), which keeps the transition
diag(e^w) + a b^T contractive; the op itself accepts any a, b. Accumulation is float32 whatever the input dtype.

Backends: "scan" (the sequential reference), "chunked" (exact chunked WY form in pure JAX, autodiff), "pallas"
(fused sequential forward and backward kernels, `pallas/wkv7.py`), "pallas_chunked" (the chunked WY form as
tensor-core kernels, `pallas/wkv7_chunked.py`, with the sequential kernels for decays beyond its range) and
"pallas_segmented" (the chunked kernels parallel over time, `pallas/wkv7_segmented.py`, for few rows and heads over
long sequences; "pallas_chunked" at the shapes its rule leaves alone, `pallas_segmented.segments`) and
"pallas_mgpu" (the chunked forward as a Pallas Mosaic GPU kernel for sm_90+, `pallas/wkv7_mgpu.py`, differentiated
through "chunked"; head sizes 64 and 128; not chosen by "auto": untimed on a GPU).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.wkv7 import chunked
from ltm_jax.ops.wkv7 import pallas
from ltm_jax.ops.wkv7 import pallas_chunked
from ltm_jax.ops.wkv7 import pallas_mgpu
from ltm_jax.ops.wkv7 import pallas_segmented
from ltm_jax.ops.wkv7 import scan



def _exact_for_every_decay(backend):
  """A backend exact for every w <= 0, which has no use for a caller's bound on w."""

  @functools.wraps(backend)
  def run(r, w, k, v, a, b, state, *, w_min=None):
    del w_min
    return backend(r, w, k, v, a, b, state)

  return run


# The first entry is the reference. Every backend takes the op's `w_min`; the chunked kernels' backends use it.
AVAILABLE = ("scan", "chunked", "pallas", "pallas_chunked", "pallas_segmented", "pallas_mgpu")
_BACKENDS = {"scan": _exact_for_every_decay(scan.wkv7), "chunked": _exact_for_every_decay(chunked.wkv7),
             "pallas": _exact_for_every_decay(pallas.wkv7), "pallas_chunked": pallas_chunked.wkv7,
             "pallas_segmented": pallas_segmented.wkv7, "pallas_mgpu": pallas_mgpu.wkv7}

# Fastest backend per platform for training-like shapes, forward+backward under jit, as measured by
# `python benchmarks/wkv7.py` (benchmarks/results/wkv7-<device>.json). cpu: scan, 1.2-2.6x faster than chunked
# forward+backward at (B, T, C, N) = (8, 256, 128, 32) and (4, 512, 256, 64) on 2 shared cores, and ~10x faster
# forward (the chunked form's pairwise decays cost L·N exponentials per token). gpu: pallas_segmented, which is
# pallas_chunked (the fastest of ours at every measured shape on one H100, bfloat16, forward+backward: 12.3 ms against
# the sequential kernels' 75.6 at (8, 4096, 4096, 64), 92.4 against 159 at N=128, 25.2 against 223 at
# (1, 32768, 4096, 64)) except where few rows and heads walk a long sequence (B·H·N/BV programs below the SM count,
# `pallas_segmented.segments`): there it took 17.3 ms against pallas_chunked's 24.6 at (1, 32768, 4096, 64), and
# within 2% of it at the other two shapes, where it runs the same kernels
# (benchmarks/results/wkv7-segmented-nvidia-h100-80gb-hbm3.json).
AUTO = {"cpu": "scan", "gpu": "pallas_segmented"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`):
# the chunked WY form in plain JAX, which keeps one state per chunk for its backward where scan keeps every token's.
AUTO_WITHOUT_KERNELS = {"gpu": "chunked"}

_NAMES = ("r", "w", "k", "v", "a", "b")


def scan_backward_bytes(batch: int, length: int, heads: int, size: int) -> int:
  """What differentiating the "scan" reference keeps for its backward pass: the float32 [N, N] state after every
  token of every row and head (B·T·H·N²·4 bytes; 64 GiB at (8, 4096, 4096, 128))."""
  return 4 * batch * length * heads * size * size


def _device_bytes() -> int | None:
  """The default device's memory limit, where the platform reports one (GPUs do; CPUs do not)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def empty_state(batch: int, heads: int, size: int) -> jax.Array:
  """The state before any token: zeros [B, H, N, N] float32."""
  return jnp.zeros((batch, heads, size, size), jnp.float32)


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array | None = None,
    *,
    impl: str = "auto",
    w_min: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Runs WKV-7 over a sequence, starting from `state`.

  Args:
    r: [B, T, H, N] receptance, any float dtype (all six inputs share the shape; dtypes may differ).
    w: [B, T, H, N] log-decay, <= 0 (the per-step decay factor is e^w; RWKV-7 passes -e^{...}).
    k: [B, T, H, N] keys.
    v: [B, T, H, N] values.
    a: [B, T, H, N] the delta rule's "removal" key (RWKV-7: -kk).
    b: [B, T, H, N] the delta rule's "replacement" key (RWKV-7: kk·a_lr).
    state: [B, H, N, N] float32 state before the first token (S[b, h, i, j], i = value index, j = key index), or
      None for zeros.
    impl: "auto" (the platform's fastest, see AUTO), or one of AVAILABLE.
    w_min: a static bound the caller guarantees, w >= w_min everywhere, or None (RWKV-7 layers pass -0.75: their w lies
      in (-e^{-1/2}, 0) by construction). The chunked kernels' backends ("pallas_chunked", "pallas_segmented",
      "pallas_mgpu") are exact for w down to a limit; with a bound at or above it they run their kernels without
      reading w to check it at run time (and without the conditional that check feeds). A w below a given bound
      makes those kernels overflow to inf/NaN. The other backends are exact for every w <= 0 and ignore it.

  Returns:
    y: [B, T, H, N] in v's dtype, and the [B, H, N, N] float32 state after the last token: feeding it back continues
    the sequence, so running two segments one after the other equals running their concatenation.

  Raises:
    ValueError: on mismatched shapes, non-float inputs, an unknown impl, or a w_min that is not a float <= 0.
  """
  run = backend.select("wkv7", impl, _BACKENDS, AUTO, length=k.shape[1] if k.ndim > 1 else None,
                       without_kernels=AUTO_WITHOUT_KERNELS)
  inputs = (r, w, k, v, a, b)
  if r.ndim != 4 or any(x.shape != r.shape for x in inputs):
    shapes = ", ".join(f"{n} {x.shape}" for n, x in zip(_NAMES, inputs))
    raise ValueError(f"wkv7: r, w, k, v, a, b must all be [B, T, H, N]; got {shapes}")
  if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in inputs):
    raise ValueError(f"wkv7: inputs must be floating point; got {', '.join(str(x.dtype) for x in inputs)}")
  if w_min is not None and (isinstance(w_min, bool) or not isinstance(w_min, (int, float)) or not w_min <= 0):
    raise ValueError(f"wkv7: w_min must be a float <= 0 (a bound on the log-decays) or None; got {w_min!r}")
  batch, length, heads, size = r.shape
  if backend.resolve("wkv7", impl, AVAILABLE, AUTO, length=length, without_kernels=AUTO_WITHOUT_KERNELS) == "scan":
    needed, limit = scan_backward_bytes(batch, length, heads, size), _device_bytes()
    if limit is not None and needed > limit:
      warnings.warn(f"wkv7: differentiating impl='scan' at (B, T, H, N) = {r.shape} keeps every token's state, "
                    f"{needed / 2**30:.1f} GiB, more than this device's {limit / 2**30:.1f} GiB; impl='pallas_chunked' "
                    f"keeps one state per chunk", stacklevel=2)
  if state is None:
    state = empty_state(batch, heads, size)
  elif state.shape != (batch, heads, size, size):
    raise ValueError(f"wkv7: state must be [B, H, N, N] = {(batch, heads, size, size)}; got {state.shape}")
  state = state.astype(jnp.float32)
  if length == 0:  # Nothing to run; the backends assume a first token.
    return jnp.zeros(v.shape, v.dtype), state
  # Heads are independent (each is a block of N channels), as are rows: both can be split over the mesh. The channel
  # axis is named "wkv" like the RWKV-7 layer's channel parameters, so the split follows theirs.
  btc, bc = ("batch", None, "wkv", None), ("batch", "wkv", None, None)
  bound = None if w_min is None else float(w_min)

  @functools.wraps(run)
  def run_bounded(*args):
    return run(*args, w_min=bound)

  return sharding.per_shard(run_bounded, inputs + (state,), in_axes=(btc,) * 6 + (bc,), out_axes=(btc, bc),
                            sizes={"batch": batch, "wkv": heads})
