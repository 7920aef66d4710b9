"""The memory-decay-integration (MDI) recurrence of MM-Rec: a gated, normalised, clipped recurrent state.

For every batch row, with precomputed per-token inputs gate_z_t (the gate's input term, bias included), z_t and the
decay gamma_t, and a keep mask mu_t (0 for padding):

  g_t = sigmoid(gate_z_t + h_{t-1} W_h)                          (the gate reads the previous state)
  u_t = (1 - g_t) h_{t-1} + g_t z_t + gamma_t h_{t-1}             (integration, plus the decayed state)
  h_t = clip(RMSNorm(u_t) * scale, -clip, clip)   if mu_t,  else h_{t-1}

The RMSNorm bounds each h_t's root mean square by max |scale| whatever the inputs, and the clip bounds every channel
even when a learned scale grows. The gate depends nonlinearly on h_{t-1}, so the recurrence is sequential (no
parallel scan exists; see adjoint.py). Accumulation is float32 (float64 for float64 inputs) whatever the input dtype.

Backends, equal to rounding: "scan" (per token, gradients by autodiff, the reference) and "adjoint" (the same loop
with a hand-written reverse loop that keeps only the gate's matmul sequential).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.mdi import adjoint, scan

# The first entry is the reference.
AVAILABLE = ("scan", "adjoint")
# Fastest per platform, forward+backward under jit (`python benchmarks/mmrec.py --section op`,
# benchmarks/results/mmrec-op-cpu.json). cpu: adjoint, 1.3-2.3x faster than scan by the best of 7 alternated runs at
# (B, T, D) = (32, 128, 128), (2, 2048, 64), (8, 512, 256). gpu: adjoint, whose loop holds one matmul per step
# against the scan's autodiff loop of several (chosen by that count, not by a GPU timing). One-token decoding steps
# take the scan.
AUTO = {"cpu": "adjoint", "gpu": "adjoint"}
EPS = 1e-6
CLIP = 100.0


def _check(gate_z, z, gamma, w_h, scale, h0, mask):
  if gate_z.ndim != 3 or z.shape != gate_z.shape or gamma.shape != gate_z.shape:
    raise ValueError(f"mdi: gate_z, z, gamma must all be [B, T, D]; got {gate_z.shape}, {z.shape}, {gamma.shape}")
  batch, _, width = gate_z.shape
  if w_h.shape != (width, width) or scale.shape != (width,) or h0.shape != (batch, width):
    raise ValueError(f"mdi: w_h must be [D, D], scale [D], h0 [B, D] with (B, D) = ({batch}, {width}); got "
                     f"{w_h.shape}, {scale.shape}, {h0.shape}")
  if mask is not None and mask.shape != gate_z.shape[:2]:
    raise ValueError(f"mdi: mask must be [B, T] = {gate_z.shape[:2]}; got {mask.shape}")
  if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (gate_z, z, gamma, w_h, scale, h0)):
    raise ValueError("mdi: gate_z, z, gamma, w_h, scale, h0 must be floating point")


def _compute_dtype(*xs):
  return jnp.result_type(jnp.float32, *(x.dtype for x in xs))


def mdi(
    gate_z: jax.Array,
    z: jax.Array,
    gamma: jax.Array,
    w_h: jax.Array,
    scale: jax.Array,
    h0: jax.Array,
    *,
    mask: jax.Array | None = None,
    eps: float = EPS,
    clip: float = CLIP,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
  """Runs the MDI recurrence over a sequence, starting from h0.

  Args:
    gate_z: [B, T, D] the gate's input term (W_gz z_t + bias), precomputed for the whole sequence.
    z: [B, T, D] the candidate state. gamma: [B, T, D] the decay (the layer passes values in (0, 1)).
    w_h: [D, D] the gate's recurrent weight (h_{t-1} @ w_h). scale: [D] the RMSNorm scale. h0: [B, D] h before the
      first token.
    mask: [B, T] bool, False where a token must leave h untouched (left padding), or None.
    eps: the RMSNorm epsilon. clip: the bound on |h|.
    impl: "auto", "scan" or "adjoint".

  Returns:
    hs [B, T, D] (h_t at every token; at a masked token, the h it kept) and h_T [B, D], both in the compute dtype:
    feeding h_T back continues the sequence, so two segments run one after the other equal their concatenation.

  Raises:
    ValueError: on mismatched shapes, non-float inputs, or an unknown impl.
  """
  eps, clip = float(eps), float(clip)
  backends = {"scan": lambda *args: scan.mdi(*args, eps=eps, clip=clip),
              "adjoint": lambda *args: adjoint.mdi(*args, eps, clip)}
  run = backend.select("mdi", impl, backends, AUTO, length=gate_z.shape[1] if gate_z.ndim > 1 else None)
  _check(gate_z, z, gamma, w_h, scale, h0, mask)
  dtype = _compute_dtype(gate_z, z, gamma, w_h, scale, h0)
  gate_z, z, gamma, w_h, scale, h0 = (x.astype(dtype) for x in (gate_z, z, gamma, w_h, scale, h0))
  keep = jnp.ones(gate_z.shape[:2], dtype) if mask is None else mask.astype(dtype)
  if gate_z.shape[1] == 0:
    return jnp.zeros(gate_z.shape, dtype), h0
  # Rows are independent: under a mesh each shard of rows runs the recurrence alone. Left to XLA's partitioner, a
  # layout splitting rows over two mesh axes and channels over a third gave wrong gradients.
  seq, row = ("batch", None, None), ("batch", None)
  return sharding.per_shard(run, (gate_z, z, gamma, keep, w_h, scale, h0),
                            in_axes=(seq, seq, seq, row, (None, None), (None,), row), out_axes=(seq, row),
                            sizes={"batch": gate_z.shape[0]})


def mdi_step(gate_z, z, gamma, w_h, scale, h, *, keep=None, eps: float = EPS, clip: float = CLIP) -> jax.Array:
  """One token of the recurrence for every row: gate_z, z, gamma [B, D], h [B, D] (h_{t-1}), keep [B] bool or None.
  Returns h_t [B, D] in the compute dtype. The same step the reference scans, for loops that make their inputs per
  token."""
  dtype = _compute_dtype(gate_z, z, gamma, w_h, scale, h)
  keep = jnp.ones(h.shape[:1], dtype) if keep is None else keep.astype(dtype)
  cast = lambda x: x.astype(dtype)
  return scan.step(cast(h), cast(gate_z), cast(z), cast(gamma), keep, cast(w_h), cast(scale), eps=eps, clip=clip)
