"""TrainLoader (shuffled, resumable, prefetching) and eval_batches (fixed validation windows)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from ltm_jax.data.loader import TrainLoader, eval_batches
from ltm_jax.errors import DataError

B, T = 4, 8


def arange_tokens(n):
  # Token value == position, so a window's start is its first input.
  return np.arange(n, dtype=np.uint32)


def take(loader, n):
  return [next(loader) for _ in range(n)]


def assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["targets"], b["targets"])


def test_shapes_dtypes_and_target_shift():
  tokens = np.random.default_rng(0).integers(0, 259, size=5000).astype(np.uint16)
  with TrainLoader(tokens, B, T, seed=0) as loader:
    for batch in take(loader, 20):
      assert set(batch) == {"inputs", "targets"}
      for x in batch.values():
        assert x.dtype == np.int32 and x.shape == (B, T)
      np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
      # Every row is a contiguous span of the token array.
      for row_in, row_tg in zip(batch["inputs"], batch["targets"]):
        window = np.concatenate([row_in, row_tg[-1:]])
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, T + 1) == window, axis=1))
        assert len(starts) >= 1


def test_same_seed_same_batches_other_seed_other_order():
  tokens = arange_tokens(2000)
  a = take(TrainLoader(tokens, B, T, seed=3), 10)
  assert_same(a, take(TrainLoader(tokens, B, T, seed=3), 10))
  c = take(TrainLoader(tokens, B, T, seed=4), 10)
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_threads_do_not_change_the_stream():
  tokens = arange_tokens(2000)
  assert_same(take(TrainLoader(tokens, B, T, seed=1, worker_threads=0, prefetch=0), 30),
              take(TrainLoader(tokens, B, T, seed=1, worker_threads=2, prefetch=4), 30))


@pytest.mark.parametrize("n_before", [0, 7, 23])  # 23 batches crosses an epoch boundary (17.5 batches per epoch).
def test_resume_yields_the_uninterrupted_batches(n_before):
  tokens = arange_tokens(561)  # 70 windows of T=8 with no slack.
  loader = TrainLoader(tokens, B, T, seed=5)
  take(loader, n_before)
  state = json.loads(json.dumps(loader.get_state()))  # As saved in a checkpoint.
  expected = take(loader, 12)
  resumed = TrainLoader(tokens, B, T, seed=5)
  resumed.set_state(state)
  assert_same(expected, take(resumed, 12))
  assert resumed.get_state()["next_batch"] == n_before + 12
  # Rewinding a loader that has already run ahead works the same way.
  loader.set_state(state)
  assert_same(expected, take(loader, 12))


@pytest.mark.parametrize("slack", [0, 5])
def test_epochs_visit_every_window_once_and_reshuffle(slack):
  n_windows = 10
  tokens = arange_tokens(n_windows * T + 1 + slack)
  loader = TrainLoader(tokens, 3, T, seed=0)
  assert loader.num_windows == n_windows
  # 40 batches of 3 = 12 epochs; batches run across epoch boundaries.
  starts = np.concatenate([b["inputs"][:, 0] for b in take(loader, 40)])
  epochs = starts.reshape(12, n_windows)
  offsets = set()
  for epoch in epochs:
    offset = int(epoch.min())
    offsets.add(offset)
    assert 0 <= offset <= slack
    np.testing.assert_array_equal(np.sort(epoch - offset), np.arange(n_windows) * T)
  orders = {tuple(np.argsort(e)) for e in epochs}
  assert len(orders) > 1  # Reshuffled across epochs.
  assert (len(offsets) > 1) == (slack > 0)  # Slack tokens are reached through per-epoch offsets.
  assert loader.epoch == pytest.approx(12.0)


def test_tiny_corpus_and_memmap(tmp_path):
  path = tmp_path / "t.bin"
  arange_tokens(T + 1).astype(np.uint16).tofile(path)
  tokens = np.memmap(path, dtype=np.uint16, mode="r")
  batch = next(TrainLoader(tokens, B, T, seed=0))  # One window; every row repeats it.
  np.testing.assert_array_equal(batch["inputs"], np.tile(np.arange(T), (B, 1)))
  with pytest.raises(DataError, match="fewer than one window"):
    TrainLoader(arange_tokens(T), B, T, seed=0)


def test_state_for_other_data_is_rejected():
  loader = TrainLoader(arange_tokens(500), B, T, seed=0)
  state = loader.get_state()
  for key, value in (("seed", 1), ("batch_size", 8), ("num_tokens", 499), ("format", "other")):
    with pytest.raises(DataError, match=key if key != "format" else "format"):
      loader.set_state({**state, key: value})
  with pytest.raises(DataError, match="next_batch"):
    loader.set_state({**state, "next_batch": -1})


def test_state_is_json():
  loader = TrainLoader(arange_tokens(500), B, T, seed=np.int64(2))
  take(loader, 3)
  state = loader.get_state()
  assert json.loads(json.dumps(state)) == state and state["next_batch"] == 3


def test_eval_batches_are_fixed_and_spread():
  tokens = arange_tokens(100 * T + 1)
  batches = eval_batches(tokens, B, T, n_batches=5)
  assert_same(batches, eval_batches(tokens, B, T, n_batches=5))
  assert len(batches) == 5
  starts = np.concatenate([b["inputs"][:, 0] for b in batches])
  assert len(set(starts)) == 20 and np.all(starts % T == 0)
  assert starts.min() == 0 and starts.max() >= 90 * T  # Spread over the whole split, not its head.
  for b in batches:
    assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (B, T)
    np.testing.assert_array_equal(b["inputs"] + 1, b["targets"])


def test_eval_batches_with_few_windows():
  # 10 windows: two full batches of 4 rather than the 5 asked for.
  assert len(eval_batches(arange_tokens(10 * T + 1), B, T, n_batches=5)) == 2
  # 2 windows: one smaller batch holding both.
  (only,) = eval_batches(arange_tokens(2 * T + 1), B, T, n_batches=5)
  assert only["inputs"].shape == (2, T)
  with pytest.raises(DataError, match="fewer than one window"):
    eval_batches(arange_tokens(T), B, T, n_batches=1)


def test_loader_is_an_iterator():
  loader = TrainLoader(arange_tokens(500), B, T, seed=0)
  assert iter(loader) is loader
  assert len(list(itertools.islice(loader, 3))) == 3
  loader.close()
  loader.close()
