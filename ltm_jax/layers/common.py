"""Shared building blocks: logically partitioned initialisers, dense layers and norms.

Logical axis names used by every parameter (the mesh config's rules, ltm_jax.parallel.mesh.rules, map them to mesh
axes):
  vocab, embed, heads, kv_heads, head_dim, mlp, wkv (RWKV-4 channels), norm, and embed_out (the output axis of a
  square d_model x d_model gate, named apart from `embed` so the two axes can map to different mesh axes), and lora (the
  narrow inner axis of RWKV-7's low-rank projections, meant to stay replicated), and layers (the leading axis that
  model.scan_layers stacks the scanned blocks' parameters along; meant to stay unsharded), memory_in and memory_out (the
  Titans memory MLP's weight axes), conv (the taps of a short convolution) and latent (the latent vectors of the
  amortised posterior encoder's queries).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.ops import fp8
from ltm_jax.ops.quant_matmul import weights as quant_weights

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "wkv", "norm", "embed_out", "lora",
                "layers", "memory_in", "memory_out", "conv", "latent")


def init(std: float, axes: Sequence[str]):
  """Normal(0, std) initialiser annotated with logical axis names."""
  return nn.with_logical_partitioning(nn.initializers.normal(std), tuple(axes))


class Dense(nn.DenseGeneral):
  """nn.DenseGeneral (no bias, no batch dims) whose kernel may be stored quantised (an Int8Weight or Int4Weight in
  the parameters, left there by `ltm_jax.quantize.dequantize_params(keep_kernels=...)`): then the product
  reads the integer values and applies the scales after it (`ltm_jax.ops.quant_matmul`)."""

  def __call__(self, inputs):
    stored = self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
    if not quant_weights.is_quantized(stored):
      return super().__call__(inputs)
    n_in = len(self.axis) if isinstance(self.axis, Sequence) else 1
    features = tuple(self.features) if isinstance(self.features, Sequence) else (self.features,)
    return quant_weights.matmul(inputs.astype(self.dtype or inputs.dtype), stored, n_in, features)


def plain_kernels(module: nn.Module, names: Sequence[str], use_fp8: bool):
  """The kernels of `module`'s sub-layers `names` ([in, out] arrays) when every one exists as a plain array and the
  projections are not FP8, else None: while initialising (the `Dense` calls create them), quantised kernels and FP8
  take each projection through its `Dense`."""
  if use_fp8 or module.is_initializing():
    return None
  params = module.variables.get("params", {})
  kernels = tuple(nn.meta.unbox(params.get(name, {}).get("kernel")) for name in names)
  if any(k is None or quant_weights.is_quantized(k) for k in kernels):
    return None
  return kernels


def projection_dot_general(use_fp8: bool):
  """The dot_general of a projection: FP8's (`ltm_jax.ops.fp8`) when `use_fp8`, else None (lax.dot_general). The
  layers take it from their `fp8` attribute, which the model sets from model.fp8 in the blocks' layers."""
  return fp8.dot_general if use_fp8 else None


def dense(features, axes: Sequence[str], std: float, dtype, name: str, in_axis=-1, fp8: bool = False) -> Dense:
  """A bias-free projection whose kernel carries the logical axes `axes` (input axes first); with `fp8` it
  multiplies in FP8 (`ltm_jax.ops.fp8`)."""
  return Dense(features, axis=in_axis, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
               dot_general=projection_dot_general(fp8),
               # rules=(): flax checks the kernel's shape on its flat 2-D initial value, where a rank-3
               # constraint would fail; parameters are placed by ltm_jax.parallel, not by this box.
               kernel_init=nn.with_logical_partitioning(nn.initializers.normal(std), tuple(axes), rules=()),
               name=name)


def norm(kind: str, eps: float, dtype, name: str) -> nn.Module:
  """RMSNorm or LayerNorm over the last axis, computed in float32 (flax upcasts), output in `dtype`."""
  scale = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
  if kind == "rmsnorm":
    return nn.RMSNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32, scale_init=scale, name=name)
  bias = nn.with_logical_partitioning(nn.initializers.zeros, ("norm",))
  return nn.LayerNorm(epsilon=eps, dtype=dtype, param_dtype=jnp.float32, scale_init=scale, bias_init=bias, name=name)


def depth_ratios(layer: int, n_layers: int) -> tuple[float, float]:
  """(0 -> 1 across depth, 1 -> almost 0 across depth): the RWKV-4 and RWKV-7 initialisation schedule."""
  return layer / max(n_layers - 1, 1), 1.0 - layer / n_layers


def token_shift(x, last):
  """The previous token's input at every position: [B, T, C] from x and `last` [B, C] (the token before x)."""
  return jnp.concatenate([last[:, None].astype(x.dtype), x[:, :-1]], axis=1)


def hold_last(x, last, valid):
  """x [B, T, C] with its padding (valid [B, T] False; None: no padding) replaced by `last` [B, C], the row's input
  before the chunk. Left padding then repeats the previous input, so the first real token's token shift reads
  exactly what it would read without the padding."""
  if valid is None:
    return x
  return jnp.where(valid[..., None], x, last[:, None].astype(x.dtype))


def shift_inputs(x, last, valid):
  """The two inputs a token-shift mix interpolates between: (x with its padding holding `last`, as `hold_last`
  makes it; the previous token's input at every position of that, `token_shift`)."""
  x = hold_last(x, last, valid)
  return x, token_shift(x, last)


def start_token_shift(x, state, empty, valid):
  """The start of a layer that carries its last input token (`state.last_x`, [B, C]): (`state`, or `empty(B, C)`
  when it is None; then the two inputs `shift_inputs` makes from x [B, T, C] and that last token)."""
  if state is None:
    state = empty(x.shape[0], x.shape[-1])
  return (state, *shift_inputs(x, state.last_x, valid))
