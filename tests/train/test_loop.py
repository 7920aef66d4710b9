"""End to end: the loss falls, an interrupted run resumes to the same metrics, checkpoints round-trip, and a workdir
refuses a different model without touching its checkpoints."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import ROOT, micro_config, resume_rtol
from ltm_jax import model as model_lib
from ltm_jax.config import apply_overrides
from ltm_jax.state import init_train_state
from ltm_jax.errors import CheckpointError, DataError
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train import train
from ltm_jax.train.metrics import MetricsWriter, read_metrics
from ltm_jax.train.optimizer import make_optimizer
from ltm_jax.train.step import create_train_state

# Fields that must match (to resume_rtol()) between an interrupted+resumed run and an uninterrupted one (timings
# are excluded).
COMPARED = ("loss", "grad_norm", "lr", "val_loss", "val_bpb")


def _tree_digest(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  for f in sorted(p for p in path.rglob("*") if p.is_file()):
    digest.update(str(f.relative_to(path)).encode() + f.read_bytes())
  return digest.hexdigest()


# Long enough that a signal sent at the first log row lands mid-run; short enough to finish in seconds.
LOOP_OVERRIDES = ["train.steps=120", "train.log_every=10", "train.eval_every=60", "train.checkpoint_every=60"]


def loop_config(**model_overrides):
  return apply_overrides(micro_config(**model_overrides), LOOP_OVERRIDES)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  result = train(loop_config(), workdir, progress=False)
  return workdir, result


def test_loss_falls_and_files_are_written(uninterrupted):
  workdir, result = uninterrupted
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == list(range(10, 121, 10))
  for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec"):
    assert all(key in r for r in rows)
  assert [r["step"] for r in rows if "val_loss" in r and "val_bpb" in r] == [60, 120]
  assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
  assert result.step == 120 and result.interrupted_by is None
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [60, 120]
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert json.loads((workdir / "config.json").read_text())["model"]["d_model"] == 32


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill_9"])
def test_stopped_run_resumes_to_the_uninterrupted_metrics(uninterrupted, tmp_path, signum):
  """SIGTERM saves a checkpoint at the current step; kill -9 (sent as soon as the first checkpoint is committed, while
  later steps run) loses the steps since then. Either way the resumed run logs the uninterrupted run's numbers."""
  reference = {r["step"]: r for r in read_metrics(uninterrupted[0])}
  workdir = tmp_path / "interrupted"
  config_file = tmp_path / "micro.py"
  config_file.write_text("import sys\nsys.path.insert(0, %r)\nfrom conftest import micro_config\n"
                         "def get_config():\n  return micro_config()\n" % str(ROOT / "tests"))
  cmd = [sys.executable, "-m", "ltm_jax", "train", "--config", str(config_file), "--workdir", str(workdir),
         *LOOP_OVERRIDES]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 240
  ready = ((lambda: read_metrics(workdir)) if signum == signal.SIGTERM
           else (lambda: (workdir / "checkpoints" / "60").is_dir()))
  while time.time() < deadline and proc.poll() is None and not ready():
    time.sleep(0.01)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=240)
  stopped = ckpt_lib.Checkpointer(workdir, read_only=True).latest_step()
  if signum == signal.SIGTERM:
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "checkpoint saved" in out
    assert stopped is not None and 10 <= stopped < 120, out
  else:
    assert proc.returncode == -signal.SIGKILL, out
    assert stopped == 60, out

  result = train(loop_config(), workdir, progress=False)
  assert result.step == 120
  resumed = {r["step"]: r for r in read_metrics(workdir)}
  assert sorted(resumed) == sorted(reference)
  for step, row in reference.items():
    for key in COMPARED:
      if key in row:
        assert resumed[step][key] == pytest.approx(row[key], rel=resume_rtol()), (step, key)


def test_a_run_trained_in_pieces_logs_the_uninterrupted_metrics(uninterrupted, tmp_path):
  """train(stop_at=...) ends at that step with an evaluation and a checkpoint, and keeps train.steps' schedule."""
  reference = {r["step"]: r for r in read_metrics(uninterrupted[0])}
  workdir = tmp_path / "pieces"
  for stop_at, evaluated in ((50, [50]), (90, [50, 60, 90])):
    result = train(loop_config(), workdir, progress=False, stop_at=stop_at)
    assert result.step == stop_at and result.interrupted_by is None
    assert ckpt_lib.Checkpointer(workdir, read_only=True).latest_step() == stop_at
    assert [r["step"] for r in read_metrics(workdir) if "val_loss" in r] == evaluated
  assert train(loop_config(), workdir, progress=False).step == 120
  pieces = {r["step"]: r for r in read_metrics(workdir)}
  for step, row in reference.items():
    for key in COMPARED:
      if key in row:
        assert pieces[step][key] == pytest.approx(row[key], rel=resume_rtol()), (step, key)


def test_a_workdir_of_saved_parameters_trains_from_the_first_batch(uninterrupted, tmp_path):
  """A workdir save_params wrote (converted weights, say) holds no data position: `ltm train` fine-tunes it from the
  stream's first batch. Saved with a fresh run's initial parameters, it logs that run's metrics."""
  cfg = loop_config()
  params = init_train_state(cfg, make_optimizer(cfg.train)).params
  ckpt_lib.save_params(tmp_path, cfg, params, data_state={"converted_from": "elsewhere"})
  result = train(cfg, tmp_path, progress=False, stop_at=10)
  assert result.step == 10
  (row,), (expected, *_) = read_metrics(tmp_path), read_metrics(uninterrupted[0])
  assert row["step"] == expected["step"] == 10
  for key in COMPARED[:3]:
    np.testing.assert_allclose(row[key], expected[key], rtol=resume_rtol(), err_msg=key)


def test_a_metrics_line_cut_short_by_a_crash_does_not_swallow_the_next_row(tmp_path):
  writer = MetricsWriter(tmp_path)
  writer.write(1, {"loss": 5.0})
  writer.close()
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 2, "loss": 4.')  # The process died mid-write.
  writer = MetricsWriter(tmp_path, resume_step=1)
  writer.write(2, {"loss": 4.5})
  writer.close()
  assert read_metrics(tmp_path) == [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}]


def test_checkpoint_round_trip(tmp_path):
  cfg = micro_config()
  params = model_lib.init_params(cfg.model, jax.random.key(3))
  state = create_train_state(params, make_optimizer(cfg.train), seed=5)
  checkpointer = ckpt_lib.Checkpointer(tmp_path, keep=2)
  data_state = {"next_batch": 7, "seed": 0}
  for step in (2, 3, 4):
    checkpointer.save(step, state, data_state, cfg)
  checkpointer.close()
  assert ckpt_lib.Checkpointer(tmp_path, read_only=True).all_steps() == [3, 4]  # keep=2 prunes the oldest.
  restored, restored_data = ckpt_lib.Checkpointer(tmp_path, read_only=True).restore(4, ckpt_lib.abstract(state))
  assert restored_data == data_state
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, b)
  assert ckpt_lib.Checkpointer(tmp_path, read_only=True).saved_config(4) == cfg


def test_a_checkpoint_pruned_while_it_is_read_is_not_damaged(tmp_path, capsys):
  """`ltm eval` of a run still training: the run prunes the step being read (keep_checkpoints) and saves newer ones.
  The reader takes the newest, naming nothing damaged, and leaves the run's folders alone."""
  cfg = micro_config()
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(3)), make_optimizer(cfg.train), seed=5)
  training = ckpt_lib.Checkpointer(tmp_path, keep=2, async_save=False)
  for step in (2, 4):
    training.save(step, state, {"next_batch": step}, cfg)
  reader = ckpt_lib.Checkpointer(tmp_path, read_only=True)

  def read(step):
    if step == 4:
      for newer in (6, 8):  # The run goes on while step 4 is being read; keep=2 prunes steps 2 and 4.
        training.save(newer, state, {"next_batch": newer}, cfg)
    return reader.restore(step, ckpt_lib.abstract(state))

  step, (_, data), damaged = reader.newest_readable(read)
  training.close()
  assert (step, data, damaged) == (8, {"next_batch": 8}, [])
  assert "warning" not in capsys.readouterr().err
  assert ckpt_lib.Checkpointer(tmp_path, read_only=True).all_steps() == [6, 8]


def test_different_model_is_refused_and_nothing_is_touched(uninterrupted):
  workdir, _ = uninterrupted
  before = _tree_digest(workdir)
  with pytest.raises(CheckpointError, match=r"model.d_model: checkpoint 32, config 64"):
    train(loop_config(d_model=64), workdir, progress=False)
  with pytest.raises(CheckpointError, match=r"model.layer_pattern: checkpoint 'RA', config 'AR'"):
    train(loop_config(layer_pattern="AR"), workdir, progress=False)
  assert _tree_digest(workdir) == before


def test_resume_that_does_not_fit_the_data_state_touches_nothing(uninterrupted):
  workdir, _ = uninterrupted
  before = _tree_digest(workdir)
  with pytest.raises(DataError, match="batch_size"):
    train(apply_overrides(loop_config(), ["train.batch_size=8"]), workdir, progress=False)
  assert _tree_digest(workdir) == before


def test_resume_may_change_runtime_choices(uninterrupted, tmp_path):
  workdir = tmp_path / "copy"
  shutil.copytree(uninterrupted[0], workdir)
  cfg = apply_overrides(loop_config(), ["train.steps=123", "train.grad_clip=0", "model.wkv_impl=associative",
                                        "model.max_seq_len=256"])
  assert train(cfg, workdir, progress=False).step == 123


def test_finished_run_is_not_repeated_and_writes_nothing(uninterrupted):
  workdir, _ = uninterrupted
  before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(workdir.rglob("*"))
            if p.is_file() and p.name != "config.json"}
  result = train(loop_config(), workdir, progress=False)
  assert result.step == 120 and result.metrics == {}
  after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(workdir.rglob("*"))
           if p.is_file() and p.name != "config.json"}
  assert after == before  # No new TensorBoard events file, metrics.jsonl not rewritten, checkpoints untouched.


def test_fp8_and_the_compute_dtype_are_runtime_choices():
  """A float32 run may resume or be evaluated with FP8 projections in bfloat16, or with a bfloat16 residual stream
  (and back): same parameters."""
  plain = loop_config()
  fp8 = apply_overrides(plain, ["model.fp8=true", "model.dtype=bfloat16"])
  ckpt_lib.check_compatible(plain, fp8, "w")
  ckpt_lib.check_compatible(fp8, plain, "w")
  stream = apply_overrides(plain, ["model.dtype=bfloat16", "model.residual_dtype=bfloat16"])
  ckpt_lib.check_compatible(plain, stream, "w")
  ckpt_lib.check_compatible(stream, plain, "w")
  with pytest.raises(CheckpointError, match=r"model.d_model"):
    ckpt_lib.check_compatible(plain, apply_overrides(fp8, ["model.d_model=64"]), "w")


def test_the_blocks_that_read_z_are_part_of_the_model():
  """latent.top_layers decides which blocks hold cross-attention weights: a change is refused by name (not reported as
  damaged checkpoints), while None and n_layers (every block) are the same model."""
  latent = apply_overrides(loop_config(), ["latent.enabled=true", "latent.top_layers=null"])
  ckpt_lib.check_compatible(latent, apply_overrides(latent, ["latent.top_layers=2"]), "w")  # n_layers = 2.
  with pytest.raises(CheckpointError, match=r"latent.top_layers: checkpoint 2, config 1"):
    ckpt_lib.check_compatible(latent, apply_overrides(latent, ["latent.top_layers=1"]), "w")


def test_memory_keys_matter_only_to_models_with_their_layers():
  plain, titans = loop_config(), loop_config(layer_pattern="MA", window=8)
  deeper = lambda cfg: apply_overrides(cfg, ["model.memory_depth=2", "model.memory_impl=scan"])
  ckpt_lib.check_compatible(plain, deeper(plain), "w")  # An RA model has no memory: its memory keys mean nothing.
  ckpt_lib.check_compatible(titans, apply_overrides(titans, ["model.memory_impl=scan"]), "w")  # A runtime choice.
  with pytest.raises(CheckpointError, match=r"model.memory_depth: checkpoint 1, config 2"):
    ckpt_lib.check_compatible(titans, deeper(titans), "w")
  mmrec = loop_config(layer_pattern="DA", window=8)
  more_slots = lambda cfg: apply_overrides(cfg, ["model.mmrec_slots=3", "model.mmrec_remat=recurrence"])
  ckpt_lib.check_compatible(plain, more_slots(plain), "w")
  ckpt_lib.check_compatible(mmrec, apply_overrides(mmrec, ["model.mmrec_remat=recurrence"]), "w")
  with pytest.raises(CheckpointError, match=r"model.mmrec_slots: checkpoint \d+, config 3"):
    ckpt_lib.check_compatible(mmrec, more_slots(mmrec), "w")
