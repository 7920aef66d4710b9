"""Runs an op per shard under a device mesh, so custom kernels never see (or make XLA gather) a sharded input.

An op whose work is independent across batch rows and heads/channels (WKV-4, WKV-7, attention) is wrapped in
`jax.shard_map` over those axes when a sharded step is being traced: inside, each device runs the op's backend on its
own [B/n_b, ..., H/n_h, ...] block, whatever the backend (a Pallas kernel cannot be partitioned by XLA, which would
otherwise gather its operands onto every device). Which mesh axes the batch and head axes use comes from the
logical-axis rules installed with `axis_rules(...)` (ltm_jax.parallel installs the mesh config's rules, the same ones
the model's parameters and constraints use); with no mesh (`jax.set_mesh`), no rules, a mesh whose relevant axes have
size 1, or inside another shard_map, the op runs as is.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

Axes = tuple[str | None, ...]  # Logical name (or None: never split) of each dimension of one array.
Rules = Sequence[tuple[str, str | Sequence[str] | None]]  # (logical name, mesh axes), highest priority first.

_RULES: contextvars.ContextVar[tuple] = contextvars.ContextVar("ltm_jax_ops_axis_rules", default=())


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[None]:
  """Installs logical-axis rules for the ops traced inside (e.g. (("batch", ("data", "fsdp")), ("heads", "tensor")))."""
  token = _RULES.set(tuple(rules))
  try:
    yield
  finally:
    _RULES.reset(token)


def _active_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.manual_axes:  # No mesh, or already inside a shard_map body.
    return None
  return mesh


def _split(sizes: Mapping[str, int], mesh, rules) -> dict[str, tuple[str, ...]]:
  """Logical name -> the mesh axes that split it: in rule order, each mesh axis used once (as flax does for one
  array), and only where the axes divide the size evenly (otherwise the name stays whole: correct, only slower)."""
  split, used = {}, set()
  for name, axes in rules:
    if name not in sizes or name in split:
      continue
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
    if axes and sizes[name] % math.prod(mesh.shape[a] for a in axes) == 0:
      split[name] = axes
      used.update(axes)
  return split


def per_shard(fn: Callable[..., Any], args: tuple, in_axes: tuple, out_axes: Any, sizes: Mapping[str, int]):
  """`fn(*args)`, run per shard of the active mesh when there is one.

  Args:
    fn: a function whose outputs for a block of batch rows / heads depend only on the inputs of that block.
    args: its positional arguments (pytrees of arrays).
    in_axes: per argument, a pytree matching it whose leaves are `Axes` tuples, one logical name per dimension.
    out_axes: the same for fn's output.
    sizes: logical name -> its full size (e.g. {"batch": B, "heads": H}); a name whose mesh axes do not divide its
      size is not split (correct, only slower).
  """
  mesh = _active_mesh()
  rules = _RULES.get()
  if mesh is None or not rules:
    return fn(*args)
  split = _split(sizes, mesh, rules)
  if not split:
    return fn(*args)

  def spec(axes: Axes) -> PartitionSpec:
    return PartitionSpec(*(None if name is None or split.get(name) is None else split[name] for name in axes))

  is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
  in_specs = jax.tree.map(spec, in_axes, is_leaf=is_axes)
  out_specs = jax.tree.map(spec, out_axes, is_leaf=is_axes)
  # check_vma=False: the blocks are independent by construction, and Pallas calls do not declare varying axes.
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
