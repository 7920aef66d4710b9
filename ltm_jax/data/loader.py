"""Batches of token windows: a shuffled, resumable training stream (grain) and fixed validation batches.

A window is seq_len+1 consecutive tokens; inputs are its first seq_len tokens and targets its last seq_len. Windows
start every seq_len tokens, so neighbours share one token and each token is a target at most once per epoch. The
slack left after the last full window (fewer than seq_len tokens) is used by shifting all window starts of an epoch by
an offset in [0, slack] drawn from (seed, epoch): every token is seen in some epochs, and window boundaries move.
"""

from __future__ import annotations

import abc
import functools
import numbers
from typing import Any

import grain
import numpy as np

from ltm_jax.errors import DataError



def _num_windows(num_tokens: int, seq_len: int) -> int:
  return (num_tokens - 1) // seq_len if num_tokens > seq_len else 0


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
  """Windows at `starts[rows]` -> {"inputs", "targets"}: int32 [rows, seq_len], targets shifted one ahead."""
  starts = starts[rows]
  # One fancy-indexing read per batch instead of B slices; also works on np.memmap without loading the file.
  windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


@functools.lru_cache(maxsize=64)
def _epoch_offset(seed: int, slack: int, epoch: int) -> int:
  # Cached: a Generator per window would cost more than the gather. lru_cache is safe across grain's reader threads.
  return int(np.random.default_rng([seed, epoch]).integers(slack + 1)) if slack else 0


class _WindowStarts:
  """(stream index, window) -> first token of the window, shifted by the epoch's offset in [0, slack]."""

  def __init__(self, num_windows: int, seq_len: int, slack: int, seed: int):
    self.num_windows, self.seq_len, self.slack, self.seed = num_windows, seq_len, slack, seed

  def __call__(self, index: int, window: int) -> int:
    return window * self.seq_len + _epoch_offset(self.seed, self.slack, index // self.num_windows)


class ResumableLoader(abc.ABC):
  """An endless stream of batches read from `batches`, a deterministic grain MapDataset indexed by batch number,
  with `read_options` threads assembling batches ahead of the caller. Its position is the next batch number, so
  `get_state` is that counter plus `stream_keys()` (what the stream depends on), and `set_state` checks those and
  restarts the pipeline at the saved batch."""
  STATE_FORMAT = ""

  def __init__(self, batches, read_options):
    self._batches, self._read_options = batches, read_options
    self._next_batch, self._iterator = 0, None
    self._restart()

  @abc.abstractmethod
  def stream_keys(self) -> dict[str, Any]:
    """What the stream depends on besides the batch counter (seed, batch size, a fingerprint of the data)."""

  def _restart(self) -> None:
    if self._iterator is not None:
      self._iterator.close()
    # Slicing the deterministic MapDataset (rather than restoring grain's own iterator state) keeps checkpoints
    # independent of grain's internal state format, which grain may change between versions.
    self._iterator = iter(self._batches[self._next_batch:].to_iter_dataset(self._read_options))
    # Begin assembling batches now, so the first ones are ready by the time the model has compiled.
    self._iterator.start_prefetch()

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    self._next_batch += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position in the stream: the next batch index plus what the stream depends on."""
    return {"format": self.STATE_FORMAT, "next_batch": self._next_batch, **self.stream_keys()}

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from `state` (from `get_state`); the following batches equal those of the uninterrupted loader.

    Raises DataError if the state belongs to a stream with other data, seed, batch size or sequence length.
    """
    if state.get("format") != self.STATE_FORMAT:
      raise DataError(f"data loader state has format {state.get('format')!r}, expected {self.STATE_FORMAT!r}")
    for key, value in self.stream_keys().items():
      if state.get(key) != value:
        raise DataError(f"data loader state was saved with {key}={state.get(key)!r} but the loader has "
                        f"{key}={value!r}; the resumed batches would not continue the saved run")
    next_batch = state.get("next_batch")
    if isinstance(next_batch, bool) or not isinstance(next_batch, numbers.Integral) or next_batch < 0:
      raise DataError(f"data loader state has an invalid next_batch={next_batch!r}")
    self._next_batch = int(next_batch)
    self._restart()

  def close(self) -> None:
    """Stops the background threads. Idempotent."""
    if self._iterator is not None:
      self._iterator.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class TrainLoader(ResumableLoader):
  """Endless stream of shuffled training batches {"inputs", "targets"}: np.int32 [batch_size, seq_len].

  Each epoch visits every window once in an order drawn from (seed, epoch); batches run across epoch boundaries.
  `worker_threads` threads assemble up to `prefetch` batches in the background while the caller trains. The stream is
  a pure function of (tokens, batch_size, seq_len, seed) and the batch counter, so `get_state()` is just that counter
  (plus a fingerprint to catch resuming with other data), and `set_state` restarts the pipeline at that batch.

  `shard=(index, count)`: for multi-process training, yield only rows [index, index + 1) * batch_size / count of
  every global batch (the rows this process's devices hold); the stream and its state are the global ones, so every
  process agrees on the position and together they read exactly the single-process batches.
  """
  STATE_FORMAT = "ltm_jax.TrainLoader/1"

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, worker_threads: int = 2,
               prefetch: int = 4, shard: tuple[int, int] = (0, 1)):
    if batch_size <= 0 or seq_len <= 0:
      raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
    index, count = shard
    if count < 1 or not 0 <= index < count or batch_size % count:
      raise ValueError(f"shard {shard} must be (index, count) with 0 <= index < count and count dividing "
                       f"batch_size={batch_size}")
    rows = slice(index * batch_size // count, (index + 1) * batch_size // count)
    self._tokens = tokens
    self.batch_size = int(batch_size)
    self.seq_len = int(seq_len)
    self.seed = int(seed)
    self.num_windows = _num_windows(len(tokens), seq_len)
    if self.num_windows == 0:
      raise DataError(f"{len(tokens):,} training tokens are fewer than one window of seq_len+1={seq_len + 1}")
    # grain shuffles epoch e with seed+e, so user seeds 0 and 1 would share epochs shifted by one; hashing the user
    # seed into two unrelated 32-bit words avoids that and gives the offsets their own stream.
    shuffle_seed, offset_seed = (int(w) for w in np.random.SeedSequence(self.seed % 2**64).generate_state(2))
    slack = len(tokens) - 1 - self.num_windows * seq_len
    batches = (
        grain.MapDataset.range(self.num_windows)
        .shuffle(seed=shuffle_seed)
        .repeat()  # Infinite; reseeds the shuffle every epoch.
        .map_with_index(_WindowStarts(self.num_windows, seq_len, slack, offset_seed))
        .batch(batch_size)
        .map(functools.partial(_gather, tokens, seq_len=seq_len, rows=rows)))
    super().__init__(batches, grain.ReadOptions(num_threads=worker_threads, prefetch_buffer_size=prefetch))

  def stream_keys(self) -> dict[str, Any]:
    return {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
            "num_tokens": len(self._tokens)}

  @property
  def batches_per_epoch(self) -> float:
    return self.num_windows / self.batch_size

  @property
  def epoch(self) -> float:
    """Fractional epochs consumed so far."""
    return self._next_batch * self.batch_size / self.num_windows


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, n_batches: int) -> list[dict[str, np.ndarray]]:
  """Fixed validation batches {"inputs", "targets"}: np.int32 [batch_size, seq_len], windows evenly spaced.

  With fewer than n_batches*batch_size windows, as many full batches as exist are returned; with fewer than
  batch_size windows, a single smaller batch holds all of them. DataError if not even one window fits.
  """
  available = _num_windows(len(tokens), seq_len)
  if available == 0:
    raise DataError(f"{len(tokens):,} validation tokens are fewer than one window of seq_len+1={seq_len + 1}")
  n_batches = max(1, min(n_batches, available // batch_size))
  count = min(n_batches * batch_size, available)
  # Strictly increasing since available >= count: distinct windows spread over the whole split.
  starts = (np.arange(count, dtype=np.int64) * available // count) * seq_len
  return [_gather(tokens, starts[i:i + batch_size], seq_len) for i in range(0, count, batch_size)]


def _document_batch(documents, batch_size: int, rows: slice, batch: int) -> dict[str, np.ndarray]:
  """Batch `batch` of a document stream: documents batch * batch_size + [rows], each a row of seq_len + 1 tokens."""
  indices = np.arange(batch * batch_size, (batch + 1) * batch_size)[rows]
  windows = np.asarray(documents(indices), dtype=np.int32)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class DocumentLoader(ResumableLoader):
  """Endless stream of batches whose every row is one whole document of a generated stream (never repeated).

  `documents(indices) -> [n, seq_len + 1]` token ids must be a pure function of each index (a synthetic source such
  as `ltm_jax.data.markov`), so batch b is documents [b * batch_size, (b + 1) * batch_size) whichever thread or
  process draws it, and the position is the batch counter. `shard` as for `TrainLoader`."""
  STATE_FORMAT = "ltm_jax.DocumentLoader/1"
  _ENDLESS = 1 << 40  # Batches: far beyond any run, and finite as grain's MapDataset needs.

  def __init__(self, documents, batch_size: int, stream_keys: dict[str, Any], worker_threads: int = 2,
               prefetch: int = 4, shard: tuple[int, int] = (0, 1)):
    index, count = shard
    if batch_size <= 0 or count < 1 or not 0 <= index < count or batch_size % count:
      raise ValueError(f"batch_size={batch_size} must be positive and shard {shard} (index, count) with count "
                       "dividing it")
    self.batch_size, self._keys = int(batch_size), dict(stream_keys, batch_size=int(batch_size))
    rows = slice(index * batch_size // count, (index + 1) * batch_size // count)
    batches = grain.MapDataset.range(self._ENDLESS).map(
        functools.partial(_document_batch, documents, self.batch_size, rows))
    super().__init__(batches, grain.ReadOptions(num_threads=worker_threads, prefetch_buffer_size=prefetch))

  def stream_keys(self) -> dict[str, Any]:
    return dict(self._keys)
