"""The RWKV-4 WKV op: a per-channel exponentially decayed, key-weighted average of values.

For every batch row and channel, with a_0, b_0 the incoming state:

  y_t = (a_{t-1} + e^{u+k_t}·v_t) / (b_{t-1} + e^{u+k_t})
  a_t = e^w·a_{t-1} + e^{k_t}·v_t
  b_t = e^w·b_{t-1} + e^{k_t}

The state is stored as (num, den, max) with a = num·e^max and b = den·e^max, the running-max trick of the official
RWKV-4 CUDA kernel, so nothing overflows for any T, key or decay. Accumulation is float32 whatever the input dtype.
A token of weight 0 (k far below every log-scale) on an empty state has y_t = 0 / 0: every backend gives 0 there,
with finite gradients, so left padding ahead of a row's first token can be masked out of a loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.wkv4 import associative, pallas, scan

# A log-scale far below any real one but finite: e^{EMPTY_MAX - x} is exactly 0 and no inf - inf can make a NaN.
EMPTY_MAX = -1e38

# The first entry is the reference.
AVAILABLE = ("scan", "associative", "pallas")
_BACKENDS = {"scan": scan.wkv4, "associative": associative.wkv4, "pallas": pallas.wkv4}

# Fastest backend per platform for training-like shapes, forward+backward under jit, as measured by
# `python benchmarks/wkv.py` (benchmarks/results/wkv4-<device>.json). cpu: scan, 3-4x faster than associative at
# B=8..32, T=256, C=128..512 on 2 cores (a CPU runs the sequential loop well, and the log-depth scan only adds
# work); pallas runs interpreted on a CPU and is only there to be checked. gpu: pallas, the fused kernels (reading
# k, v once forward and k, v, dy once backward, versus the associative scan's O(log T) passes): on one H100 at
# (8, 4096, 4096) they take 0.99 / 4.09 ms forward / forward+backward in float32 where associative took 5.7 / 20.9,
# and 0.64 / 3.52 ms in bfloat16 against 4.9 / 30.3 (benchmarks/results/wkv4-unrolled-nvidia-h100-80gb-hbm3.json,
# benchmarks/results/logs-h100-2026-11-25/wkv4.log).
AUTO = {"cpu": "scan", "gpu": "pallas"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "associative"}

# On a GPU with few rows x channels, "auto" is associative instead. The kernels run one thread per (row, channel)
# through the T tokens in order, so their time follows T whatever B·C is, while the associative scan's follows the
# element count (30.3 and 33.9 ms at (8, 4096, 4096) and (1, 65536, 2048), 134 M elements each). With the forward
# before its unrolling (1.3-1.4 us a token forward+backward: 5.3 ms at (8, 4096, 4096), 93.3 ms at (1, 65536, 2048),
# bfloat16) the two were equal at B·C ~ 1.4 us / (33.9 ms / 134 M) ~ 5.5 k, interpolated, not measured near it.
# The unrolled forward takes 0.86 us a token forward+backward at (8, 4096, 4096); the time-parallel path that serves
# few channels has not been timed with it, so the threshold stays where it was measured: on the associative side
# of the crossing, if anything.
GPU_PALLAS_MIN_CHANNELS = 6144


class Wkv4State(NamedTuple):
  """The recurrent state after some tokens, each [B, C] float32: a = num·e^max, b = den·e^max."""
  num: jax.Array
  den: jax.Array
  max: jax.Array


def empty_state(batch: int, channels: int) -> Wkv4State:
  """The state before any token: a = b = 0."""
  zeros = jnp.zeros((batch, channels), jnp.float32)
  return Wkv4State(zeros, zeros, jnp.full((batch, channels), EMPTY_MAX, jnp.float32))


def wkv4(
    w: jax.Array,
    u: jax.Array,
    k: jax.Array,
    v: jax.Array,
    state: Wkv4State | tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    impl: str = "auto",
) -> tuple[jax.Array, Wkv4State]:
  """Runs WKV over a sequence, starting from `state`.

  Args:
    w: [C] per-channel log-decay, negative (RWKV-4 passes -exp(time_decay)).
    u: [C] per-channel bonus of the current token (RWKV-4's time_first).
    k: [B, T, C] keys, any float dtype.
    v: [B, T, C] values, any float dtype.
    state: the state before the first token, (num, den, max) each [B, C]; None is `empty_state`. A state whose den
      is 0 must have max = EMPTY_MAX (or another value far below every u + k).
    impl: "auto" (the platform's fastest, see AUTO and GPU_PALLAS_MIN_CHANNELS), or one of AVAILABLE.

  Returns:
    y: [B, T, C] in v's dtype, and the Wkv4State after the last token: feeding it back continues the sequence, so
    running two segments one after the other equals running their concatenation.

  Raises:
    ValueError: on mismatched shapes, non-float keys or values, or an unknown impl.
  """
  few_channels = k.ndim == 3 and k.shape[0] * k.shape[2] < GPU_PALLAS_MIN_CHANNELS
  auto = {**AUTO, "gpu": "associative"} if few_channels else AUTO
  run = backend.select("wkv4", impl, _BACKENDS, auto, length=k.shape[1] if k.ndim > 1 else None,
                       without_kernels=AUTO_WITHOUT_KERNELS)
  if k.ndim != 3 or v.shape != k.shape:
    raise ValueError(f"wkv4: k and v must both be [B, T, C]; got k {k.shape}, v {v.shape}")
  if not (jnp.issubdtype(k.dtype, jnp.floating) and jnp.issubdtype(v.dtype, jnp.floating)):
    raise ValueError(f"wkv4: k and v must be floating point; got {k.dtype}, {v.dtype}")
  batch, _, channels = k.shape
  if w.shape != (channels,) or u.shape != (channels,):
    raise ValueError(f"wkv4: w and u must be [C] = ({channels},); got w {w.shape}, u {u.shape}")
  if state is None:
    state = empty_state(batch, channels)
  elif len(state) != 3 or any(s.shape != (batch, channels) for s in state):
    shapes = [getattr(s, "shape", s) for s in state]
    raise ValueError(f"wkv4: state must be (num, den, max), each [B, C] = {(batch, channels)}; got {shapes}")
  if k.shape[1] == 0:  # Nothing to scan; the backends' slicing assumes a first token.
    return jnp.zeros(k.shape, v.dtype), Wkv4State(*(jnp.asarray(s, jnp.float32) for s in state))
  y, new_state = sharding.per_shard(
      _run(run), (w, u, k, v, tuple(state)),
      in_axes=(("wkv",), ("wkv",), _BTC, _BTC, (_BC,) * 3), out_axes=(_BTC, (_BC,) * 3),
      sizes={"batch": batch, "wkv": channels})
  return y, Wkv4State(*new_state)


# Logical axes for the mesh (ltm_jax/ops/sharding.py): rows and channels are independent, so both can be split.
_BTC, _BC = ("batch", None, "wkv"), ("batch", "wkv")


def _run(backend_fn):
  def run(w, u, k, v, state):
    y, new_state = backend_fn(w, u, k, v, state)
    return y, tuple(new_state)
  return run
