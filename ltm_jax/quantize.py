"""Symmetric weight-only quantisation of the LM's parameters, for serving and for the quantisation-aware view
training takes (`fake_quantize_params`): int8 per output channel, or int4 in groups.

int8: every matmul weight W becomes an `Int8Weight`: int8 `values` and a float32 `scale` with one entry per output
channel (kept dims of size 1 over the contraction axes), so W ~ values * scale. The scale of a channel is max|W| over
its contraction axes / 127: a channel with large weights cannot wash out its neighbours, as it would with one scale
per tensor.

int4: every matmul weight becomes an `Int4Weight`: the weight is laid out as [layers..., K, N] (K: its contraction
axes flattened, the fan-in; N: its output axes flattened), K is cut into groups of `group_size` consecutive inputs,
and every (group, output channel) gets its own scale max|W| / 7 over the group, values in [-7, 7]. Sixteen levels
are too few for one scale over a long fan-in (one large input weight would round the channel's other weights to 0);
a group confines an outlier's damage to its group. A fan-in shorter than the group is one group; a group size that
does not divide the fan-in, or an odd one, is refused. Two values share a byte: within each group, input i of the
first half is the low nibble and input i + group/2 the high nibble of byte i, so a kernel that reads one group
unpacks two contiguous halves and multiplies each by a contiguous half of the activations. An int4 tree may hold
int8 weights too: `quantize_params(..., keep_int8=names)` stores the weights those names select as int8 (every
consumer, `dequantize_params` and `layers.common.Dense`, reads each leaf by its own type).

Activations stay in floating point: `dequantize_params` runs inside the jitted forward pass, so the quantised values
are what sits in device memory between calls and the matmuls see the dequantised weights
(`ltm_jax.ops.quant_matmul` is the matmul that reads the quantised weights themselves and scales after the product).

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
  6. The amortised posterior encoder (under `model.ENCODER`, with latent.encoder) is kept in float32 whole: it runs
     once per prompt, never per generated token, and its pooling queries are not a matmul kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.model import ENCODER, LAYER_AXIS
from ltm_jax.ops.quant_matmul.weights import Int4Weight, Int8Weight, QuantizedWeight, dequantize, is_quantized
from ltm_jax.ops.quant_matmul.weights import matmul_operands

QMAX = 127  # Symmetric range [-127, 127]: -128 is unused, so negating a weight never overflows.
QMAX4 = 7  # int4: [-7, 7], symmetric for the same reason.
KINDS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 128  # int4 inputs per scale; 64-128 is the usual trade of scale bytes against rounding error.
HEAD_AXES = ("heads", "kv_heads")  # Axes that "head_dim" extends into one logical feature.
VOCAB_AXIS = "vocab"




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
    kept = name.startswith(f"{ENCODER}/")
    classified[name] = (None if kept else _classify(name, leaf, spec), tuple(spec) if spec is not None else ())

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


def int4_group(name: str, fan_in: int, group_size: int) -> int:
  """The group a fan-in of `fan_in` inputs is cut into: `group_size`, or the whole fan-in when it is shorter.
  Raises ValueError (naming the weight) when the group does not divide the fan-in or is odd (two values per byte)."""
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
    raise ValueError(f"int4 group size must be an even int >= 2, got {group_size!r}")
  group = min(group_size, fan_in)
  if fan_in % group or group % 2:
    raise ValueError(f"cannot quantise {name} to int4 with group size {group_size}: its fan-in {fan_in} is not a "
                     f"multiple of it (choose an even group size that divides {fan_in})")
  return group


def _int4_layout(shape: Sequence[int], contract: Sequence[int], stacked: int) -> tuple[int, ...]:
  """The axis order layers, contraction, output of a weight of `shape`."""
  contract = tuple(contract)
  return (tuple(range(stacked)) + contract
          + tuple(i for i in range(stacked, len(shape)) if i not in contract))


def quantize_int4(weight: jax.Array, contract: Sequence[int], group_size: int, stacked: int = 0) -> Int4Weight:
  """Symmetric int4 quantisation in groups of `group_size` inputs along the `contract` axes (see `Int4Weight`);
  `stacked` leading axes are independent layers. scale = max|W| / 7 over each group (1 for an all-zero group)."""
  shape = tuple(weight.shape)
  perm = _int4_layout(shape, contract, stacked)
  fan_in = math.prod(shape[i] for i in contract)
  group = int4_group("a weight", fan_in, group_size)
  lead = shape[:stacked]
  w = jnp.transpose(jnp.asarray(weight, jnp.float32), perm).reshape(*lead, fan_in // group, group, -1)
  absmax = jnp.max(jnp.abs(w), axis=-2, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / QMAX4, 1.0)
  values = jnp.clip(jnp.round(w / scale), -QMAX4, QMAX4).astype(jnp.int8)
  half = group // 2
  packed = (values[..., :half, :] & 0xF) | (values[..., half:, :] << 4)
  return Int4Weight(packed.astype(jnp.int8), scale[..., 0, :].astype(jnp.float32), shape, perm, group_size)


def _stacked(spec) -> int:
  names = tuple(spec) if spec is not None else ()
  count = 0
  while count < len(names) and names[count] == LAYER_AXIS:
    count += 1
  return count


def _stacked_by_name(axes) -> dict[str, int]:
  """Leaf path -> its leading stacked "layers" axes, from `model.param_axes`-style logical axes."""
  return {_path_name(path): _stacked(spec) for path, spec in jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: isinstance(x, tuple))[0]}


def _kept_int8(chosen: Sequence[tuple[int, str, Any]], keep_int8: Sequence[str]) -> set[str]:
  """The paths of the quantised weights that `keep_int8` names: a name matches every weight with a path component
  of that name ("head" matches head/kernel; "v" every block's mixer/v/kernel). Raises ValueError for a name that
  matches no quantised weight, listing the names that would."""
  names = [name for _, name, _ in chosen]
  components = sorted({part for name in names for part in name.split("/")} - {"kernel"})
  for wanted in keep_int8:
    if not isinstance(wanted, str) or not any(wanted in name.split("/") for name in names):
      raise ValueError(f"keep_int8 name {wanted!r} matches no quantised weight; names: {', '.join(components)}")
  return {name for name in names if set(name.split("/")) & set(keep_int8)}


def quantize_params(params, axes, kind: str = "int8", group_size: int = DEFAULT_GROUP_SIZE,
                    keep_int8: Sequence[str] = ()):
  """`params` with every matmul weight replaced by an Int8Weight (`kind="int8"`: per output channel, per layer when
  stacked) or an Int4Weight (`kind="int4"`: per group of `group_size` inputs and output channel), every other leaf
  unchanged (the same objects); see the module docstring for which leaves are matmul weights. `axes`: as
  `model.param_axes` gives them. `keep_int8` (int4 only): names of weights stored as int8 instead, each matching
  every weight with a path component of that name (("head",): the untied LM head; ("v", "out"): attention's value
  and output projections in every layer). Raises ValueError for an unknown kind, an int4 group size that does not
  divide some weight's fan-in (naming the weight), or a keep_int8 name that matches no quantised weight or comes
  with int8. All weights are quantised by one compiled computation per kind; run it once, outside jit, and feed the
  result to a jitted function that calls `dequantize_params`."""
  if kind not in KINDS:
    raise ValueError(f"unknown quantization {kind!r}; choose from {', '.join(KINDS)}")
  if isinstance(keep_int8, str):
    keep_int8 = (keep_int8,)
  if keep_int8 and kind != "int4":
    raise ValueError(f"keep_int8 keeps some int4 weights at int8; it does not apply to {kind}")
  plan = quantization_plan(params, axes)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  stacked = _stacked_by_name(axes)
  chosen = [(i, _path_name(path), plan[_path_name(path)]) for i, (path, _) in enumerate(leaves)
            if plan[_path_name(path)] is not None]
  kept = _kept_int8(chosen, keep_int8)
  eights = [entry for entry in chosen if kind == "int8" or entry[1] in kept]
  fours = [entry for entry in chosen if kind == "int4" and entry[1] not in kept]
  for i, name, contract in fours:
    int4_group(name, math.prod(leaves[i][1].shape[a] for a in contract), group_size)
  out = [leaf for _, leaf in leaves]
  if fours:
    specs = tuple((contract, stacked.get(name, 0)) for _, name, contract in fours)
    for (i, _, _), weight in zip(fours, _quantize_all_int4([leaves[i][1] for i, _, _ in fours], specs, group_size)):
      out[i] = weight
  if eights:
    contractions = tuple(contract for _, _, contract in eights)
    for (i, _, _), weight in zip(eights, _quantize_all([leaves[i][1] for i, _, _ in eights], contractions)):
      out[i] = weight
  return jax.tree.unflatten(treedef, out)


def fake_quantize_params(params, axes, kind: str = "int8", group_size: int = DEFAULT_GROUP_SIZE):
  """Quantisation-aware training's view of `params`: every weight `quantize_params` would quantise is replaced by its
  dequantised value (the same plan, scales and rounding), with a straight-through gradient (d out / d W = identity:
  rounding has zero gradient almost everywhere, so the float weight learns as if the rounding were not there while
  the loss sees the rounded weight). Other leaves pass through. Call it inside the differentiated function."""
  if kind not in KINDS:
    raise ValueError(f"unknown quantization {kind!r}; choose from {', '.join(KINDS)}")
  plan = quantization_plan(params, axes)
  stacked = _stacked_by_name(axes)

  def fake(path, w):
    name = _path_name(path)
    contract = plan[name]
    if contract is None:
      return w
    if kind == "int4":
      int4_group(name, math.prod(w.shape[a] for a in contract), group_size)
      rounded = dequantize(quantize_int4(w, contract, group_size, stacked.get(name, 0)), w.dtype)
    else:
      rounded = dequantize(quantize(w, contract), w.dtype)
    return w + jax.lax.stop_gradient(rounded - w)

  return jax.tree_util.tree_map_with_path(fake, params)


@functools.partial(jax.jit, static_argnums=1)
def _quantize_all(weights: list, contractions: tuple[tuple[int, ...], ...]) -> list[Int8Weight]:
  """One compilation for the whole model, rather than eager ops compiled once per distinct weight shape."""
  return [quantize(w, contract) for w, contract in zip(weights, contractions)]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_all_int4(weights: list, specs: tuple[tuple[tuple[int, ...], int], ...], group_size: int):
  return [quantize_int4(w, contract, group_size, stacked) for w, (contract, stacked) in zip(weights, specs)]


def has_quantized_weights(tree) -> bool:
  """Whether any leaf of `tree` is an Int8Weight or an Int4Weight."""
  return any(is_quantized(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_quantized))


def has_int8_weights(tree) -> bool:
  """Whether any leaf of `tree` is an Int8Weight."""
  return any(isinstance(leaf, Int8Weight) for leaf in jax.tree.leaves(tree, is_leaf=is_quantized))


def dequantize_params(tree, dtype=jnp.float32, keep_kernels: Sequence[str] = ()):
  """The inverse of `quantize_params`: every quantised weight -> its original shape in `dtype`, other leaves
  unchanged. Call it inside jit, so only the quantised values and scales are device-resident inputs and the
  dequantised weights are temporaries of the compiled computation.

  keep_kernels: kinds ("int8", "int4") of quantised leaves named "kernel" to leave quantised: the projections and
  the untied LM head, which the model multiplies as stored (`ltm_jax.layers.common.Dense`), so a loop over tokens
  reads their integer values (see `kernels_read_quantized`)."""
  def restore(path, x):
    if not is_quantized(x):
      return x
    kind = "int8" if isinstance(x, Int8Weight) else "int4"
    if kind in keep_kernels and getattr(path[-1], "key", None) == "kernel":
      return x
    return dequantize(x, dtype)

  return jax.tree_util.tree_map_with_path(restore, tree, is_leaf=is_quantized)


def kernels_read_quantized(platform: str | None = None) -> tuple[str, ...]:
  """The kinds of quantised kernels a model reads as stored on `platform` (None: JAX's default backend) unless told
  otherwise; the others are dequantised ahead of the computation. GPU: int8 and int4, multiplied by the Pallas
  kernel of `ltm_jax.ops.quant_matmul`, which converts integer tiles in registers, so decoding reads 1 or 1/2 byte
  per weight. CPU: none. Measured on d_model 512, 8-layer models (vocabulary 65,536, batch 1, benchmarks/decode.py,
  dtype section): int8 kernels read as stored decode 4-7x slower than dequantised ahead (RWKV-7 86 against 14
  ms/token; attention 280 against 49; RWKV-7 with scanned layers 158 against 36): XLA's CPU code converts the
  integers to float in a separate pass over each weight inside every step, which costs more than the bytes saved."""
  platform = platform or jax.default_backend()
  return KINDS if platform == "gpu" else ()


def param_bytes(tree) -> int:
  """Bytes of every array leaf (an Int8Weight counts its int8 values at 1 byte each plus its float32 scales, an
  Int4Weight its packed bytes, half a byte per value, plus its scales), for
  reporting the memory a quantised model saves. Works on arrays and ShapeDtypeStructs."""
  return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def quantization_error(params, tree) -> dict[str, float]:
  """For every quantised leaf of `tree` (keyed by path), the worst scale block's max|dequantised - W| / max|W| over
  the block (int8: an output channel; int4: a group of one output channel). Rounding to the nearest level bounds it
  by 0.5 / 127 ~ 0.0039 (int8) and 0.5 / 7 ~ 0.071 (int4); an all-zero block counts as error 0."""
  errors = {}

  def visit(path, weight, quantized):
    if not is_quantized(quantized):
      return
    w = np.asarray(weight, np.float64)
    if isinstance(quantized, Int8Weight):
      contract = tuple(i for i, size in enumerate(quantized.scale.shape) if size == 1)
      deq = np.asarray(quantized.values, np.float64) * np.asarray(quantized.scale, np.float64)
      err, ref = np.max(np.abs(deq - w), axis=contract), np.max(np.abs(w), axis=contract)
    else:  # Blocks [layers..., G, group, N] in the packed layout (numpy: no compilation per weight shape).
      packed = np.asarray(quantized.packed, np.int8)
      values = np.concatenate([(packed << 4).astype(np.int8) >> 4, packed >> 4], axis=-2)
      deq = values * np.asarray(quantized.scale, np.float64)[..., None, :]
      blocks = np.transpose(w, quantized.perm).reshape(deq.shape)
      err, ref = np.max(np.abs(deq - blocks), axis=-2), np.max(np.abs(blocks), axis=-2)
    errors[_path_name(path)] = float(np.max(np.where(ref > 0, err / np.where(ref > 0, ref, 1.0), 0.0)))

  jax.tree_util.tree_map_with_path(visit, params, tree, is_leaf=is_quantized)
  return errors
