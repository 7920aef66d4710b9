"""The device mesh of a config: sizes resolved against the devices, checked before anything compiles."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh

from ltm_jax.config import Config
from ltm_jax.errors import ConfigError
from ltm_jax.ops import sharding as ops_sharding
from ltm_jax.parallel.mesh_checks import MESH_AXES, check_mesh_fits


def resolve_sizes(cfg: Config, device_count: int) -> dict[str, int]:
  """{pipeline, data, fsdp, tensor} with the one -1 (if any) filled so that the product is `device_count`.

  Raises ConfigError (one line) when the sizes cannot multiply to the device count."""
  sizes = cfg.mesh.sizes()
  known = math.prod(s for s in sizes.values() if s != -1)
  given = ", ".join(f"mesh.{a}={s}" for a, s in sizes.items())
  fill = [a for a, s in sizes.items() if s == -1]
  if fill:
    if device_count % known:
      raise ConfigError(f"the mesh sizes {given} cannot fill {device_count} devices: {known} does not divide "
                        f"{device_count}")
    sizes[fill[0]] = device_count // known
  elif known != device_count:
    raise ConfigError(f"the mesh sizes {given} multiply to {known}, but there are {device_count} devices; "
                      "set one size to -1 to fill the rest")
  return sizes


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The (pipeline, data, fsdp, tensor) mesh over `devices` (default: all devices of all processes), checked against
  the model and batch (ConfigError before any compilation: a pipeline that cannot split the layer stack or the
  batch, an axis that does not divide what it shards). Axes are Auto: shardings come from the rules and XLA propagates
  them, rather than being part of every array's type."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_sizes(cfg, len(devices))
  check_mesh_fits(cfg, sizes)
  shape = tuple(sizes[a] for a in MESH_AXES)
  # jax.make_mesh orders the devices for the interconnect: the last axis (tensor) within a host, processes along the
  # leading (pipeline, batch) axes, so each process holds one contiguous block of every batch.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


def rules(cfg: Config) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """The flax logical-axis rules of the config's mesh section."""
  return cfg.mesh.rules()


@contextlib.contextmanager
def activate(mesh: Mesh, axis_rules) -> Iterator[None]:
  """The context in which a sharded step is traced: `mesh` is the abstract mesh (so `nn.with_logical_constraint`
  and the ops' shard_map hook see it) and `axis_rules` resolve logical names."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules), ops_sharding.axis_rules(axis_rules):
    yield
