"""Series data: the train/validation split is a function of (data, fraction, seed), stratified and complete; the batch
stream resumes exactly; bad rows are named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ltm_jax.config import TimeSeriesConfig
from ltm_jax.errors import DataError
from ltm_jax.timeseries import data


def _labelled(n=40, length=9, seed=0):
  rng = np.random.default_rng(seed)
  labels = np.array(["a"] * (n // 2) + ["b"] * (n // 4) + ["c"] * (n - n // 2 - n // 4))
  return data.from_arrays(rng.standard_normal((n, length)), labels, task="classification")


def _rows(s: data.SeriesSet) -> set[bytes]:
  return {row.tobytes() for row in s.x}


def test_the_split_is_deterministic_stratified_and_complete():
  full = _labelled()
  train, val = data.split(full, 0.25, seed=3)
  again_train, again_val = data.split(full, 0.25, seed=3)
  np.testing.assert_array_equal(val.x, again_val.x)
  np.testing.assert_array_equal(train.y, again_train.y)
  assert _rows(train) | _rows(val) == _rows(full) and not _rows(train) & _rows(val)
  # round(0.25 * n_c) of every class: 20, 10, 10 series -> 5, 2 (banker's rounding of 2.5), 2.
  assert np.bincount(val.y, minlength=3).tolist() == [5, 2, 2]
  _, other_val = data.split(full, 0.25, seed=4)
  assert _rows(other_val) != _rows(val)


def test_the_shipped_dataset_loads_to_the_same_splits_every_time():
  pytest.importorskip("aeon")
  ts = TimeSeriesConfig(enabled=True, source="aeon:GunPoint", val_fraction=0.2)
  first, second = data.load_splits(ts, seed=0), data.load_splits(ts, seed=0)
  for part in ("train", "val", "test"):
    a, b = getattr(first, part), getattr(second, part)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
  # GunPoint: 50 training series (25 per class), 150 test series of 150 steps; normalised per series.
  assert (len(first.train), len(first.val), len(first.test)) == (40, 10, 150)
  assert first.train.classes == ("1", "2") and np.bincount(first.val.y).tolist() == [5, 5]
  np.testing.assert_allclose(first.test.x.mean(axis=1), 0, atol=1e-5)
  np.testing.assert_allclose(first.test.x.std(axis=1), 1, atol=1e-4)


def test_the_batch_stream_resumes_exactly_and_visits_every_series_once_per_epoch():
  full = _labelled(n=12)
  loader = data.SeriesLoader(full, 4, seed=7, worker_threads=1, prefetch=1)
  batches = [next(loader) for _ in range(6)]
  loader.close()
  epoch = np.concatenate([b["series"] for b in batches[:3]])
  assert _rows(dataclasses.replace(full, x=epoch)) == _rows(full)
  resumed = data.SeriesLoader(full, 4, seed=7, worker_threads=1, prefetch=1)
  state = {**resumed.get_state(), "next_batch": 2}
  resumed.set_state(state)
  for expected in batches[2:]:
    got = next(resumed)
    for key in ("series", "mask", "labels"):
      np.testing.assert_array_equal(got[key], expected[key])
  other = data.SeriesLoader(_labelled(n=12, seed=1), 4, seed=7, worker_threads=1, prefetch=1)
  with pytest.raises(DataError, match="data="):
    other.set_state(state)
  for stream in (resumed, other):
    stream.close()


def test_eval_batches_fill_the_last_batch_and_count_only_real_rows():
  full = _labelled(n=10)
  batches = data.eval_batches(full, 4)
  assert [b["series"].shape[0] for b in batches] == [4, 4, 4]
  assert [b["count"].sum() for b in batches] == [4, 4, 2]
  np.testing.assert_array_equal(np.concatenate([b["labels"][b["count"] > 0] for b in batches]), full.y)


def test_a_nan_names_its_row_and_step():
  x = np.random.default_rng(0).standard_normal((5, 8))
  x[3, 6] = np.nan
  with pytest.raises(DataError, match=r"^train.csv: row 3 has a NaN value at step 6"):
    data.from_arrays(x, np.zeros(5), task="classification", where="train.csv")
  mask = np.ones((5, 8), bool)
  mask[3, :7] = False  # Masked padding may hold anything.
  assert len(data.from_arrays(x, np.zeros(5), mask, task="classification")) == 5


def test_ragged_rows_without_a_mask_are_named_and_pad_left_masks_them():
  rows = [np.ones(9), np.ones(9), np.ones(7)]
  with pytest.raises(DataError, match="row 2 has 7 steps but row 0 has 9"):
    data.from_arrays(rows, np.zeros(3), task="regression")
  x, mask = data.pad_left(rows)
  assert x.shape == (3, 9, 1) and mask.sum(axis=1).tolist() == [9, 9, 7] and not mask[2, :2].any()
  assert len(data.from_arrays(x, np.zeros(3), mask, task="regression")) == 3


def test_labels_outside_the_classes_and_bad_targets_are_named():
  x = np.zeros((4, 3))
  with pytest.raises(DataError, match="row 2 has label 'z', not one of the 2 classes a, b"):
    data.from_arrays(x, np.array(["a", "b", "z", "a"]), task="classification", classes=("a", "b"))
  with pytest.raises(DataError, match="row 1 has target nan"):
    data.from_arrays(x, np.array([0.5, np.nan, 1.0, 2.0]), task="regression")
  mask = np.array([[True, False, True]] * 4)
  with pytest.raises(DataError, match="row 0 has a masked step 1 after a valid one"):
    data.from_arrays(x, np.zeros(4), mask, task="regression")


def test_sets_without_series_and_files_numpy_cannot_read_are_refused(tmp_path):
  with pytest.raises(DataError, match="^test.npz holds no series$"):
    data.from_arrays(np.zeros((0, 5)), np.zeros(0), task="classification", where="test.npz")
  with pytest.raises(DataError, match="^x.npz holds no series$"):
    data.from_arrays(np.float32(1.0), np.zeros(1), task="regression", where="x.npz")
  with pytest.raises(DataError, match=r"series must be \[N, T\] or \[N, T, F\]; row 0 has 0 dimensions"):
    data.from_arrays(np.arange(5.0), np.zeros(5), task="regression")
  np.savez(tmp_path / "whole.npz", x=np.zeros((4, 3)), y=np.zeros(4))
  (tmp_path / "cut.npz").write_bytes((tmp_path / "whole.npz").read_bytes()[:200])
  with pytest.raises(DataError, match="cut.npz is not a readable .npz of numeric arrays"):
    data.load_splits(TimeSeriesConfig(enabled=True, source=str(tmp_path / "cut.npz")), seed=0)


def test_a_validation_split_never_takes_a_class_whole():
  x = np.random.default_rng(0).standard_normal((12, 4))
  labels = np.array(["a"] * 10 + ["b"] * 2)  # round(0.75 * 2) = 2: both "b" series would be held out.
  full = data.from_arrays(x, labels, task="classification")
  with pytest.raises(DataError, match="val_fraction=0.75 holds out every training series of class 'b' \\(2 series\\)"):
    data.split(full, 0.75, seed=0)
  train, _ = data.split(full, 0.5, seed=0)
  assert np.bincount(train.y).tolist() == [5, 1]


def test_the_stream_fingerprint_ignores_padding_every_row_shares():
  """load_splits pads the training series to a longer test split's length: the same data, the same stream."""
  full = _labelled(n=12)
  assert data.fingerprint(data._to_length(full, full.length + 5)) == data.fingerprint(full)
  changed = dataclasses.replace(full, x=full.x.copy())
  changed.x[3, -1, 0] += 1.0
  assert data.fingerprint(changed) != data.fingerprint(full)


def test_aeon_names_and_tasks_are_checked():
  pytest.importorskip("aeon")
  for name in ("..", "GunPoint/", "", "NoSuchSet"):
    with pytest.raises(DataError, match=f"aeon does not ship a dataset called {name!r}; shipped: .*GunPoint"):
      data.load_splits(TimeSeriesConfig(enabled=True, source=f"aeon:{name}"), seed=0)
  with pytest.raises(DataError, match="^aeon:GunPoint is a classification dataset; set timeseries.task=classif"):
    data.load_splits(TimeSeriesConfig(enabled=True, source="aeon:GunPoint", task="regression"), seed=0)
