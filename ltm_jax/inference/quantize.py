"""Symmetric, per-output-channel, weight-only int8 quantisation of the LM's parameters, for serving.

Every matmul weight W becomes an `Int8Weight`: int8 `values` and a float32 `scale` with one entry per output channel
(kept dims of size 1 over the contraction axes), so W ~ values * scale. The scale of a channel is max|W| over its
contraction axes / 127: a channel with large weights cannot wash out its neighbours, as it would with one scale per
tensor. Activations stay in floating point: `dequantize_params` runs inside the jitted forward pass, so the int8
values are what sits in device memory between calls and the matmuls see the dequantised weights.

Which leaves are matmul weights, and over which axes they contract, is read from their logical axis names (see
`ltm_jax.layers.common` and `model.param_axes`), by one rule (`quantization_plan`):

  1. Leading "layers" axes (the scanned stack) are a batch of independent weights: never reduced over, so every
     layer gets its own scales. They are set aside, and the rest of the rule looks at the remaining "body" axes.
  2. A leaf whose body has fewer than 2 axes is a vector (norm scales and biases, RWKV token-shift mixes, decays,
     bonuses, group-norm affines...): kept in float32.
  3. The body's axes are grouped into logical features: one axis each, except that "head_dim" continues a "heads" or
     "kv_heads" axis just before it (a multi-head width stored split, as `dense((heads, head_dim), ...)` makes it).
     A matmul kernel has exactly two features, [input, output]: `dense()` lists the input axes first, and every other
     projection (RWKV-7's `_projection` kernels, its LoRA `*_down` [embed, lora] and `*_up` [lora, wkv] used as
     `x @ W`, the untied head [embed, vocab]) follows the same order. The input feature is contracted, so the scale
     is per output channel: q/k/v [embed, heads, head_dim] contract axis 0; `out` [heads, head_dim, embed] contracts
     axes 0 and 1.
  4. Exception: a leaf whose first axis is "vocab" is a lookup table (the token embedding, read by a gather, not a
     matmul). It is kept in float32, unless no other leaf has "vocab" as its output feature: then the embeddings are
     tied, the table is also the LM head (`x @ E.T`, one output channel per vocabulary row), and it is quantised per
     vocabulary row, which is also the right granularity for the gather (each row is dequantised with its own scale).
  5. Any other floating-point leaf with 2 or more body axes (more than two features, missing or unnamed axes, a
     "layers" axis that is not leading) raises a ValueError: a new weight is never silently left unquantised or
     quantised along the wrong axes. A new layer whose kernels follow `dense()`'s convention is covered by rule 3.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.model import LAYER_AXIS

QMAX = 127  # Symmetric range [-127, 127]: -128 is unused, so negating a weight never overflows.
HEAD_AXES = ("heads", "kv_heads")  # Axes that "head_dim" extends into one logical feature.
VOCAB_AXIS = "vocab"


class Int8Weight(NamedTuple):
  """A quantised weight. values: int8, the weight's shape; scale: float32, the weight's shape with size 1 on the
  contraction axes (one scale per output channel, and per layer when stacked). The weight is values * scale."""
  values: jax.Array
  scale: jax.Array


def _path_name(path) -> str:
  """A tree path as "block_0/mixer/q/kernel" (for plans and error messages)."""
  return "/".join(str(getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))) for entry in path)


def _features(names: Sequence[str]) -> list[list[int]]:
  """Axis indices grouped into logical features (rule 3): ("heads", "head_dim", "embed") -> [[0, 1], [2]]."""
  groups: list[list[int]] = []
  for i, name in enumerate(names):
    if name == "head_dim" and groups and names[groups[-1][-1]] in HEAD_AXES:
      groups[-1].append(i)
    else:
      groups.append([i])
  return groups


def _classify(name: str, leaf: Any, spec: Any) -> list[list[int]] | None:
  """Rules 1, 2, 3 and 5 for one leaf: its [input, output] features as axis indices (counting the stacked layer
  axes), or None for a kept vector or non-float leaf. The vocabulary exception (rule 4) needs the whole tree and is
  left to the caller."""
  shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    return None
  names = tuple(spec) if spec is not None else ()
  stacked = 0
  while stacked < len(names) and names[stacked] == LAYER_AXIS:
    stacked += 1
  if len(shape) - stacked < 2 and len(names) in (0, len(shape)):
    return None
  if len(names) != len(shape) or not all(isinstance(n, str) for n in names):
    raise ValueError(f"cannot quantise {name}: shape {shape} needs one logical axis name per axis, got {spec!r}")
  body = names[stacked:]
  if LAYER_AXIS in body:
    raise ValueError(f"cannot quantise {name}: axes {names} have a {LAYER_AXIS!r} axis that is not leading")
  features = [[stacked + i for i in group] for group in _features(body)]
  if len(features) != 2:
    raise ValueError(f"cannot quantise {name}: axes {names} do not split into one input and one output feature "
                     f"(kernels list their input axes first, as layers.common.dense does); give it logical axes the "
                     f"rule in ltm_jax.inference.quantize understands")
  return features


def quantization_plan(params, axes) -> dict[str, tuple[int, ...] | None]:
  """For every leaf of `params` (arrays or ShapeDtypeStructs), keyed by its path ("block_0/mixer/q/kernel"): the
  axes a quantised weight is reduced over (its contraction axes), or None for a leaf kept as it is. `axes` is
  `model.param_axes(cfg, latent)` (or any tree with params' structure whose leaves are tuples of logical axis names).
  Raises ValueError for a floating-point leaf of 2 or more (non-layer) axes that the rule cannot classify."""
  classified: dict[str, tuple[list[list[int]] | None, tuple[str, ...]]] = {}

  def visit(path, leaf, spec):
    name = _path_name(path)
    classified[name] = (_classify(name, leaf, spec), tuple(spec) if spec is not None else ())

  jax.tree_util.tree_map_with_path(visit, params, axes)
  is_table = lambda features, names: names[features[0][0]] == VOCAB_AXIS
  has_head = any(features is not None and not is_table(features, names)
                 and any(names[i] == VOCAB_AXIS for i in features[1])
                 for features, names in classified.values())
  plan = {}
  for name, (features, names) in classified.items():
    if features is None:
      plan[name] = None
    elif is_table(features, names):  # Rule 4: a gather table, and the head when tied.
      plan[name] = None if has_head else tuple(features[1])
    else:
      plan[name] = tuple(features[0])
  return plan


def quantize(weight: jax.Array, contract: Sequence[int]) -> Int8Weight:
  """Symmetric int8 quantisation of `weight` with one scale per slice over the `contract` axes: scale = max|W| /
  127 over them (1 for an all-zero channel, whose values are then all 0), values = round(W / scale) in [-127, 127]."""
  w = jnp.asarray(weight, jnp.float32)
  absmax = jnp.max(jnp.abs(w), axis=tuple(contract), keepdims=True)
  scale = jnp.where(absmax > 0, absmax / QMAX, 1.0).astype(jnp.float32)
  values = jnp.clip(jnp.round(w / scale), -QMAX, QMAX).astype(jnp.int8)
  return Int8Weight(values, scale)


def quantize_params(params, axes):
  """`params` with every matmul weight replaced by an Int8Weight (per output channel, per layer when stacked) and
  every other leaf unchanged (the same objects); see the module docstring for which leaves are matmul weights.
  `axes`: as `model.param_axes` gives them. All weights are quantised by one compiled computation; run it once,
  outside jit, and feed the result to a jitted function that calls `dequantize_params`."""
  plan = quantization_plan(params, axes)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  contractions = [plan[_path_name(path)] for path, _ in leaves]
  chosen = [(i, contract) for i, contract in enumerate(contractions) if contract is not None]
  quantized = _quantize_all([leaves[i][1] for i, _ in chosen], tuple(contract for _, contract in chosen))
  out = [leaf for _, leaf in leaves]
  for (i, _), weight in zip(chosen, quantized):
    out[i] = weight
  return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_all(weights: list, contractions: tuple[tuple[int, ...], ...]) -> list[Int8Weight]:
  """One compilation for the whole model, rather than eager ops compiled once per distinct weight shape."""
  return [quantize(w, contract) for w, contract in zip(weights, contractions)]


def _is_quantized(x) -> bool:
  return isinstance(x, Int8Weight)


def has_int8_weights(tree) -> bool:
  """Whether any leaf of `tree` is an Int8Weight."""
  return any(_is_quantized(leaf) for leaf in jax.tree.leaves(tree, is_leaf=_is_quantized))


def dequantize_params(tree, dtype=jnp.float32):
  """The inverse of `quantize_params`: every Int8Weight -> values * scale in `dtype` ([same shape as the weight]),
  other leaves unchanged. Call it inside jit, so only the int8 values and scales are device-resident inputs and
  the dequantised weights are temporaries of the compiled computation."""
  def convert(x):
    return x.values.astype(dtype) * x.scale.astype(dtype) if _is_quantized(x) else x
  return jax.tree.map(convert, tree, is_leaf=_is_quantized)


def param_bytes(tree) -> int:
  """Bytes of every array leaf (an Int8Weight counts its int8 values at 1 byte each plus its float32 scales), for
  reporting the memory a quantised model saves. Works on arrays and ShapeDtypeStructs."""
  return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def quantization_error(params, tree) -> dict[str, float]:
  """For every quantised leaf of `tree` (keyed by path), the worst output channel's max|dequantised - W| / max|W|.
  Rounding to the nearest of 255 levels bounds it by 0.5 / 127 ~ 0.0039; an all-zero channel counts as error 0."""
  errors = {}

  def visit(path, weight, quantized):
    if not _is_quantized(quantized):
      return
    contract = tuple(i for i, size in enumerate(quantized.scale.shape) if size == 1)
    w = np.asarray(weight, np.float64)
    deq = np.asarray(quantized.values, np.float64) * np.asarray(quantized.scale, np.float64)
    err = np.max(np.abs(deq - w), axis=contract)
    ref = np.max(np.abs(w), axis=contract)
    errors[_path_name(path)] = float(np.max(np.where(ref > 0, err / np.where(ref > 0, ref, 1.0), 0.0)))

  jax.tree_util.tree_map_with_path(visit, params, tree, is_leaf=_is_quantized)
  return errors
