"""Runs an op per shard under a device mesh, so custom kernels never see (or make XLA gather) a sharded input.

An op whose work is independent across batch rows and heads/channels (WKV-4, WKV-7, attention) is wrapped in
`jax.shard_map` over those axes when a sharded step is being traced: inside, each device runs the op's backend on its
own [B/n_b, ..., H/n_h, ...] block, whatever the backend (a Pallas kernel cannot be partitioned by XLA, which would
otherwise gather its operands onto every device). Which mesh axes the batch and head axes use comes from the
logical-axis rules installed with `axis_rules(...)` (ltm_jax.parallel installs the mesh config's rules, the same ones
the model's parameters and constraints use); with no mesh (`jax.set_mesh`), no rules, a mesh whose relevant axes have
size 1, or inside another shard_map, the op runs as is. A rule whose mesh axes do not divide the dimension it names
leaves that dimension whole on every device: correct, but a silent loss of parallelism, so it warns (once per rule,
naming the array) or, inside `strict()`, raises ConfigError.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ltm_jax.errors import ConfigError

Axes = tuple[str | None, ...]  # Logical name (or None: never split) of each dimension of one array.
Rules = Sequence[tuple[str, str | Sequence[str] | None]]  # (logical name, mesh axes), highest priority first.

# The rules are read from a context rather than passed down the layers: they accompany the mesh (`jax.set_mesh`) and
# flax's `nn.logical_axis_rules`, both contexts, which `ltm_jax.parallel.mesh.activate` installs together with these,
# so the ops split exactly as the parameters and the step's constraints do for as long as that mesh is active.
_RULES: contextvars.ContextVar[tuple] = contextvars.ContextVar("ltm_jax_ops_axis_rules", default=())
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("ltm_jax_ops_strict_sharding", default=False)
_WARNED: set[tuple[str, tuple[str, ...]]] = set()  # (logical name, mesh axes) of the rules already warned about.


class UnsplitDimensionWarning(UserWarning):
  """A logical-axis rule could not split a dimension over its mesh axes, which then hold it whole."""


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[None]:
  """Installs logical-axis rules for the ops traced inside (e.g. (("batch", ("data", "fsdp")), ("heads", "tensor")))."""
  token = _RULES.set(tuple(rules))
  try:
    yield
  finally:
    _RULES.reset(token)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
  """Inside: a rule that cannot split a dimension raises ConfigError instead of warning."""
  token = _STRICT.set(enabled)
  try:
    yield
  finally:
    _STRICT.reset(token)


def _unsplit(name: str, size: int, axes: tuple[str, ...], mesh, array: str) -> None:
  """Reports that rule `name` -> `axes` cannot split `array`'s dimension of `size` (see `strict`)."""
  shards = math.prod(mesh.shape[a] for a in axes)
  message = (f"{array}: its {name!r} dimension of {size} is not divisible by the mesh size "
             f"{'*'.join(f'{a}={mesh.shape[a]}' for a in axes)} that mesh.{name} names, so every device holds it "
             f"whole; make it a multiple of {shards} or set mesh.{name} to axes whose sizes divide it")
  if _STRICT.get():
    raise ConfigError(message)
  if (name, axes) not in _WARNED:
    _WARNED.add((name, axes))
    warnings.warn(f"{message} (mesh.strict=true makes this an error)", UnsplitDimensionWarning, stacklevel=4)


def inside_shard_map() -> bool:
  """Whether the code being traced runs per shard (in a shard_map body). Kernels with a remat-optimised custom VJP
  are given optimize_remat=False there: jax's dead-code elimination of that form fails inside a shard_map under
  remat and nested scans (a scanned latent model with a block remat policy on a sharded mesh)."""
  return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _active_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or inside_shard_map():  # No mesh, or already inside a shard_map body.
    return None
  return mesh


def _split(sizes: Mapping[str, int], mesh, rules, describe: Callable[[str], str] = str) -> dict[str, tuple[str, ...]]:
  """Logical name -> the mesh axes that split it: in rule order, each mesh axis used once (as flax does for one
  array), and only where the axes divide the size evenly (otherwise the name stays whole: correct, only slower, and
  reported by `_unsplit` with `describe(name)` naming the array)."""
  split, used = {}, set()
  for name, axes in rules:
    if name not in sizes or name in split:
      continue
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
    if axes and sizes[name] % math.prod(mesh.shape[a] for a in axes) == 0:
      split[name] = axes
      used.update(axes)
    elif axes:
      _unsplit(name, sizes[name], axes, mesh, describe(name))
  return split


def per_shard(fn: Callable[..., Any], args: tuple, in_axes: tuple, out_axes: Any, sizes: Mapping[str, int]):
  """`fn(*args)`, run per shard of the active mesh when there is one.

  Args:
    fn: a function whose outputs for a block of batch rows / heads depend only on the inputs of that block.
    args: its positional arguments (pytrees of arrays).
    in_axes: per argument, a pytree matching it whose leaves are `Axes` tuples, one logical name per dimension.
    out_axes: the same for fn's output.
    sizes: logical name -> its full size (e.g. {"batch": B, "heads": H}); a name whose mesh axes do not divide its
      size is not split (correct, only slower) and is reported (a warning, or ConfigError inside `strict()`).
  """
  mesh = _active_mesh()
  rules = _RULES.get()
  if mesh is None or not rules:
    return fn(*args)
  is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)

  def describe(name: str) -> str:
    """The first input of fn that has the logical axis `name`, by op and shape."""
    op = getattr(fn, "__module__", "op").removeprefix("ltm_jax.")
    pairs = zip(jax.tree.leaves(in_axes, is_leaf=is_axes),
                jax.tree.structure(in_axes, is_leaf=is_axes).flatten_up_to(args))
    shape = next((tuple(x.shape) for axes, x in pairs if name in axes and hasattr(x, "shape")), None)
    return op if shape is None else f"{op}'s input {list(shape)}"

  split = _split(sizes, mesh, rules, describe)
  if not split:
    return fn(*args)

  def spec(axes: Axes) -> PartitionSpec:
    return PartitionSpec(*(None if name is None or split.get(name) is None else split[name] for name in axes))

  in_specs = jax.tree.map(spec, in_axes, is_leaf=is_axes)
  out_specs = jax.tree.map(spec, out_axes, is_leaf=is_axes)
  # check_vma=False: the blocks are independent by construction, and Pallas calls do not declare varying axes.
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
