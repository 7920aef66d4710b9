"""Sharding over a device mesh: the mesh of a config, shardings from logical axes, sharded train state and steps,
and multi-process start-up. `pipeline` is the layer stack's GPipe schedule over the mesh's pipeline axis;
`mesh_checks` holds the mesh's axes and the checks of a config's mesh against its model.

Config validation imports `mesh_checks`, and the model imports the config, so this file imports nothing when the
package loads: each name below loads its module on first use."""

import importlib

_NAMES = {
    "ltm_jax.parallel.layout": ("Layout", "Sharded", "abstract_state", "init_state", "make_layout",
                                "sharded_if_multi_device"),
    "ltm_jax.parallel.distributed": ("initialize", "is_main_process"),
    "ltm_jax.parallel.mesh": ("activate", "make_mesh", "resolve_sizes", "rules"),
    "ltm_jax.parallel.sharding": ("batch_shards", "batch_sharding", "param_shardings", "param_specs", "process_rows", "put_batch",
                                  "replicated", "state_shardings"),
}
_HOME = {name: module for module, names in _NAMES.items() for name in names}
_MODULES = {"pipeline": "ltm_jax.layers.pipeline"} | {module.rsplit(".", 1)[1]: module for module in _NAMES}

__all__ = sorted(_HOME) + ["pipeline"]


def __getattr__(name: str):
  if name in _MODULES:
    value = importlib.import_module(_MODULES[name])
  elif name in _HOME:
    value = getattr(importlib.import_module(_HOME[name]), name)
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__) | set(_MODULES))
