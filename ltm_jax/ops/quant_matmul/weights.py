"""Quantised weights as the model stores them, and the product of activations with one.

`Int8Weight` (one scale per output channel) and `Int4Weight` (one scale per group of inputs and output channel,
two values per byte) are made by `ltm_jax.quantize`, which also says which parameters are quantised and
why. A layer whose kernel is stored quantised multiplies with `matmul`, which reads the integer values and applies
the scales after the product (`ltm_jax.ops.quant_matmul`), so no float copy of the weight is made.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops.quant_matmul import quant_matmul
from ltm_jax.ops.quant_matmul.xla import unpack_int4


class Int8Weight(NamedTuple):
  """A quantised weight. values: int8, the weight's shape; scale: float32, the weight's shape with size 1 on the
  contraction axes (one scale per output channel, and per layer when stacked). The weight is values * scale."""
  values: jax.Array
  scale: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=("packed", "scale"),
                   meta_fields=("shape", "perm", "group_size"))
@dataclasses.dataclass(frozen=True)
class Int4Weight:
  """A weight quantised to int4 in groups along its fan-in. With the weight laid out as [layers..., K, N] (`perm`
  orders the original axes as layers, contraction, output; K and N are their products) and G = K / group_size:
    packed: int8 [layers..., G, group_size / 2, N], two values per byte: low nibble input i, high nibble input
      i + group_size / 2 of the group (two's complement, values in [-7, 7]);
    scale: float32 [layers..., G, N], one per group and output channel.
  `shape` is the original weight's shape; the weight is `dequantize(self)`. A scanned layer sees one layer's slice
  of `packed` and `scale` under the stack's metadata: `matmul` needs only the arrays."""
  packed: jax.Array
  scale: jax.Array
  shape: tuple[int, ...]
  perm: tuple[int, ...]
  group_size: int


QuantizedWeight = Int8Weight | Int4Weight


def is_quantized(x: Any) -> bool:
  return isinstance(x, (Int8Weight, Int4Weight))


def dequantize(weight: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
  """One quantised weight back to its original shape in `dtype`."""
  if isinstance(weight, Int8Weight):
    return weight.values.astype(dtype) * weight.scale.astype(dtype)
  w = unpack_int4(weight.packed).astype(dtype) * weight.scale.astype(dtype)[..., None, :]
  permuted = tuple(weight.shape[i] for i in weight.perm)
  return jnp.transpose(w.reshape(permuted), np.argsort(weight.perm))


def matmul_operands(weight: QuantizedWeight) -> tuple[jax.Array, jax.Array, bool]:
  """A quantised weight of one layer (no stacked axes) as `ltm_jax.ops.quant_matmul` takes it: (values int8
  [G, rows, N], scale float32 [G, N], packed), for x [..., K] with K its contraction axes flattened in order."""
  if isinstance(weight, Int4Weight):
    if len(weight.packed.shape) != 3:
      raise ValueError(f"matmul_operands takes one layer's weight, got packed values of shape {weight.packed.shape}")
    return weight.packed, weight.scale, True
  contract = tuple(i for i, size in enumerate(weight.scale.shape) if size == 1)
  perm = contract + tuple(i for i in range(weight.values.ndim) if i not in contract)
  fan_in = math.prod(weight.values.shape[i] for i in contract)
  values = jnp.transpose(weight.values, perm).reshape(1, fan_in, -1)
  return values, weight.scale.reshape(1, -1), False


def matmul(x: jax.Array, weight: QuantizedWeight, n_in: int, out_shape: tuple[int, ...], impl: str = "auto"
           ) -> jax.Array:
  """x [..., in...] (its last `n_in` axes contracted, in the weight's input-axis order) @ one layer's quantised
  weight [in..., out...] -> [..., *out_shape] in x's dtype, scales applied after the product."""
  values, scale, packed = matmul_operands(weight)
  flat = x.reshape(*x.shape[:x.ndim - n_in], -1)
  return quant_matmul(flat, values, scale, packed=packed, impl=impl).reshape(*flat.shape[:-1], *out_shape)
