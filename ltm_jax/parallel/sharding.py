"""NamedShardings of parameters, optimizer state, train state and batches, from the parameters' logical axes."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ltm_jax import loss_scale as loss_scale_lib
from ltm_jax import model as model_lib
from ltm_jax.config import Config
from ltm_jax.errors import ConfigError
from ltm_jax.state import TrainState


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _path(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_specs(cfg: Config, mesh: Mesh, axis_rules) -> Any:
  """PartitionSpecs (mesh axes) of every parameter of `LM(cfg.model, cfg.latent)`.

  Raises ConfigError when a parameter names a logical axis the rules do not mention, or when a mesh axis size does
  not divide the dimension it shards (named by parameter path)."""
  logical = model_lib.param_axes(cfg.model, model_lib.uses_latents(cfg.latent))
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent))
  known = {name for name, _ in axis_rules}
  is_spec = lambda x: isinstance(x, PartitionSpec)

  def check(path, spec: PartitionSpec, shape) -> PartitionSpec:
    for name in spec:
      if name is not None and name not in known:
        raise ConfigError(f"parameter {_path(path)} has logical axis {name!r} with no mesh rule; "
                          f"rules exist for: {', '.join(sorted(known))}")
    mesh_spec = nn.logical_to_mesh_axes(tuple(spec), axis_rules)
    for dim, axes in zip(shape.shape, mesh_spec):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      shards = math.prod(mesh.shape[a] for a in axes)
      if dim % shards:
        raise ConfigError(f"parameter {_path(path)} {tuple(shape.shape)} has a dimension of {dim} that the mesh "
                          f"axes {'*'.join(axes)}={shards} do not divide (logical axes {tuple(spec)})")
    return mesh_spec

  return jax.tree_util.tree_map_with_path(check, logical, shapes, is_leaf=is_spec)


def param_shardings(cfg: Config, mesh: Mesh, axis_rules) -> Any:
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg, mesh, axis_rules),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def opt_state_shardings(optimizer: optax.GradientTransformation, params_shardings, params_shapes, mesh: Mesh):
  """The optimizer state laid out like the parameters wherever it mirrors them (Adam's moments), replicated
  elsewhere (counters, empty states)."""
  state_shapes = jax.eval_shape(optimizer.init, params_shapes)
  return optax.tree_map_params(optimizer, lambda _, sharding: sharding, state_shapes, params_shardings,
                               transform_non_params=lambda _: replicated(mesh))


def state_shardings(cfg: Config, optimizer: optax.GradientTransformation, mesh: Mesh, axis_rules):
  """Shardings of the whole TrainState: step and rng replicated, params by their rules, Adam moments like params."""
  params = param_shardings(cfg, mesh, axis_rules)
  shapes = jax.eval_shape(lambda: model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent))
  return TrainState(step=replicated(mesh), params=params,
                    opt_state=opt_state_shardings(optimizer, params, shapes, mesh), rng=replicated(mesh),
                    loss_scale=jax.tree.map(lambda _: replicated(mesh), loss_scale_lib.initial()))


def batch_spec(axis_rules) -> PartitionSpec:
  """[batch, length] token arrays: rows over the batch rule's mesh axes, positions over the length rule's."""
  return nn.logical_to_mesh_axes(("batch", "length"), axis_rules)


def batch_shards(mesh: Mesh, axis_rules) -> int:
  """How many ways the batch axes of `mesh` split a batch's rows (1 when the batch is not split)."""
  spec = batch_spec(axis_rules)
  axes = spec[0] if len(spec) else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def batch_sharding(mesh: Mesh, axis_rules, batch_size: int | None = None) -> NamedSharding:
  """The sharding of a [B, T] batch; replicated when `batch_size` is given and the batch axes do not divide it
  (e.g. a validation split smaller than one batch)."""
  if batch_size is not None and batch_size % batch_shards(mesh, axis_rules):
    return replicated(mesh)
  return NamedSharding(mesh, batch_spec(axis_rules))


def process_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> tuple[int, int]:
  """(start, stop): the contiguous rows of a [global_batch, seq_len] batch that this process's devices hold, so that
  each process loads only its slice. ValueError if they are not contiguous (a mesh that interleaves processes)."""
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_batch, seq_len)).values():
    rows.update(range(*index[0].indices(global_batch)))
  start, stop = min(rows), max(rows) + 1
  if len(rows) != stop - start:
    raise ValueError(f"this process's devices hold non-contiguous batch rows {sorted(rows)}; "
                     "order the mesh so each process owns one block of the batch")
  return start, stop


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding, global_batch: int | None = None):
  """Host arrays -> global jax arrays with `sharding`. `batch` holds this process's rows (all of them on one
  process); `global_batch` is the total number of rows (default: this batch's, i.e. a batch every process holds
  whole, such as the validation batches)."""
  def put(x):
    if global_batch is None or global_batch == x.shape[0]:
      return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.make_array_from_process_local_data(sharding, x, (global_batch, *x.shape[1:]))
  return jax.tree.map(put, batch)
