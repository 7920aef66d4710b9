"""The quantised matmul op: x @ W for a weight stored as int8 or packed int4 values with float32 scales per group of
inputs and output channel, scales applied after the product:

  y[..., n] = sum_g scale[g, n] * sum_{k in group g} x[..., k] * values[k, n]

values: int8 [G, rows, N] (int8: rows = group; int4 packed two per byte: rows = group / 2, low nibble input i and high
nibble input i + group / 2 of the group, as `ltm_jax.quantize.Int4Weight` stores them); scale [G, N].
Per-output-channel int8 is G = 1. The result has x's dtype; products accumulate in float32.
"""

from __future__ import annotations

import functools

import jax

from ltm_jax.ops import backend
from ltm_jax.ops.quant_matmul import pallas, xla

# The first entry is the reference.
AVAILABLE = ("xla", "pallas")
_BACKENDS = {"xla": xla.quant_matmul, "pallas": pallas.quant_matmul}

# cpu: xla (the Pallas kernel only runs interpreted there). gpu: pallas, the kernel that loads integer tiles and
# converts them in registers, chosen by design for decoding (reading weights bounds it) and not yet timed on a GPU.
# Shapes the kernel does not take (see `ltm_pallas.quant_matmul.supported`) get the reference under "auto".
AUTO = {"cpu": "xla", "gpu": "pallas"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "xla"}


def quant_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, packed: bool, impl: str = "auto") -> jax.Array:
  """x [..., K] @ the quantised weight (values int8 [G, rows, N], scale [G, N]; `packed`: int4) -> [..., N].

  impl: "auto" (the platform's choice, see AUTO), or one of AVAILABLE. Raises ValueError for mismatched shapes, and
  for impl="pallas" on shapes the kernel does not take."""
  groups, rows, n = values.shape
  k = x.shape[-1]
  if values.dtype != jax.numpy.int8 or scale.shape != (groups, n):
    raise ValueError(f"quant_matmul: values must be int8 [G, rows, N] and scale [G, N]; got {values.dtype} "
                     f"{values.shape} and {scale.shape}")
  if k != groups * rows * (2 if packed else 1):
    raise ValueError(f"quant_matmul: x has {k} inputs but the weight holds {groups} groups of {rows} "
                     f"{'packed ' if packed else ''}rows")
  # `packed` is bound here, not passed through: under "auto" the arguments become operands of
  # lax.platform_dependent, which would trace it, and the kernel takes it as a static argument.
  backends = {name: functools.partial(fn, packed=packed) for name, fn in _BACKENDS.items()}
  if impl == "auto" and not pallas.supported(k, n, groups, packed):
    backends = {"xla": backends["xla"]}
  run = backend.select("quant_matmul", impl, backends, AUTO if "pallas" in backends else {},
                       without_kernels=AUTO_WITHOUT_KERNELS)
  flat = x.reshape(-1, k)
  return run(flat, values, scale).reshape(*x.shape[:-1], n)
