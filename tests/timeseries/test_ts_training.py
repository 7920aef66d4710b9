"""`ltm train` on time series through the shared loop: the shipped config trains (shrunk) on its aeon dataset with
accuracy in metrics.jsonl, TensorBoard events and orbax checkpoints, resumes to the uninterrupted run's numbers, a
regression run reports RMSE, and bad rows are refused on one line before anything is written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import ROOT, resume_rtol
from ltm_jax import cli
from ltm_jax.train.metrics import read_metrics

CONFIG = str(ROOT / "configs" / "ts_gunpoint.py")
# The shipped config, shrunk to a model and run that compile and finish in seconds.
MICRO = ["model.d_model=8", "model.n_layers=1", "model.n_heads=1", "model.rwkv7_head_size=8",
         "model.rwkv7_decay_lora=4", "model.rwkv7_iclr_lora=4", "model.rwkv7_value_lora=4", "model.rwkv7_gate_lora=4",
         "timeseries.spectrum_bins=4", "timeseries.patch=10", "train.batch_size=8", "train.warmup_steps=1",
         "train.log_every=2", "train.eval_every=2", "train.checkpoint_every=2", "train.async_checkpoint=false",
         "data.prefetch=1", "timeseries.val_fraction=0.2"]
COMPARED = ("loss", "accuracy", "grad_norm", "lr", "val_loss", "val_accuracy", "test_loss", "test_accuracy")


def _train(capsys, workdir, *overrides) -> tuple[int, str, str]:
  code = cli.main(["train", "--config", CONFIG, "--workdir", str(workdir), *MICRO, *overrides])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.long
def test_the_shipped_config_trains_checkpoints_and_resumes_to_the_same_numbers(tmp_path, capsys):
  pytest.importorskip("aeon")
  code, out, _ = _train(capsys, tmp_path / "whole", "train.steps=4")
  assert code == 0 and "test_accuracy" in out
  # A run stopped after its step-2 checkpoint: the same workdir without the later checkpoint.
  shutil.copytree(tmp_path / "whole", tmp_path / "split")
  shutil.rmtree(tmp_path / "split" / "checkpoints" / "4")
  code, out, _ = _train(capsys, tmp_path / "split", "train.steps=4")
  assert code == 0 and "resuming from step 2" in out
  whole, split = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
  assert [r["step"] for r in whole] == [r["step"] for r in split] == [2, 4]
  for a, b in zip(whole, split):
    for key in COMPARED:
      if key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=resume_rtol(), err_msg=key)
  last = whole[-1]
  assert 0 <= last["test_accuracy"] <= 1 and last["test_series"] == 150 and last["val_series"] == 10
  assert last["series"] == 4 * 8 and last["series_per_sec"] > 0 and "test_accuracy" not in whole[0]
  assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["2", "4"]
  assert any((tmp_path / "whole" / "tensorboard").glob("events.out.tfevents.*"))
  saved = json.loads((tmp_path / "whole" / "config.json").read_text())
  assert saved["timeseries"]["source"] == "aeon:GunPoint"
  # The decoder-only commands refuse the workdir and the config instead of reading them as a decoder LM.
  for argv in (["eval", "--workdir", str(tmp_path / "whole")], ["info", "--config", CONFIG]):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "this is a time-series model" in err, err


def _regression_files(folder, n=24, length=12):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, length))
  y = x[:, -3:].mean(axis=1)  # A target the recurrence can read off the last steps.
  np.savez(folder / "train.npz", x=x[:16], y=y[:16])
  np.savez(folder / "test.npz", x=x[16:], y=y[16:])


def test_a_regression_run_reports_rmse_in_the_targets_units(tmp_path, capsys):
  _regression_files(tmp_path)
  code, out, err = _train(capsys, tmp_path / "w", "train.steps=2", "timeseries.task=regression",
                          f"timeseries.source={tmp_path / 'train.npz'}",
                          f"timeseries.test_source={tmp_path / 'test.npz'}",
                          "timeseries.val_fraction=0.25", "timeseries.normalize=false", "model.layer_pattern=R")
  assert code == 0, err
  last = read_metrics(tmp_path / "w")[-1]
  assert {"mse", "val_rmse", "val_mae", "test_rmse", "test_mae"} <= set(last) and last["test_series"] == 8
  assert last["test_rmse"] >= last["test_mae"] > 0


def _write_table(path, rows):
  path.write_text("".join(",".join(str(v) for v in row) + "\n" for row in rows))


@pytest.mark.parametrize("case", ["nan", "ragged", "unknown_label"])
def test_bad_rows_are_refused_on_one_line_before_anything_is_written(tmp_path, capsys, case):
  rng = np.random.default_rng(1)
  train = [[("a", "b")[i % 2], *np.round(rng.standard_normal(6), 3)] for i in range(8)]
  test = [list(row) for row in train[:4]]
  expected = {"nan": "train.csv: row 5 has a NaN value at step 2",
              "ragged": "train.csv: row 3 has 4 steps but row 0 has 6",
              "unknown_label": "test.csv: row 2 has label 'c', not one of the 2 classes a, b"}[case]
  if case == "nan":
    train[5][3] = "nan"
  elif case == "ragged":
    train[3] = train[3][:5]
  else:
    test[2][0] = "c"
  _write_table(tmp_path / "train.csv", train)
  _write_table(tmp_path / "test.csv", test)
  workdir = tmp_path / "w"
  code, out, err = _train(capsys, workdir, f"timeseries.source={tmp_path / 'train.csv'}",
                          f"timeseries.test_source={tmp_path / 'test.csv'}")
  assert code == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
  assert err.startswith("error: ") and expected in err, err
  assert not workdir.exists()


def test_a_resume_on_data_of_other_classes_is_refused_on_one_line_and_a_longer_test_split_resumes(tmp_path, capsys):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((24, 12))
  np.savez(tmp_path / "two.npz", x=x, y=np.array([0, 1] * 12))
  np.savez(tmp_path / "three.npz", x=x, y=np.array([0, 1, 2] * 8))
  np.savez(tmp_path / "long_test.npz", x=rng.standard_normal((6, 16)), y=np.array([0, 1] * 3))
  workdir = tmp_path / "w"
  code, _, err = _train(capsys, workdir, "train.steps=2", f"timeseries.source={tmp_path / 'two.npz'}",
                        "model.layer_pattern=R")
  assert code == 0, err
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob("*")}
  code, out, err = _train(capsys, workdir, "train.steps=4", f"timeseries.source={tmp_path / 'three.npz'}",
                          "model.layer_pattern=R")
  assert code == 2 and len(err.splitlines()) == 1, err
  assert (f"error: {workdir}: checkpoint step 2 is of a model of other sizes: its params/head/bias is [2], this "
          f"model's [3]; {tmp_path / 'three.npz'} has other classes or features") in err, err
  assert {p: p.stat().st_mtime_ns for p in workdir.rglob("*")} == before
  # A test split of longer series pads the training series to its length: the same training stream resumes.
  code, out, err = _train(capsys, workdir, "train.steps=4", f"timeseries.source={tmp_path / 'two.npz'}",
                          f"timeseries.test_source={tmp_path / 'long_test.npz'}", "model.layer_pattern=R")
  assert code == 0 and "resuming from step 2" in out and "test_accuracy" in out, err
  assert np.isfinite(read_metrics(workdir)[-1]["loss"])
