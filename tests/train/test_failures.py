"""Failure behaviour of a workdir: damaged checkpoints are named and skipped, corruption is detected by checksums,
non-finite state is never saved, one run holds a workdir, and refused runs write nothing."""

from __future__ import annotations

import json
import os
import re
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import api, cli
from ltm_jax.config import apply_overrides, validate
from ltm_jax.errors import CheckpointError, ConfigError, TrainingError, WorkdirError
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train import train
from ltm_jax.train import workdir as workdir_lib
from ltm_jax.train import divergence
from ltm_jax.train.loop import _save
from ltm_jax.train.metrics import read_metrics

# Checkpoints at steps 6 and 12; the damage goes to 12, the latest.
BASE = ["train.steps=12", "train.checkpoint_every=6", "train.log_every=3", "train.eval_every=12"]


def _config(*overrides):
  return validate(apply_overrides(micro_config(), BASE + list(overrides)))


def _digest(path: pathlib.Path) -> dict[str, bytes]:
  return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("trained")
  train(_config(), workdir, progress=False)
  return workdir


def _copy(trained, tmp_path) -> pathlib.Path:
  workdir = tmp_path / "work"
  shutil.copytree(trained, workdir)
  return workdir


def _largest_array_file(step_folder: pathlib.Path) -> pathlib.Path:
  files = [f for f in (step_folder / "state").rglob("*") if f.is_file()]
  return max(files, key=lambda f: f.stat().st_size)


def _truncate(folder):
  f = _largest_array_file(folder)
  f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _delete(folder):
  _largest_array_file(folder).unlink()


def _garbage(folder):
  f = _largest_array_file(folder)
  f.write_bytes(np.random.default_rng(0).bytes(f.stat().st_size))


def _flip_bit(folder):
  f = _largest_array_file(folder)
  data = bytearray(f.read_bytes())
  data[len(data) // 2] ^= 0x10
  f.write_bytes(bytes(data))


def _empty(folder):
  for child in folder.iterdir():
    shutil.rmtree(child) if child.is_dir() else child.unlink()


def _no_metadata(folder):
  (folder / "state" / "_METADATA").unlink()


def _garbage_config(folder):
  (folder / "config" / "metadata").write_text('{"model": {"d_model": "wide"}}')


DAMAGE = {"truncated": _truncate, "deleted": _delete, "garbage": _garbage, "bit_flip": _flip_bit,
          "emptied": _empty, "no_metadata": _no_metadata, "garbage_config": _garbage_config}


def test_every_step_folder_has_a_manifest_of_its_files(trained):
  for step in (6, 12):
    folder = trained / "checkpoints" / str(step)
    digests = json.loads((folder / ckpt_lib.CHECKSUMS).read_text())["sha256"]
    files = {str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file() and f.name != ckpt_lib.CHECKSUMS}
    assert set(digests) == files and len(files) > 5


# Without its manifest (as if killed between orbax's commit and the manifest write), orbax's own errors must do;
# only the checksum can see a flipped bit in raw array data.
CASES = [(kind, True) for kind in sorted(DAMAGE)] + [(kind, False) for kind in sorted(DAMAGE) if kind != "bit_flip"]


@pytest.mark.parametrize("kind,manifest", CASES, ids=[f"{k}-{'checksums' if m else 'orbax'}" for k, m in CASES])
def test_damaged_latest_checkpoint_falls_back_to_the_newest_readable(trained, tmp_path, capsys, kind, manifest):
  workdir = _copy(trained, tmp_path)
  folder = workdir / "checkpoints" / "12"
  if not manifest:
    for step in (6, 12):
      (workdir / "checkpoints" / str(step) / ckpt_lib.CHECKSUMS).unlink()
  DAMAGE[kind](folder)
  lm = api.load(workdir)
  warning = capsys.readouterr().err.strip()
  assert lm.trained_steps == 6
  assert len(warning.splitlines()) == 1 and warning.startswith("warning: checkpoint step 12 cannot be read: ")
  assert warning.endswith("falling back to step 6")
  with pytest.raises(CheckpointError, match=r"^checkpoint step 12 cannot be read: [^\n]+$"):
    api.load(workdir, step=12)  # An explicit step means exactly that step.


def test_cli_names_the_damaged_checkpoint_in_one_line_and_uses_the_older_one(trained, tmp_path, capsys):
  workdir = _copy(trained, tmp_path)
  _truncate(workdir / "checkpoints" / "12")
  assert cli.main(["generate", "--workdir", str(workdir), "--prompt", "ab", "--max-new-tokens", "2"]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("warning: checkpoint step 12 cannot be read")
  assert cli.main(["generate", "--workdir", str(workdir), "--step", "12", "--max-new-tokens", "2"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: checkpoint step 12 cannot be read")


def test_fallback_parameters_are_the_older_checkpoints(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  _flip_bit(workdir / "checkpoints" / "12")
  fallback, older = api.load(workdir), api.load(workdir, step=6)
  for a, b in zip(jax.tree.leaves(fallback.params), jax.tree.leaves(older.params)):
    np.testing.assert_array_equal(a, b)


def test_training_resumes_from_the_newest_readable_checkpoint_and_sets_the_damaged_one_aside(trained, tmp_path,
                                                                                             capsys):
  workdir = _copy(trained, tmp_path)
  original = {r["step"]: r for r in read_metrics(trained)}
  _truncate(workdir / "checkpoints" / "12")
  result = train(_config(), workdir, progress=False)
  out, err = capsys.readouterr()
  assert "warning: checkpoint step 12 cannot be read" in err and "damaged-checkpoints" in err
  assert result.step == 12 and (workdir / "damaged-checkpoints" / "12").is_dir()
  assert ckpt_lib.Checkpointer(workdir, read_only=True).all_steps() == [6, 12]
  assert api.load(workdir).trained_steps == 12
  assert ("dropped 2 metrics.jsonl row(s) (steps 9-12) logged after step 6, the checkpoint resumed from; this run "
          "logs those steps again") in out
  rows = {r["step"]: r for r in read_metrics(workdir)}
  # Steps 7-12 were recomputed from step 6's state and data position: the same numbers as the first time.
  assert rows[12]["loss"] == pytest.approx(original[12]["loss"], rel=1e-6)


def test_no_readable_checkpoint_is_refused_and_nothing_is_written(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  _flip_bit(workdir / "checkpoints" / "12")
  _empty(workdir / "checkpoints" / "6")
  before = _digest(workdir)
  with pytest.raises(CheckpointError, match=r"^no readable checkpoint in .*step 12 .*; checkpoint step 6 [^\n]+$"):
    train(_config("train.steps=18"), workdir, progress=False)
  with pytest.raises(CheckpointError, match="no readable checkpoint"):
    api.load(workdir)
  assert _digest(workdir) == before


@pytest.mark.parametrize("folder", ["emptied", "deleted"])
def test_a_trained_workdir_without_checkpoints_is_refused_and_nothing_is_written(trained, tmp_path, folder):
  workdir = _copy(trained, tmp_path)
  shutil.rmtree(workdir / "checkpoints")
  if folder == "emptied":
    (workdir / "checkpoints").mkdir()
  before = _digest(workdir)
  with pytest.raises(WorkdirError, match=rf"^{re.escape(str(workdir))} holds no checkpoint, but its metrics.jsonl "
                                         rf"logs training up to step 12; to start over, delete {re.escape(str(workdir))}"
                                         r" or train in another workdir$"):
    train(_config(), workdir, progress=False)
  assert _digest(workdir) == before
  assert (workdir / "checkpoints").is_dir() == (folder == "emptied")


def test_divergence_names_its_first_step_and_saves_nothing(tmp_path):
  # lr 1e12 is finite in float32 and wrecks the parameters within a few steps; the logs come every 10 steps.
  overrides = ["train.lr=1e12", "train.grad_clip=0", "train.warmup_steps=0", "train.log_every=10",
               "train.checkpoint_every=10", "train.steps=20"]
  with pytest.raises(TrainingError, match=r"became non-finite at step (\d); no checkpoint was saved") as info:
    train(_config(*overrides), tmp_path / "a", progress=False)
  first = int(re.search(r"at step (\d)", str(info.value)).group(1))
  assert not (tmp_path / "a" / "checkpoints").exists() or not list((tmp_path / "a" / "checkpoints").iterdir())
  # Logging every step stops at that same first step.
  with pytest.raises(TrainingError, match=f"at step {first};"):
    train(_config(*overrides, "train.log_every=1"), tmp_path / "b", progress=False)


def test_nonfinite_parameters_are_never_saved(tmp_path):
  cfg = _config()
  from ltm_jax import model as model_lib
  from ltm_jax.train.optimizer import make_optimizer
  from ltm_jax.train.step import create_train_state
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(0)), make_optimizer(cfg.train), 0)
  poisoned = state.replace(params=jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), state.params))
  checkpointer = ckpt_lib.Checkpointer(tmp_path)
  guard = divergence.Guard(cfg.train)
  _save(checkpointer, 3, state, {"next_batch": 0}, cfg, guard)
  with pytest.raises(TrainingError, match=r"^parameters or optimizer state are not finite at step 4; the newest "
                                          r"checkpoint is step 3; resume from it with .*--from-step 3 "):
    _save(checkpointer, 4, poisoned, {"next_batch": 0}, cfg, guard)
  checkpointer.close()
  assert ckpt_lib.Checkpointer(tmp_path, read_only=True).all_steps() == [3]


def test_config_values_that_overflow_float32_are_refused():
  with pytest.raises(ConfigError, match=r"train.lr=1e\+39 is not a finite float32 value"):
    _config("train.lr=1e39")
  with pytest.raises(ConfigError, match=r"latent.inner_lr=1e\+300 is not a finite float32 value"):
    validate(apply_overrides(micro_config(), ["latent.inner_lr=1e300"]))


def test_a_second_run_on_a_locked_workdir_fails_at_once_naming_the_holder(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  before = _digest(workdir)
  with workdir_lib.exclusive(workdir):
    started = time.time()
    with pytest.raises(WorkdirError, match=rf"is in use by another training run \(pid {os.getpid()}\)"):
      train(_config("train.steps=18"), workdir, progress=False)
    assert time.time() - started < 5
  assert _digest(workdir) == before


def test_the_lock_is_released_with_its_holder_and_writes_no_file(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  with workdir_lib.exclusive(workdir):
    pass
  assert train(_config("train.steps=13"), workdir, progress=False).step == 13
  assert not [f for f in workdir.iterdir() if "lock" in f.name]


def test_unwritable_checkpoints_folder_fails_within_seconds(tmp_path):
  workdir = tmp_path / "work"
  workdir.mkdir()
  (workdir / "checkpoints").write_text("not a folder")
  started = time.time()
  with pytest.raises(WorkdirError, match=r"checkpoints is a file, not a directory"):
    train(_config(), workdir, progress=False)
  assert time.time() - started < 30 and not (workdir / "config.json").exists()
  with pytest.raises(WorkdirError, match="is a file, not a directory"):
    train(_config(), workdir / "checkpoints", progress=False)


def test_failed_background_save_surfaces_cleans_up_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  from orbax.checkpoint._src.path import atomicity
  cfg = _config()
  from ltm_jax import model as model_lib
  from ltm_jax.train.optimizer import make_optimizer
  from ltm_jax.train.step import create_train_state
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(0)), make_optimizer(cfg.train), 0)
  checkpointer = ckpt_lib.Checkpointer(tmp_path)
  checkpointer.save(1, state, {"next_batch": 0}, cfg)
  checkpointer.wait()

  async def no_space(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", no_space)
  checkpointer.save(2, state, {"next_batch": 0}, cfg)
  started = time.time()
  with pytest.raises(CheckpointError, match=r"^saving checkpoint step 2 in .* failed: [^\n]+$"):
    while time.time() - started < 30:
      checkpointer.check_for_errors()
      time.sleep(0.05)
  monkeypatch.undo()
  checkpointer.close()
  assert not list((tmp_path / "checkpoints").glob("2*"))
  assert ckpt_lib.Checkpointer(tmp_path, read_only=True).all_steps() == [1]


def test_shrinking_steps_below_the_latest_checkpoint_is_refused(trained):
  before = _digest(trained)
  with pytest.raises(ConfigError, match=r"train.steps=8 is below the latest checkpoint .*\(step 12\)"):
    train(_config("train.steps=8"), trained, progress=False)
  assert _digest(trained) == before


@pytest.mark.parametrize("content", [b"\xff\xfe garbage \x00", b'[1, 2]\n', b'{"loss": 1.0}\n'])
def test_unusable_metrics_file_refuses_the_run_before_writing(trained, tmp_path, content):
  workdir = _copy(trained, tmp_path)
  (workdir / "metrics.jsonl").write_bytes(content)
  before = _digest(workdir)
  with pytest.raises(WorkdirError, match=r"metrics.jsonl"):
    train(_config("train.steps=13"), workdir, progress=False)
  assert _digest(workdir) == before


def test_garbage_config_json_names_the_file(trained, tmp_path):
  workdir = _copy(trained, tmp_path)
  (workdir / "config.json").write_bytes(b"\xff\x00 not json")
  with pytest.raises(CheckpointError, match=r"config.json is not a readable config"):
    api.load(workdir)
