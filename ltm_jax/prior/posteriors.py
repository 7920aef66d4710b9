"""Stage-2 data of the latent prior: the frozen decoder's posteriors q(z|x) over its training windows, on disk.

`collect` runs the inner loop (latent.inner_steps, as in training) over training windows taken in an order drawn from
`seed`, and writes WORKDIR/prior/posteriors/shard-NNNNN.array_record: one record per window, the .npy bytes of a
float32 [3, latent layers, n_per_layer, d_model] array stacking a posterior sample z = mu + sigma * eps, mu and logvar.
ArrayRecord (the format grain reads with random access) because the set is read shuffled by the prior's training
loader and may outgrow memory; a shard is written under a temporary name and renamed, then listed in manifest.json,
so an interrupted run resumes at the first unlisted shard and, every shard being a pure function of (decoder, its
latent and data settings, seed, shard index), produces the same files as an uninterrupted one.

The last `heldout` windows of the order are kept out of the prior's training (its evaluation set). When every shard
is written, standardization.npz holds the aggregate posterior's per-coordinate mean and standard deviation over the
training records: mean = E[mu], var = Var[mu] + E[exp(logvar)] (the moments of z ~ q(z|x) with x drawn from them).
"""

from __future__ import annotations

import dataclasses
import io
import json
import numbers
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import config as config_lib
from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax.errors import LtmError
from ltm_jax.train import workdir as workdir_lib

FORMAT = "ltm_jax.posteriors/1"
MANIFEST = "manifest.json"
STANDARDIZATION = "standardization.npz"


def folder_of(workdir: str | pathlib.Path) -> pathlib.Path:
  return pathlib.Path(workdir) / "prior" / "posteriors"


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the records are a function of: a folder collected under other settings is refused, not extended."""
  decoder_step: int
  latent_shape: tuple[int, int, int]
  seq_len: int
  latent: dict  # The decoder's latent.* keys (the inner loop that fits each posterior), overrides included.
  data: dict  # Its data.* keys that choose the tokens (not the loader's threads and prefetch).
  sequences: int
  heldout: int
  batch_size: int
  shard_size: int
  seed: int


def encode_record(z: np.ndarray, mu: np.ndarray, logvar: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  np.save(buffer, np.stack([z, mu, logvar]).astype(np.float32), allow_pickle=False)
  return buffer.getvalue()


def decode_record(record: bytes) -> np.ndarray:
  """float32 [3, latent layers, n_per_layer, d_model]: z, mu, logvar."""
  return np.load(io.BytesIO(record), allow_pickle=False)


def _read_manifest(folder: pathlib.Path) -> dict | None:
  path = folder / MANIFEST
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise LtmError(f"{path} is not readable JSON ({e}); remove {folder} to collect again") from e


def _write_manifest(folder: pathlib.Path, manifest: dict) -> None:
  tmp = folder / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps(manifest, indent=1) + "\n")
  os.replace(tmp, folder / MANIFEST)


def collect(lm, workdir: str | pathlib.Path, *, sequences: int | None = None, heldout_fraction: float = 0.2,
            batch_size: int = 32, shard_size: int = 256, seed: int = 0,
            on_shard: Callable[[int, int], None] | None = None) -> pathlib.Path:
  """Writes (or finishes writing) the posteriors of `lm` (a latent `LanguageModel` loaded from `workdir`) over
  `sequences` training windows (default: all); returns the folder. `on_shard(done, total)` runs after each shard."""
  if not lm.has_latents:
    raise LtmError(f"{workdir} holds a decoder without latent thoughts (latent.enabled=false): there is no posterior "
                   "to fit a prior to")
  if not 0 < heldout_fraction < 1:
    raise LtmError(f"the held-out fraction must be in (0, 1), got {heldout_fraction}")
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
    raise LtmError(f"the seed must be an integer in [0, 2**32), got {seed!r}")
  if batch_size < 1 or shard_size < 1 or shard_size % batch_size:
    raise LtmError(f"the shard size ({shard_size}) must be a positive multiple of the batch size ({batch_size})")
  cfg = lm.config
  seq_len = cfg.train.seq_len
  splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, seq_len)
  available = (len(splits.train) - 1) // seq_len
  sequences = available if sequences is None else sequences
  if not 2 <= sequences <= available:
    raise LtmError(f"--sequences must be in [2, {available}] (the training split's windows of {seq_len} tokens), "
                   f"got {sequences}")
  heldout = min(max(1, round(heldout_fraction * sequences)), sequences - 1)
  data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in ("worker_threads", "prefetch")}
  settings = Settings(lm.trained_steps, tuple(lm.latent_shape(1)[1:]), seq_len, dataclasses.asdict(cfg.latent), data,
                      sequences, heldout, batch_size, shard_size, seed)
  folder = folder_of(workdir)
  with workdir_lib.exclusive(folder.parent):  # One writer; refused before anything is written.
    return _collect(lm, splits.train, folder, settings, on_shard)


def _collect(lm, tokens: np.ndarray, folder: pathlib.Path, settings: Settings, on_shard) -> pathlib.Path:
  seq_len, sequences, seed = settings.seq_len, settings.sequences, settings.seed
  batch_size, shard_size = settings.batch_size, settings.shard_size
  available = (len(tokens) - 1) // seq_len
  folder.mkdir(parents=True, exist_ok=True)
  manifest = _read_manifest(folder)
  expected = {"format": FORMAT}
  for k, v in dataclasses.asdict(settings).items():  # latent and data as latent.KEY, data.KEY: a refusal names each.
    expected.update({f"{k}.{key}": value for key, value in v.items()} if isinstance(v, dict) else
                    {k: list(v) if isinstance(v, tuple) else v})
  if manifest is not None and "inner_steps" in manifest:  # Recorded the inner loop's step count alone.
    raise LtmError(f"{folder} was collected by an earlier ltm_jax that did not record the decoder's latent.* and "
                   "data.* settings; remove it to collect again")
  # A key added to LatentConfig or DataConfig after a folder was collected held its default then.
  defaults = {f"{part}.{key}": value for part, config in (("latent", config_lib.LatentConfig()),
                                                          ("data", config_lib.DataConfig()))
              for key, value in dataclasses.asdict(config).items()}
  saved = lambda k: manifest.get(k, defaults.get(k))
  if manifest is None:
    manifest = {**expected, "shards": [], "complete": False}
  elif {k: saved(k) for k in expected} != expected:
    differ = ", ".join(f"{k} {saved(k)!r} (now {v!r})" for k, v in expected.items() if saved(k) != v)
    raise LtmError(f"{folder} holds posteriors collected with other settings: {differ}; remove it or collect with "
                   "the same settings")
  windows = np.random.default_rng(seed).permutation(available)[:sequences]
  n_shards = -(-sequences // shard_size)
  fit = _fit_function(lm.model)
  from array_record.python.array_record_module import ArrayRecordWriter
  for shard in range(len(manifest["shards"]), n_shards):
    rows = windows[shard * shard_size:(shard + 1) * shard_size]
    records = []
    for first in range(0, len(rows), batch_size):
      starts = rows[first:first + batch_size] * seq_len
      batch = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], np.int32)
      padded = np.concatenate([batch, np.repeat(batch[-1:], batch_size - len(batch), axis=0)])
      key = jax.random.fold_in(jax.random.key(seed), shard * shard_size + first)
      z, mu, logvar = (np.asarray(a)[:len(batch)] for a in fit(lm.params, jnp.asarray(padded), key))
      records += [encode_record(z[i], mu[i], logvar[i]) for i in range(len(batch))]
    name = f"shard-{shard:05d}.array_record"
    tmp = folder / (name + ".tmp")
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    for record in records:
      writer.write(record)
    writer.close()
    os.replace(tmp, folder / name)
    manifest["shards"].append({"file": name, "records": len(records)})
    _write_manifest(folder, manifest)
    if on_shard is not None:
      on_shard(shard + 1, n_shards)
  if not manifest["complete"]:
    mean, std = _aggregate_moments(PosteriorSet(folder, require_complete=False))
    np.savez(folder / STANDARDIZATION, mean=mean, std=std)
    manifest["complete"] = True
    _write_manifest(folder, manifest)
  return folder


def _fit_function(model):
  @jax.jit
  def fit(params, windows, key):
    fit_key, sample_key = jax.random.split(key)
    result, _ = latent_lib.infer(model, params, windows[:, :-1], windows[:, 1:], fit_key)
    q = result.posterior
    return q.sample(jax.random.normal(sample_key, q.mu.shape, q.mu.dtype)), q.mu, q.logvar
  return fit


def _aggregate_moments(posteriors: PosteriorSet) -> tuple[np.ndarray, np.ndarray]:
  """Per-coordinate mean and standard deviation (float32) of z ~ q(z|x) over the training records, in float64."""
  total = total_sq = total_var = 0.0
  n = 0
  for start in range(0, posteriors.num_train, 1024):
    records = posteriors.read(range(start, min(start + 1024, posteriors.num_train))).astype(np.float64)
    mu, logvar = records[:, 1], records[:, 2]
    total = total + mu.sum(0)
    total_sq = total_sq + np.square(mu).sum(0)
    total_var = total_var + np.exp(logvar).sum(0)
    n += len(records)
  mean = total / n
  var = np.maximum(total_sq / n - np.square(mean), 0.0) + total_var / n
  return mean.astype(np.float32), np.sqrt(var).astype(np.float32)


class PosteriorSet:
  """A collected folder: records 0..num_train-1 train the prior, the rest are held out."""

  def __init__(self, folder: str | pathlib.Path, *, require_complete: bool = True):
    self.folder = pathlib.Path(folder)
    manifest = _read_manifest(self.folder)
    if manifest is None or manifest.get("format") != FORMAT:
      raise LtmError(f"{self.folder} holds no collected posteriors; run `ltm fit-prior` first")
    if require_complete and not manifest["complete"]:
      raise LtmError(f"{self.folder} is incomplete ({len(manifest['shards'])} shards written); run `ltm fit-prior` "
                     "again to finish it")
    self.manifest = manifest
    self.latent_shape = tuple(manifest["latent_shape"])
    self.num_records = sum(s["records"] for s in manifest["shards"])
    self.num_train = manifest["sequences"] - manifest["heldout"]
    import grain
    self.source = grain.sources.ArrayRecordDataSource([str(self.folder / s["file"]) for s in manifest["shards"]])
    if manifest["complete"]:
      moments = np.load(self.folder / STANDARDIZATION)
      self.mean, self.std = moments["mean"], moments["std"]

  def read(self, indices) -> np.ndarray:
    """float32 [N, 3, latent layers, n_per_layer, d_model] (z, mu, logvar) of the records at `indices`."""
    return np.stack([decode_record(r) for r in self.source.__getitems__(list(indices))])

  def heldout(self) -> np.ndarray:
    return self.read(range(self.num_train, self.num_records))
