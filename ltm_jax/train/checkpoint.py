"""Orbax checkpoints in WORKDIR/checkpoints: train state, data-iterator state and the model config, saved together
asynchronously, keeping the last N. A workdir refuses a config whose model differs from the one it was trained with.

Every finished checkpoint gets a manifest of its files' SHA-256 digests (CHECKSUMS), verified before the checkpoint is
read: a truncated, deleted, replaced or bit-flipped file is a refused checkpoint, never silently wrong parameters.
`newest_readable` walks back from the latest step past checkpoints that cannot be read, naming each on stderr."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from ltm_jax import config as config_lib
from ltm_jax.errors import CheckpointError, DamagedCheckpointError, LtmError, ShapeMismatchError, first_line

CHECKSUMS = "ltm_checksums.json"  # In each step folder: {"sha256": {relative path: hex digest}}.
T = TypeVar("T")


@contextlib.contextmanager
def _absl_errors_only():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _names(path) -> tuple[str, ...]:
  """A pytree key path as names, alike for the dicts orbax stores and the NamedTuples and lists restored into."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


class Checkpointer:
  """Items per step: "state" (TrainState pytree), "data" (loader state, JSON), "config" (Config dict, JSON)."""

  def __init__(self, workdir: str | pathlib.Path, keep: int = 3, async_save: bool = True, read_only: bool = False,
               keep_every: int = 0):
    """Keeps the newest `keep` checkpoints, and those at multiples of `keep_every` (0: none) whatever their age."""
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self._unsealed: int | None = None  # The step whose save was started and not yet checked and sealed.
    self._sealer: threading.Thread | None = None
    self._primary = jax.process_index() == 0  # Orbax commits the step folder from process 0; it alone seals it.
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0, max_to_keep=None)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every or None,
                                             enable_async_checkpointing=async_save)
    with _absl_errors_only():  # Opening a read-only manager logs routine notices as warnings.
      self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, data_state: dict[str, Any], config: config_lib.Config) -> None:
    """Starts saving `step` (in the background when async). CheckpointError if this or an earlier save failed."""
    self._finish(block=True)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                              config=ocp.args.JsonSave(config.to_dict()))
    self._unsealed = step
    try:
      with _absl_errors_only():
        self._manager.save(step, args=args, force=True)
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise plain exceptions for I/O failures.
      self._failed(step, e)
    self._finish(block=False)

  def check_for_errors(self) -> None:
    """Cheap enough for every step: once a background save has ended, CheckpointError if it failed (its temporary
    folder is removed; older checkpoints stay), else its manifest is written in a background thread."""
    self._finish(block=False)

  def _finish(self, block: bool) -> None:
    step = self._unsealed
    if step is None or (not block and self._manager.is_saving_in_progress()):
      return
    self._unsealed = None
    try:
      with _absl_errors_only():
        self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      self._failed(step, e)
    if not self._primary:
      return
    if not (self.directory / str(step)).is_dir():  # Orbax can log a failed commit instead of raising it.
      self._failed(step, RuntimeError("the save ended without a committed checkpoint folder"))
    self._join_sealer()
    self._sealer = threading.Thread(target=self._seal, args=(step,), name=f"seal-{step}", daemon=True)
    self._sealer.start()

  def _join_sealer(self) -> None:
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None

  def _failed(self, step: int, error: BaseException) -> None:
    for leftover in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
      shutil.rmtree(leftover, ignore_errors=True)
    self._unsealed = None
    raise CheckpointError(f"saving checkpoint step {step} in {self.directory} failed: {first_line(error)}") from error

  def _seal(self, step: int) -> None:
    folder = self.directory / str(step)
    digests = {str(f.relative_to(folder)): _sha256(f) for f in sorted(folder.rglob("*"))
               if f.is_file() and not f.name.startswith(CHECKSUMS)}
    tmp = folder / (CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps({"sha256": digests}, indent=0) + "\n")
    os.replace(tmp, folder / CHECKSUMS)

  def verify(self, step: int) -> None:
    """DamagedCheckpointError unless every file in step's manifest is present with its recorded digest. A step
    without a manifest (killed between orbax's commit and the manifest write) is read unverified."""
    folder = self.directory / str(step)
    manifest = folder / CHECKSUMS
    if not folder.is_dir():
      raise DamagedCheckpointError(step, "its folder is missing")
    if not manifest.exists():
      return
    try:
      digests = json.loads(manifest.read_text())["sha256"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
      raise DamagedCheckpointError(step, f"{CHECKSUMS} is unreadable ({first_line(e)})") from e
    for name, digest in digests.items():
      path = folder / name
      if not path.is_file():
        raise DamagedCheckpointError(step, f"{name} is missing")
      if _sha256(path) != digest:
        raise DamagedCheckpointError(step, f"{name} does not match its checksum")

  def saved_config(self, step: int) -> config_lib.Config:
    with self._reading(step):
      restored = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
      return config_lib.from_dict(restored["config"])

  def restore_data(self, step: int) -> dict[str, Any]:
    """The "data" item of `step` alone (JSON), e.g. to check what a checkpoint was saved for before restoring it."""
    with self._reading(step):
      return self._manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

  def restore(self, step: int, abstract_state) -> tuple[Any, dict[str, Any]]:
    """Restores step `step` into the structure/shapes of `abstract_state` (e.g. from jax.eval_shape), after checking
    its files against their checksums; DamagedCheckpointError when it cannot be read."""
    self.verify(step)
    self._check_shapes(step, abstract_state)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
    with self._reading(step):
      restored = self._manager.restore(step, args=args)
    return restored["state"], restored["data"]

  def _check_shapes(self, step: int, abstract_state) -> None:
    """ShapeMismatchError naming the first array stored at another shape than `abstract_state` has (orbax would
    report the checkpoint as unreadable)."""
    with self._reading(step), contextlib.closing(ocp.StandardCheckpointHandler()) as handler:
      stored = handler.metadata(self.directory / str(step) / "state")
    shapes = {_names(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(stored)
              if hasattr(leaf, "shape")}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
      stored_shape = shapes.get(_names(path))
      if stored_shape is not None and stored_shape != tuple(leaf.shape):
        raise ShapeMismatchError(f"checkpoint step {step} is of a model of other sizes: its {'/'.join(_names(path))} "
                                 f"is {list(stored_shape)}, this model's {list(leaf.shape)}")

  @contextlib.contextmanager
  def _reading(self, step: int):
    try:
      with _absl_errors_only():
        yield
    except CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001 - tensorstore and orbax raise bare Exceptions for unreadable files.
      raise DamagedCheckpointError(step, first_line(e)) from e

  def newest_readable(self, read: Callable[[int], T], steps: list[int] | None = None) -> tuple[int, T, list[int]]:
    """(step, read(step), damaged steps) for the newest of `steps` (default: all) whose `read` does not raise
    DamagedCheckpointError; each damaged one is named in a warning line on stderr. Other errors (a checkpoint of
    another model) propagate. CheckpointError when there is no checkpoint or none can be read."""
    listed = steps is None
    steps = sorted(self.all_steps() if listed else steps, reverse=True)
    if not steps:
      raise CheckpointError(f"{self.directory.parent} has no checkpoints")
    damaged: list[DamagedCheckpointError] = []
    tried: set[int] = set()
    while (step := next((s for s in steps if s not in tried), None)) is not None:
      tried.add(step)
      try:
        value = read(step)
      except DamagedCheckpointError as e:
        if listed and not (self.directory / str(step)).exists():
          # Deleted while it was read: a run still training pruned it (train.keep_checkpoints), which leaves newer
          # checkpoints, not a damaged one. Look again.
          self._manager.reload()
          steps = sorted(self.all_steps(), reverse=True)
          continue
        damaged.append(e)
        later = next((s for s in steps if s < step), None)
        print(f"warning: {e}; " + (f"falling back to step {later}" if later is not None else "no older checkpoint"),
              file=sys.stderr)
        continue
      return step, value, [e.step for e in damaged]
    raise CheckpointError(f"no readable checkpoint in {self.directory}" +
                          (": " + "; ".join(str(e) for e in damaged) if damaged else ""))

  def set_aside(self, steps: list[int]) -> pathlib.Path | None:
    """Moves the folders of `steps` to WORKDIR/damaged-checkpoints/ (kept for inspection, out of orbax's way)."""
    if not steps:
      return None
    aside = self.directory.parent / "damaged-checkpoints"
    aside.mkdir(exist_ok=True)
    for step in steps:
      target, n = aside / str(step), 1
      while target.exists():
        target, n = aside / f"{step}.{n}", n + 1
      shutil.move(str(self.directory / str(step)), target)
    self._manager.reload()
    return aside

  def drop_after(self, step: int) -> list[int]:
    """Deletes every checkpoint newer than `step` (on every process: orbax coordinates the deletion) and returns
    their steps, so that the next save continues from `step`."""
    newer = [s for s in self.all_steps() if s > step]
    with _absl_errors_only():
      for s in newer:
        self._manager.delete(s)
    return newer

  def wait(self) -> None:
    """Blocks until the last save is committed and sealed; CheckpointError if it failed."""
    self._finish(block=True)
    self._join_sealer()

  def close(self) -> None:
    """Waits for outstanding work without raising (a failed save was reported by `save`/`wait` where it could be)."""
    with contextlib.suppress(Exception):
      self._finish(block=True)
    self._join_sealer()
    with contextlib.suppress(Exception), _absl_errors_only():
      self._manager.wait_until_finished()
    self._manager.close()


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


# Model keys that change how the model runs, not what its parameters are or compute: free to change on resume/load.
RUNTIME_MODEL_KEYS = ("dtype", "residual_dtype", "wkv_impl", "wkv7_impl", "ffn_impl", "norm_mix_impl", "attention_impl",
                      "memory_impl", "max_seq_len", "remat", "matmul_precision", "fp8", "loss_chunk", "mmrec_impl",
                      "mmrec_remat", "mmrec_precompute")
# Keys that mean something only to Titans memory layers (M, G).
MEMORY_MODEL_KEYS = ("memory_depth", "memory_expansion", "memory_chunk", "memory_max_lr")
# Keys that mean something only to MM-Rec layers (D).
MMREC_MODEL_KEYS = ("mmrec_slots", "mmrec_segment")


# Latent keys that shape the parameters or what they compute; the inner-loop settings stay free (e.g. more eval steps).
STRUCTURAL_LATENT_KEYS = ("enabled", "top_layers", "n_per_layer", "rope", "rope_span", "encoder", "encoder_width",
                          "encoder_context", "encoder_logvar")

# Time-series keys of the model itself; the data keys (source, split, normalisation) are checked by the data
# stream's fingerprint when a run resumes.
STRUCTURAL_TIMESERIES_KEYS = ("enabled", "task", "patch", "pool", "branch", "spectrum_bins", "spectrum_max_period",
                              "head_hidden")


def _resolved(model: config_lib.ModelConfig) -> dict[str, Any]:
  """The sizes that the model keys defaulting to None stand for (n_kv_heads: n_heads, ...), where they stand for
  one: mlp_dim is a width per feed-forward kind, one only where every layer's agrees."""
  keys = {"n_kv_heads": model.kv_heads}
  if "rwkv7" in model.mixers:
    keys.update({f"rwkv7_{name}_lora": dim for name, dim in model.rwkv7_lora_dims().items()})
  widths = {model.ffn_dim(model.ffn_kind(mixer)) for mixer in model.mixers}
  if len(widths) == 1:
    keys["mlp_dim"] = widths.pop()
  return keys


def _differ(key: str, old, new, saved: config_lib.ModelConfig, current: config_lib.ModelConfig) -> bool:
  """Whether model key `key` differs, a None default and the size it stands for given explicitly being equal."""
  if (old is None) != (new is None):
    old = _resolved(saved).get(key) if old is None else old
    new = _resolved(current).get(key) if new is None else new
  return old != new


def model_differences(saved: config_lib.Config, current: config_lib.Config) -> list[tuple[str, Any, Any]]:
  """(key, saved value, current value) of every model key (other than runtime choices, and the keys of layer kinds
  neither model has) and structural latent and time-series key that differs: what a checkpoint cannot be read as.
  A None default and the size it stands for (n_kv_heads=None and n_heads) are equal."""
  a, b = saved.model.__dict__, current.model.__dict__
  has = lambda letters: any(set(letters) & set(c.layer_pattern) for c in (saved.model, current.model))
  ignored = RUNTIME_MODEL_KEYS + (() if has("MG") else MEMORY_MODEL_KEYS) + (() if has("D") else MMREC_MODEL_KEYS)
  diffs = [(f"model.{k}", a[k], b[k]) for k in a
           if k not in ignored and _differ(k, a[k], b[k], saved.model, current.model)]
  a, b = dict(saved.latent.__dict__), dict(current.latent.__dict__)
  if a["enabled"] or b["enabled"]:  # Without latents the other latent keys mean nothing.
    for keys, m in ((a, saved.model), (b, current.model)):  # top_layers None: every block, as n_layers says.
      keys["top_layers"] = m.n_layers if keys["top_layers"] is None else keys["top_layers"]
    diffs += [(f"latent.{k}", a[k], b[k]) for k in STRUCTURAL_LATENT_KEYS if a[k] != b[k]]
  a, b = saved.timeseries.__dict__, current.timeseries.__dict__
  if a["enabled"] or b["enabled"]:
    diffs += [(f"timeseries.{k}", a[k], b[k]) for k in STRUCTURAL_TIMESERIES_KEYS if a[k] != b[k]]
  return diffs


def check_compatible(saved: config_lib.Config, current: config_lib.Config, where: str) -> None:
  """Raises CheckpointError naming every key of `model_differences`."""
  diffs = [f"{key}: checkpoint {a!r}, config {b!r}" for key, a, b in model_differences(saved, current)]
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


def save_params(workdir: str | pathlib.Path, config: config_lib.Config, params, *, step: int = 0,
                data_state: dict[str, Any] | None = None) -> None:
  """Writes a workdir holding `params` as the train state at `step` (a fresh optimizer state and the training key of
  config.train.seed) and its config.json: what `ltm eval`, `generate` and `serve` load and `ltm train` resumes (the
  data stream from its first batch: `data_state` records where the parameters came from, not a position in it). For
  parameters made outside training (converted, or initialised for a test or a benchmark)."""
  from ltm_jax.train.optimizer import make_optimizer  # Deferred: training imports this module.
  from ltm_jax.state import create_train_state
  state = create_train_state(params, make_optimizer(config.train), config.train.seed)
  state = state.replace(step=jax.numpy.asarray(step, jax.numpy.int32))
  pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
  checkpointer = Checkpointer(workdir, keep=1, async_save=False)
  try:
    checkpointer.save(step, state, data_state or {}, config)
  finally:
    checkpointer.close()
  write_config_json(workdir, config)


def read_config_json(workdir: str | pathlib.Path) -> config_lib.Config:
  path = pathlib.Path(workdir) / "config.json"
  if not path.is_file():
    raise CheckpointError(f"{workdir} is not an ltm_jax workdir (no config.json)")
  try:
    return config_lib.from_dict(json.loads(path.read_text()))
  except (ValueError, UnicodeDecodeError, LtmError) as e:
    raise CheckpointError(f"{path} is not a readable config: {first_line(e)}") from e
