"""Where everything of a training run lives on the mesh: the `Layout` a sharded train step is compiled for."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from ltm_jax import state as state_lib
from ltm_jax.config import Config
from ltm_jax.ops import sharding as ops_sharding
from ltm_jax.parallel import mesh as mesh_lib
from ltm_jax.parallel import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class Layout:
  """mesh: the (pipeline, data, fsdp, tensor) device mesh; rules: flax logical-axis rules; state: a TrainState of
  NamedShardings; batch: the sharding of [B, T] token arrays; strict: a rule that cannot split an op's dimension is
  an error rather than a warning (mesh.strict)."""
  mesh: Mesh
  rules: tuple
  state: Any
  batch: NamedSharding
  strict: bool = False

  @property
  def replicated(self) -> NamedSharding:
    return sharding_lib.replicated(self.mesh)

  def activate(self):
    """The context in which steps are traced and run (mesh, logical-axis rules for the model and the ops)."""
    return _activate(self.mesh, self.rules, self.strict)

  def jit(self, fn: Callable, **jit_kwargs) -> Sharded:
    return Sharded(jax.jit(fn, **jit_kwargs), self)


@contextlib.contextmanager
def _activate(mesh: Mesh, rules, strict: bool) -> Iterator[None]:
  with mesh_lib.activate(mesh, rules), ops_sharding.strict(strict):
    yield


class Sharded:
  """A jitted function traced, compiled and called inside its layout's mesh and rules (so the model's logical
  constraints and the ops' shard_map resolve), with `.lower(...)` for inspecting the compiled step."""

  def __init__(self, jitted, layout: Layout):
    self._jitted, self.layout = jitted, layout

  def __call__(self, *args):
    with self.layout.activate():
      return self._jitted(*args)

  def lower(self, *args):
    with self.layout.activate():
      return self._jitted.lower(*args)


def make_layout(cfg: Config, optimizer: optax.GradientTransformation, devices=None) -> Layout:
  """The layout of `cfg` over `devices` (default all): ConfigError on a bad mesh before anything compiles."""
  mesh = mesh_lib.make_mesh(cfg, devices)
  rules = mesh_lib.rules(cfg)
  return Layout(mesh, rules, sharding_lib.state_shardings(cfg, optimizer, mesh, rules),
                sharding_lib.batch_sharding(mesh, rules), cfg.mesh.strict)


def init_state(cfg: Config, optimizer: optax.GradientTransformation, layout: Layout):
  """A fresh TrainState created directly in its shards (no device ever holds the whole model), equal to
  `state.init_train_state(cfg, optimizer)` on one device."""
  # Outside the layout's rules: flax applies a parameter's logical constraint while DenseGeneral's kernel is still
  # flat (rank mismatch); out_shardings place the result anyway.
  return jax.jit(lambda: state_lib.init_train_state(cfg, optimizer), out_shardings=layout.state)()


def abstract_state(cfg: Config, optimizer: optax.GradientTransformation, layout: Layout):
  """ShapeDtypeStructs of the TrainState carrying the layout's shardings: the target of a checkpoint restore, so a
  checkpoint written under any mesh is read straight into this one's shards."""
  shapes = state_lib.abstract_train_state(cfg, optimizer)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, layout.state)


def sharded_if_multi_device(layout: Layout) -> Layout | None:
  """`layout` when its mesh spans several devices, else None: on one device the plain jitted step is the same
  computation, so single-device runs keep the simplest path."""
  return layout if layout.mesh.size > 1 else None
