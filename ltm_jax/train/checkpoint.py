"""Orbax checkpoints in WORKDIR/checkpoints: train state, data-iterator state and the model config, saved together
asynchronously, keeping the last N. A workdir refuses a config whose model differs from the one it was trained with."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from ltm_jax import config as config_lib
from ltm_jax.errors import CheckpointError


@contextlib.contextmanager
def _absl_errors_only():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


class Checkpointer:
  """Items per step: "state" (TrainState pytree), "data" (loader state, JSON), "config" (Config dict, JSON)."""

  def __init__(self, workdir: str | pathlib.Path, keep: int = 3, async_save: bool = True, read_only: bool = False):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0, max_to_keep=None)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
    with _absl_errors_only():  # Opening a read-only manager logs routine notices as warnings.
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state, data_state: dict[str, Any], config: config_lib.Config) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                              config=ocp.args.JsonSave(config.to_dict()))
    self._manager.save(step, args=args, force=True)

  def saved_config(self, step: int) -> config_lib.Config:
    restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return config_lib.from_dict(restored["config"])

  def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
    """Restores step `step` into the structure/shapes of `abstract_state` (e.g. from jax.eval_shape)."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
    try:
      restored = self._manager.restore(step, args=args)
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(f"could not restore {self.directory}/{step}: {str(e).splitlines()[0]}") from e
    return restored["state"], restored["data"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


# Model keys that change how the model runs, not what its parameters are or compute: free to change on resume/load.
RUNTIME_MODEL_KEYS = ("dtype", "wkv_impl", "wkv7_impl", "attention_impl", "max_seq_len", "remat")


# Latent keys that shape the parameters or what they compute; the inner-loop settings stay free (e.g. more eval steps).
STRUCTURAL_LATENT_KEYS = ("enabled", "n_per_layer", "rope", "rope_span")


def check_compatible(saved: config_lib.Config, current: config_lib.Config, where: str) -> None:
  """Raises CheckpointError naming every model key (other than runtime choices) and structural latent key that
  differs from the checkpoint's."""
  a, b = saved.model.__dict__, current.model.__dict__
  diffs = [f"model.{k}: checkpoint {a[k]!r}, config {b[k]!r}" for k in a
           if a[k] != b[k] and k not in RUNTIME_MODEL_KEYS]
  a, b = saved.latent.__dict__, current.latent.__dict__
  if a["enabled"] or b["enabled"]:  # Without latents the other latent keys mean nothing.
    diffs += [f"latent.{k}: checkpoint {a[k]!r}, config {b[k]!r}" for k in STRUCTURAL_LATENT_KEYS if a[k] != b[k]]
  if diffs:
    raise CheckpointError(f"{where} holds a checkpoint of a different model ({'; '.join(diffs)}); "
                          "use another workdir or the same model config")


def abstract(tree, shardings=None):
  """ShapeDtypeStructs of a pytree, the target of `Checkpointer.restore`. Without `shardings`, placed on this
  process's first device, so a checkpoint written on another device (a GPU run opened in a CPU notebook) restores
  here instead of onto the device it was saved from. With `shardings` (a matching pytree of jax Shardings, e.g. a
  parallel.Layout's state), every array is read straight into those shards: a checkpoint written under one mesh
  restores under another (orbax reads each device's slice of the saved global array)."""
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def write_config_json(workdir: str | pathlib.Path, config: config_lib.Config) -> None:
  """Writes WORKDIR/config.json atomically (a crash never leaves half a file)."""
  path = pathlib.Path(workdir) / "config.json"
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(config.to_json())
  os.replace(tmp, path)


def read_config_json(workdir: str | pathlib.Path) -> config_lib.Config:
  path = pathlib.Path(workdir) / "config.json"
  if not path.is_file():
    raise CheckpointError(f"{workdir} is not an ltm_jax workdir (no config.json)")
  return config_lib.from_dict(json.loads(path.read_text()))
