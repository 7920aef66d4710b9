"""Labelled series: loading (datasets aeon ships, .npz and UCR-layout .csv/.tsv files), checks that name the bad
row, z-normalisation, a deterministic stratified train/validation split, a resumable shuffled batch stream and fixed
evaluation batches.

Series are stored left-padded to one length: x [N, T, F] float32 with mask [N, T] bool (False before each series'
first real step), so every row of a batch ends at the same step, the layout the recurrent layers' padding rules
expect.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from ltm_jax.data.loader import ResumableLoader
from ltm_jax.errors import DataError

AEON_PREFIX = "aeon:"


@dataclasses.dataclass(frozen=True)
class SeriesSet:
  """x [N, T, F] float32 (zero where mask is False), mask [N, T] bool, y [N]: int32 class indices into `classes`
  for classification, float32 targets for regression (classes empty)."""
  x: np.ndarray
  mask: np.ndarray
  y: np.ndarray
  classes: tuple[str, ...] = ()

  def __len__(self) -> int:
    return len(self.y)

  @property
  def length(self) -> int:
    return self.x.shape[1]

  @property
  def features(self) -> int:
    return self.x.shape[2]

  def subset(self, rows: np.ndarray) -> SeriesSet:
    return SeriesSet(self.x[rows], self.mask[rows], self.y[rows], self.classes)


def pad_left(series: Sequence[Any], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Ragged series (each [T_i] or [T_i, F]) -> (x [N, T, F] float32 left-padded with zeros, mask [N, T] bool), with
  T = `length` or the longest series."""
  rows = [_steps_by_features(np.asarray(s, np.float32)) for s in series]
  length = max(len(r) for r in rows) if length is None else length
  features = rows[0].shape[1] if rows else 1
  x = np.zeros((len(rows), length, features), np.float32)
  mask = np.zeros((len(rows), length), bool)
  for i, r in enumerate(rows):
    if len(r) > length or r.shape[1] != features:
      raise DataError(f"series row {i} has shape {r.shape}, which does not fit [{length}, {features}]")
    x[i, length - len(r):], mask[i, length - len(r):] = r, True
  return x, mask


def _steps_by_features(row: np.ndarray) -> np.ndarray:
  return row[:, None] if row.ndim == 1 else row


def from_arrays(x, y, mask=None, *, task: str, classes: Sequence[str] | None = None,
                where: str = "series") -> SeriesSet:
  """Checks and packs series. x: [N, T] or [N, T, F] (or a list of equal-length rows); y: [N] labels (any values
  that compare: strings, ints) or float targets; mask: [N, T] bool, False on left padding.

  `classes`: the label set of a classification task, in index order (None: the sorted labels of y). DataError
  naming the first bad row of `where`: rows of different lengths without a mask, a NaN or infinity among a row's
  valid steps, valid steps after padding, a row with no valid step, a label outside `classes`, a non-finite target.
  """
  if not hasattr(x, "__len__") or isinstance(x, np.ndarray) and x.ndim == 0 or len(x) == 0:
    raise DataError(f"{where} holds no series")
  rows = list(x) if not isinstance(x, np.ndarray) else x
  flat = next((i for i, r in enumerate(rows) if np.ndim(r) not in (1, 2)), None)
  if flat is not None:
    raise DataError(f"{where}: series must be [N, T] or [N, T, F]; row {flat} has {np.ndim(rows[flat])} dimensions")
  if mask is None:
    lengths = [np.shape(r)[0] for r in rows]
    for i, n in enumerate(lengths):
      if n != lengths[0]:
        raise DataError(f"{where}: row {i} has {n} steps but row 0 has {lengths[0]}; series of different lengths "
                        "need left padding to one length and a mask (ltm_jax.timeseries.pad_left gives both)")
  try:
    array = np.asarray(rows, np.float32)
  except ValueError as e:
    raise DataError(f"{where}: the series do not form one array [N, T(, F)]: {e}") from None
  if array.ndim == 2:
    array = array[:, :, None]
  if array.ndim != 3 or array.shape[1] == 0:
    raise DataError(f"{where}: series must be [N, T] or [N, T, F] with T >= 1, got shape {array.shape}")
  n, length, _ = array.shape
  mask = np.ones((n, length), bool) if mask is None else np.asarray(mask)
  if mask.shape != (n, length) or mask.dtype != bool:
    raise DataError(f"{where}: mask must be bool [N, T] = [{n}, {length}], got {mask.dtype} {list(mask.shape)}")
  labels = np.asarray(y)
  if labels.shape != (n,):
    raise DataError(f"{where}: {n} series but labels of shape {list(labels.shape)}")
  _check_rows(array, mask, where)
  array = np.where(mask[..., None], array, 0.0).astype(np.float32)  # Padding values never reach the model.
  if task == "regression":
    try:
      targets = labels.astype(np.float32)
    except ValueError as e:
      raise DataError(f"{where}: regression targets must be numbers: {e}") from None
    bad = np.flatnonzero(~np.isfinite(targets))
    if bad.size:
      raise DataError(f"{where}: row {bad[0]} has target {labels.tolist()[bad[0]]!r}; regression targets must be "
                      "finite")
    return SeriesSet(array, mask, targets)
  names = tuple(str(c) for c in (sorted(set(labels.tolist())) if classes is None else classes))
  index = {c: i for i, c in enumerate(names)}
  indices = np.empty(n, np.int32)
  for i, label in enumerate(labels.tolist()):
    if str(label) not in index:
      raise DataError(f"{where}: row {i} has label {str(label)!r}, not one of the {len(names)} classes "
                      f"{', '.join(names)}")
    indices[i] = index[str(label)]
  return SeriesSet(array, mask, indices, names)


def _check_rows(x: np.ndarray, mask: np.ndarray, where: str) -> None:
  bad = ~np.isfinite(x).all(axis=2) & mask
  if bad.any():
    row, step = np.argwhere(bad)[0]
    raise DataError(f"{where}: row {row} has a {_kind(x[row, step])} value at step {step}; fill or drop missing "
                    "values before training")
  # Left padding only: once a row's series starts, every later step is valid.
  late = mask[:, :-1] & ~mask[:, 1:]
  if late.any():
    row, step = np.argwhere(late)[0]
    raise DataError(f"{where}: row {row} has a masked step {step + 1} after a valid one; padding must precede the "
                    "series (left padding)")
  empty = np.flatnonzero(~mask.any(axis=1))
  if empty.size:
    raise DataError(f"{where}: row {empty[0]} has no valid step")


def _kind(values: np.ndarray) -> str:
  return "NaN" if np.isnan(values).any() else "infinite"


def normalize(data: SeriesSet) -> SeriesSet:
  """Each series z-normalised per feature over its valid steps (a constant series becomes zeros)."""
  count = data.mask.sum(axis=1)[:, None, None]
  valid = data.mask[..., None]
  mean = np.where(valid, data.x, 0).sum(axis=1, keepdims=True, dtype=np.float64) / count
  var = np.where(valid, (data.x - mean) ** 2, 0).sum(axis=1, keepdims=True) / count
  x = np.where(valid, (data.x - mean) / np.maximum(np.sqrt(var), 1e-8), 0).astype(np.float32)
  return dataclasses.replace(data, x=x)


def split(data: SeriesSet, fraction: float, seed: int) -> tuple[SeriesSet, SeriesSet | None]:
  """(train, validation): round(fraction * n_c) rows of every class c (of the whole set for regression) drawn for
  validation by a generator seeded with `seed`, so the split is a function of (data, fraction, seed); rows keep
  their order. fraction 0: (data, None)."""
  if fraction == 0:
    return data, None
  rng = np.random.default_rng([seed % 2**64, 0x5E1E5])
  groups = [np.arange(len(data))] if not data.classes else [np.flatnonzero(data.y == c)
                                                            for c in range(len(data.classes))]
  held = np.zeros(len(data), bool)
  for rows in groups:
    held[rng.permutation(rows)[:int(round(fraction * len(rows)))]] = True
  emptied = [data.classes[c] for c, rows in enumerate(groups) if data.classes and rows.size and held[rows].all()]
  if emptied:
    raise DataError(f"timeseries.val_fraction={fraction} holds out every training series of class "
                    f"{emptied[0]!r} ({int(np.sum(data.y == data.classes.index(emptied[0])))} series); choose a "
                    "smaller fraction or add series")
  if held.all() or not held.any():
    raise DataError(f"timeseries.val_fraction={fraction} leaves {int((~held).sum())} training and "
                    f"{int(held.sum())} validation series of {len(data)}; choose another fraction")
  return data.subset(np.flatnonzero(~held)), data.subset(np.flatnonzero(held))


# ------------------------------------------------------------------------------------------------------- sources


@dataclasses.dataclass(frozen=True)
class Splits:
  """train, validation (None without one) and test (None without one); all share train's classes and length."""
  train: SeriesSet
  val: SeriesSet | None
  test: SeriesSet | None


def load_splits(ts, seed: int) -> Splits:
  """The data of a TimeSeriesConfig `ts`: its source's training split (less the validation rows) and test split,
  checked row by row and normalised as configured. DataError on anything that cannot be used."""
  train_raw, test_raw = _read_source(ts.source, ts.test_source, ts.task)
  train = from_arrays(*train_raw, task=ts.task, where=_name(ts.source, "train"))
  test = None
  if test_raw is not None:
    test = from_arrays(*test_raw, task=ts.task, classes=train.classes or None,
                       where=_name(ts.test_source or ts.source, "test"))
    length = max(train.length, test.length)  # Padding is masked: both splits share one length.
    train, test = _to_length(train, length), _to_length(test, length)
    if test.features != train.features:
      raise DataError(f"the test series have {test.features} features, the training series {train.features}")
  if ts.normalize:
    train, test = normalize(train), None if test is None else normalize(test)
  train, val = split(train, ts.val_fraction, seed)
  return Splits(train, val, test)


def _name(source: str, part: str) -> str:
  return f"{source} ({part})" if source.startswith(AEON_PREFIX) else source


def _to_length(data: SeriesSet, length: int) -> SeriesSet:
  """`data` left-padded (masked) to `length` >= data.length steps."""
  pad = length - data.length
  return dataclasses.replace(data, x=np.pad(data.x, ((0, 0), (pad, 0), (0, 0))),
                             mask=np.pad(data.mask, ((0, 0), (pad, 0))))


def _read_source(source: str, test_source: str | None, task: str):
  """((x, y, mask), (x, y, mask) or None) of a source, unchecked."""
  if source.startswith(AEON_PREFIX):
    if test_source is not None:
      raise DataError(f"timeseries.test_source is for file sources; {source} has its own test split")
    name = source[len(AEON_PREFIX):]
    return _read_aeon(name, "train", task), _read_aeon(name, "test", task)
  return _read_file(source), None if test_source is None else _read_file(test_source)


def _read_aeon(name: str, part: str, task: str):
  """A dataset shipped inside the aeon package (never downloaded: names aeon does not ship are refused)."""
  try:
    from aeon import datasets
  except ImportError as error:  # aeon missing, or one of its own imports (its message says which).
    raise DataError(f"aeon: sources need the aeon package: pip install 'ltm-jax[timeseries]' ({error})") from None
  shipped = pathlib.Path(datasets.__file__).parent / "data"
  if not name or "/" in name or name in (".", "..") or not (shipped / name / f"{name}_TRAIN.ts").is_file():
    available = sorted(p.name for p in shipped.iterdir() if (p / f"{p.name}_TRAIN.ts").is_file())
    raise DataError(f"aeon does not ship a dataset called {name!r}; shipped: {', '.join(available)}")
  regression = "@targetlabel true" in (shipped / name / f"{name}_TRAIN.ts").read_text(errors="replace").lower()
  if regression != (task == "regression"):
    kind = "regression" if regression else "classification"
    raise DataError(f"aeon:{name} is a {kind} dataset; set timeseries.task={kind}")
  load = datasets.load_regression if regression else datasets.load_classification
  x, y = load(name, split=part, extract_path=str(shipped))
  # aeon gives [N, F, T] for equal lengths, a list of [F, T_i] otherwise: both become [T_i, F] rows.
  rows = [np.asarray(r, np.float32).T for r in x]
  if len({len(r) for r in rows}) > 1:  # The file records each series' length: padding and mask follow from it.
    x, mask = pad_left(rows)
    return x, y, mask
  return np.stack(rows), y, None


def _read_file(path_text: str):
  path = pathlib.Path(path_text)
  if not path.is_file():
    raise DataError(f"time-series file not found: {path}")
  if path.suffix == ".npz":
    try:
      with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # Not numpy's, damaged, cut short.
      raise DataError(f"{path} is not a readable .npz of numeric arrays: {e}") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
      raise DataError(f"{path} has no array {missing[0]!r} (expected x [N, T(, F)], y [N], optional mask [N, T])")
    return arrays["x"], arrays["y"], arrays.get("mask")
  if path.suffix in (".csv", ".tsv"):
    return _read_table(path, "\t" if path.suffix == ".tsv" else ",")
  raise DataError(f"{path}: time-series files are .npz, .csv or .tsv; for a dataset aeon ships use aeon:<name>")


def _read_table(path: pathlib.Path, sep: str):
  """UCR layout: one series per line, its label first, then its values."""
  labels, rows = [], []
  for number, line in enumerate(path.read_text().splitlines()):
    if not line.strip():
      continue
    fields = [f.strip() for f in line.split(sep)]
    try:
      values = [float(f) for f in fields[1:]]
    except ValueError as e:
      raise DataError(f"{path}: row {len(rows)} (line {number + 1}) has a value that is not a number: {e}") from None
    labels.append(fields[0])
    rows.append(values)
  if not rows:
    raise DataError(f"{path} holds no series")
  return rows, np.asarray(labels), None


# ------------------------------------------------------------------------------------------------------- batches


def _gather(data: SeriesSet, rows: np.ndarray) -> dict[str, np.ndarray]:
  rows = np.asarray(rows)
  return {"series": data.x[rows], "mask": data.mask[rows], "labels": data.y[rows]}


def fingerprint(data: SeriesSet) -> str:
  """A digest of the series, mask and labels: a resumed stream must read the same data. Steps that pad every row
  are left out, so the same series padded to a longer test split's length (`load_splits`) are the same data."""
  first = int(np.argmax(data.mask.any(axis=0)))
  digest = hashlib.sha256()
  for a in (data.x[:, first:], data.mask[:, first:], data.y):
    digest.update(np.ascontiguousarray(a).tobytes())
  return digest.hexdigest()[:16]


class SeriesLoader(ResumableLoader):
  """Endless shuffled training batches {"series" [B, T, F], "mask" [B, T], "labels" [B]}: every epoch visits each
  series once in an order drawn from (seed, epoch), batches running across epoch boundaries. The stream is a
  function of (data, batch_size, seed) and a batch counter, which is all `get_state` records (with a fingerprint of
  the data), so `set_state` resumes it exactly."""
  STATE_FORMAT = "ltm_jax.SeriesLoader/1"

  def __init__(self, data: SeriesSet, batch_size: int, seed: int, worker_threads: int = 2, prefetch: int = 4):
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    self.batch_size, self.seed = int(batch_size), int(seed)
    self._fingerprint = fingerprint(data)
    shuffle_seed = int(np.random.SeedSequence(self.seed % 2**64).generate_state(1)[0])
    batches = (grain.MapDataset.range(len(data)).shuffle(seed=shuffle_seed).repeat().batch(self.batch_size)
               .map(functools.partial(_gather, data)))
    super().__init__(batches, grain.ReadOptions(num_threads=worker_threads, prefetch_buffer_size=prefetch))

  def stream_keys(self) -> dict[str, Any]:
    return {"seed": self.seed, "batch_size": self.batch_size, "data": self._fingerprint}


def eval_batches(data: SeriesSet, batch_size: int) -> list[dict[str, np.ndarray]]:
  """Every series once, in order, in batches of `batch_size` (one compiled shape): the last batch is filled with
  repeats of its first row, and "count" [B] marks the rows that count (1) and the filler (0)."""
  batches = []
  for start in range(0, len(data), batch_size):
    rows = np.arange(start, min(start + batch_size, len(data)))
    count = np.zeros(batch_size, np.float32)
    count[:len(rows)] = 1
    batch = _gather(data, np.concatenate([rows, np.full(batch_size - len(rows), rows[0])]))
    batches.append({**batch, "count": count})
  return batches
