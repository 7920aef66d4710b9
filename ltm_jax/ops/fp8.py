"""FP8 matrix products for training: e4m3 operands forward, e5m2 gradients backward, current per-tensor scaling.

`dot_general` has `jax.lax.dot_general`'s signature. Each operand x is rounded to float8_e4m3fn after scaling by
its own absolute maximum (scale = max|x| / 448, so the largest entry lands on e4m3's largest finite value), the
product runs on the rounded values, and the gradient arriving at the output is rounded to float8_e5m2 the same way
(scale = max|g| / 57344) before either backward product. The operands' rounding has a straight-through gradient
(identity): the backward products multiply the rounded gradient by the rounded operands, as FP8 training on tensor
cores does. The rounding itself is Flax's (`flax.linen.fp8_ops.qdq`: divide by the scale, clip, convert to the
8-bit type, convert back, multiply by the scale).

Emulated anywhere: the values are rounded to FP8 and multiplied in the operands' dtype. On an H100, XLA's GEMM
rewriter fuses a convert-from-FP8-times-scale into the product and runs an FP8 cuBLASLt GEMM.

Current scaling (each call measures its own operands) rather than delayed scaling (a history of past maxima carried
as state between steps, Flax's `Fp8DotGeneralOp`): it needs no state threaded through the optimizer and the latent
inner loop, and an outlier in this step cannot overflow a scale fitted to earlier steps. It costs one reduction
over each operand per product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

# XLA's GPU GEMM rewriter makes the rounded operands an FP8 cuBLASLt GEMM only when Triton has not taken the GEMM
# first: compiled for an H100, a small_rwkv7 FP8 train step has 0 FP8 GEMMs with the default flags and 142 with this
# one (benchmarks/results/fp8-aot-h100.json).
GPU_XLA_FLAG = "--xla_gpu_enable_triton_gemm=false"


def gpu_flag_warning(platform: str, xla_flags: str) -> str | None:
  """One line saying FP8 products compiled for `platform` under `xla_flags` get no FP8 tensor cores, else None."""
  if platform != "gpu" or GPU_XLA_FLAG in xla_flags.split():
    return None
  return (f"model.fp8=true on a GPU without XLA_FLAGS={GPU_XLA_FLAG}: XLA fuses the FP8 rounding into bfloat16 "
          f"Triton GEMMs, so no FP8 tensor core runs; set it in the environment before JAX starts")


def scale_for(x: jax.Array, dtype) -> jax.Array:
  """max|x| / (dtype's largest finite value) as a float32 scalar; 1 when x is all zeros. When x holds an infinity
  or a NaN the scale is that max (inf or NaN), so the whole rounded x is NaN: the clip to the FP8 range would
  otherwise make an overflow finite, hiding it from loss scaling and the divergence checks."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return jnp.where(amax == 0, 1.0, amax / float(jnp.finfo(dtype).max))


def round_to(x: jax.Array, dtype) -> jax.Array:
  """x rounded to the FP8 `dtype` under its current scale, back in x's dtype."""
  return fp8_ops.qdq(x, dtype, scale_for(x, dtype), x.dtype)


@jax.custom_vjp
def _operand(x: jax.Array) -> jax.Array:
  return round_to(x, E4M3)


def _operand_fwd(x):
  return round_to(x, E4M3), None


def _operand_bwd(_, g):
  return (g,)


_operand.defvjp(_operand_fwd, _operand_bwd)


@jax.custom_vjp
def _output(y: jax.Array) -> jax.Array:
  return y


def _output_fwd(y):
  return y, None


def _output_bwd(_, g):
  return (round_to(g, E5M2),)


_output.defvjp(_output_fwd, _output_bwd)


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs) -> jax.Array:
  """`jax.lax.dot_general` of the e4m3-rounded operands; its output's gradient is rounded to e5m2."""
  y = jax.lax.dot_general(_operand(lhs), _operand(rhs), dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type, **kwargs)
  return _output(y)
