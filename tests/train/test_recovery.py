"""Recovery from a divergence (`ltm train --from-step N`), and runs refused on an existing workdir that leave every
file and folder in it exactly as it was (bytes and modification times)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from ltm_jax import cli
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train.metrics import read_metrics

TINY = str(ROOT / "configs" / "tiny.py")
# configs/tiny.py shrunk to a 2-layer d_model 32 model on 4 x 32 tokens: each run compiles and trains in seconds.
# A checkpoint every 2 steps; the newest 3 are kept, and those at multiples of 6 stay whatever their age.
SMALL = ["model.d_model=32", "model.n_layers=2", "train.batch_size=4", "train.seq_len=32", "train.eval_batches=2",
         "train.log_every=1", "train.eval_every=1000", "train.warmup_steps=2", "train.checkpoint_every=2",
         "train.keep_checkpoints=3", "train.keep_every=6", "data.worker_threads=1"]
HEALTHY_LR = "train.lr=3e-3"
# Adam moves every weight by about lr per step: at 30 the loss climbs by orders of magnitude within a few steps while
# staying finite (those checkpoints are saved) until the loss-spike guard stops the run.
HUGE_LR = "train.lr=30"


def _train(workdir, *overrides, from_step=None):
  argv = ["train", "--config", TINY, "--workdir", str(workdir), *SMALL, *overrides]
  if from_step is not None:
    argv += ["--from-step", str(from_step)]
  return cli.main(argv)


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
  """Every path under `root` (itself included): its type, modification time in ns, and a file's bytes."""
  out = {}
  for path in [root, *sorted(root.rglob("*"))]:
    st = os.lstat(path)
    data = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    out[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns, data)
  return out


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
  """6 steps at a sane learning rate: checkpoints at steps 2, 4 and 6 (which stays)."""
  workdir = tmp_path_factory.mktemp("healthy")
  assert _train(workdir, HEALTHY_LR, "train.steps=6") == 0
  return workdir


def _kept(workdir) -> list[int]:
  return ckpt_lib.Checkpointer(workdir, read_only=True).all_steps()


def test_divergence_names_the_kept_steps_and_from_step_recovers(healthy, tmp_path, capsys):
  workdir = tmp_path / "work"
  shutil.copytree(healthy, workdir)
  good_rows = read_metrics(workdir)
  capsys.readouterr()
  # The same run continued at a huge learning rate: its checkpoints after step 6 hold finite, diverged parameters.
  assert _train(workdir, HUGE_LR, "train.grad_clip=0", "train.steps=30") == 2
  err = capsys.readouterr().err.strip()
  kept = _kept(workdir)
  assert kept[0] == 6 and kept[-1] > 6, kept  # 2 and 4 pruned; 6, a multiple of train.keep_every, stays.
  # Step 7's loss is that of step 6's parameters; from step 8 on the loss is far above its best, and after
  # train.spike_steps (10) such steps the guard stops the run, naming the newest checkpoint saved before the rise.
  # Where the loss overflows first (jax 0.11's CPU compilation reached inf at step 14), the non-finite stop names
  # the same checkpoint.
  assert "\n" not in err, err
  if err.startswith("error: loss spike: "):
    assert " at step 17, above " in err and " for the 10 steps since step 8 (train.spike_steps=10;" in err
  else:
    assert err.startswith("error: loss became non-finite at step "), err
  assert err.endswith("the newest checkpoint saved before the loss began to rise at step 8 is step 6; resume from it "
                      "with a lower train.lr or a train.grad_clip: ltm train --from-step 6 ... (deletes the "
                      "checkpoints after it)"), err
  listed = ", ".join(map(str, kept))
  diverged = max(r["loss"] for r in read_metrics(workdir) if r["loss"] is not None)
  assert diverged > 100 * good_rows[-1]["loss"]

  # A step that is not kept: one line naming the kept ones, nothing changed.
  before = snapshot(workdir)
  assert _train(workdir, HEALTHY_LR, "train.steps=30", from_step=5) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"error: cannot resume from step 5: {workdir} keeps checkpoints at steps {listed} only"
  assert snapshot(workdir) == before

  # The recovery the error names: back to the oldest kept step (trained at the sane rate) with the sane rate.
  assert _train(workdir, HEALTHY_LR, "train.steps=12", from_step=kept[0]) == 0
  out = capsys.readouterr().out
  dropped = ", ".join(str(s) for s in kept[1:])
  assert f"deleted the checkpoints after step {kept[0]} (steps {dropped}) and their metrics rows" in out
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(1, 13))
  assert rows[:kept[0]] == good_rows[:kept[0]]  # The rows up to the step resumed from are those of the healthy run.
  assert all(r["loss"] < 2 * good_rows[0]["loss"] for r in rows)  # Trained on from healthy parameters.
  assert _kept(workdir) == [6, 8, 10, 12]


def test_from_step_on_a_workdir_without_checkpoints_is_refused(tmp_path, capsys):
  assert _train(tmp_path, "train.steps=2", from_step=0) == 2
  assert capsys.readouterr().err.strip() == f"error: cannot resume from step 0: {tmp_path} has no checkpoints"
  assert list(tmp_path.iterdir()) == []
  new = tmp_path / "new"  # A workdir that does not exist is not made.
  assert _train(new, "train.steps=2", from_step=0) == 2
  assert capsys.readouterr().err.strip() == f"error: cannot resume from step 0: {new} has no checkpoints"
  assert not new.exists()


def test_refused_runs_leave_the_workdir_byte_identical_with_its_mtimes(healthy, tmp_path):
  """A model that differs from the checkpoint's, and a metrics.jsonl that is not UTF-8, refused by a process that
  has never held the workdir (as a second `ltm train` would be)."""
  other_model = tmp_path / "other_model"
  bad_metrics = tmp_path / "bad_metrics"
  shutil.copytree(healthy, other_model)
  shutil.copytree(healthy, bad_metrics)
  (bad_metrics / "metrics.jsonl").write_bytes(b"\xff\xfe not utf-8 \x00\n")
  before = {w: snapshot(w) for w in (other_model, bad_metrics)}
  runs = [[*SMALL, "train.steps=8", "model.d_model=64"], [*SMALL, "train.steps=8"]]
  script = ("import json, sys\nfrom ltm_jax import cli\n"
            "codes = [cli.main(['train', '--config', sys.argv[1], '--workdir', w, *json.loads(a)]) "
            "for w, a in zip(sys.argv[2::2], sys.argv[3::2])]\nprint(json.dumps(codes))\n")
  argv = [sys.executable, "-c", script, TINY]
  for workdir, overrides in zip((other_model, bad_metrics), runs):
    argv += [str(workdir), json.dumps(overrides)]
  done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
  assert json.loads(done.stdout.strip().splitlines()[-1]) == [2, 2], done.stderr
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 2, done.stderr
  assert "model.d_model: checkpoint 32, config 64" in errors[0]
  assert "metrics.jsonl cannot be read" in errors[1]
  for workdir, snap in before.items():
    assert snapshot(workdir) == snap, workdir


def test_perplexity_of_a_diverged_model_is_infinite_not_an_overflow_error():
  from ltm_jax.train.evaluation import _ppl
  assert _ppl(0.0) == 1.0 and _ppl(2.0) == pytest.approx(7.38905609893065)
  assert _ppl(1e5) == float("inf")  # math.exp raises OverflowError above ~709.78.
