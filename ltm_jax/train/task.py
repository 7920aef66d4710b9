"""What the training loop trains: the decoder LM on token windows, or a time-series model on labelled series.

A `Task` gathers everything that depends on the kind of model and data (model, first train state, batch stream,
loss, evaluation, throughput units), so `ltm_jax.train.loop` is one loop for both: resume, checkpoints, metrics,
signals and divergence checks are shared."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax

from ltm_jax import data as data_lib
from ltm_jax import diagnostics
from ltm_jax import flops
from ltm_jax import model as model_lib
from ltm_jax import parallel
from ltm_jax.config import Config
from ltm_jax.errors import ConfigError
from ltm_jax.ops import fp8
from ltm_jax.timeseries import data as ts_data
from ltm_jax.timeseries import metrics as ts_metrics
from ltm_jax.timeseries import model as ts_model
from ltm_jax.train.evaluation import make_batch_metrics, validation_metrics
from ltm_jax.state import create_train_state, init_train_state


@dataclasses.dataclass
class Task:
  """model: what the train step differentiates; state: the first TrainState (placed in `sharded`'s shardings when
  that is not None); make_loader(): the resumable training batch stream (get_state/set_state/close); loss_fn:
  (params, micro-batch) -> (loss, metrics), or None for the decoder's token NLL (and latent inference);
  evaluate(params, final) -> the row of val_* (and on the final step test_*) metrics; unit / units_per_step: what
  throughput counts ("tokens" or "series"); put_batch: places a host batch for the step."""
  model: nn.Module
  state: Any
  make_loader: Callable[[], Any]
  loss_fn: Callable | None
  evaluate: Callable[[Any, bool], dict[str, Any]]
  flops_per_step: float
  unit: str
  units_per_step: int
  sharded: parallel.Layout | None = None
  put_batch: Callable[[dict], dict] = lambda batch: batch


def make_task(cfg: Config, optimizer: optax.GradientTransformation) -> Task:
  """The task of `cfg`; reads and checks the data first, so bad data is refused before anything is written."""
  if cfg.model.fp8 and (warning := fp8.gpu_flag_warning(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))):
    warnings.warn(warning, stacklevel=2)
  if cfg.timeseries.enabled:
    return timeseries_task(cfg, optimizer)
  return language_task(cfg, optimizer)


def language_task(cfg: Config, optimizer: optax.GradientTransformation) -> Task:
  """The decoder LM on token windows of the configured corpus, sharded by `cfg.mesh` over several devices."""
  m, t = cfg.model, cfg.train
  source = data_lib.open_source(cfg.data, m.vocab_size, t.seq_len)
  bytes_per_token = source.bytes_per_token
  model = model_lib.LM(m, cfg.latent)
  layout = parallel.make_layout(cfg, optimizer)  # ConfigError on a mesh that does not fit, before any compilation.
  sharded = parallel.sharded_if_multi_device(layout)
  if sharded is None:
    state = init_train_state(cfg, optimizer)
  else:
    state = parallel.init_state(cfg, optimizer, sharded)
  # This process loads only the rows of each batch its devices hold (all of them on one process).
  start_row, stop_row = parallel.process_rows(layout.batch, t.batch_size, t.seq_len)
  shard = (start_row // (stop_row - start_row), t.batch_size // (stop_row - start_row))
  eval_batches = source.validation_batches(t.batch_size, t.eval_batches)
  if sharded is not None:
    shards = parallel.batch_shards(layout.mesh, layout.rules)
    rows = [len(b["inputs"]) for b in eval_batches]
    # A validation split smaller than one batch makes one short batch, replicated where the batch axes cannot split
    # it; mesh.strict refuses the ops that then cannot split their rows: refused now, not after training steps.
    short = next((n for n in rows if n % shards), None)
    if sharded.strict and short is not None:
      fits = short // shards * shards  # The largest batch of its windows that the axes split.
      raise ConfigError(f"the validation split makes a batch of {short} rows, which the mesh's batch axes "
                        f"({shards} ways) do not divide, and mesh.strict refuses an op it cannot split: "
                        + (f"set train.batch_size={fits}, " if fits else "") +
                        "use a larger validation split, or set mesh.strict=false")
    eval_batches = [parallel.put_batch(b, parallel.batch_sharding(layout.mesh, layout.rules, n))
                    for b, n in zip(eval_batches, rows)]
  metrics_fn = make_batch_metrics(model, sharded)

  def evaluate(params, final: bool) -> dict[str, Any]:
    del final
    row = validation_metrics(model, params, eval_batches, seed=t.seed, bytes_per_token=bytes_per_token,
                             metrics_fn=metrics_fn)
    if t.memory_stats and eval_batches:
      row.update(diagnostics.memory_summary(m, cfg.latent, params, eval_batches[0]["inputs"]))
    return row

  def make_loader():
    return source.train_loader(t.batch_size, t.seed, worker_threads=cfg.data.worker_threads,
                               prefetch=cfg.data.prefetch, shard=shard)

  put = (lambda b: b) if sharded is None else (lambda b: parallel.put_batch(b, sharded.batch, t.batch_size))
  flops_per_step = flops.flops_per_token(m, cfg.latent, t.seq_len)[1] * (t.batch_size * t.seq_len)
  return Task(model, state, make_loader, None, evaluate, flops_per_step, "tokens", t.batch_size * t.seq_len, sharded,
              put)


def timeseries_task(cfg: Config, optimizer: optax.GradientTransformation) -> Task:
  """A TimeSeriesModel on the series of `cfg.timeseries.source`, on one device: val_* metrics on the held-out part
  of the training split at every evaluation, test_* on the test split at the last step only (so the reported test
  number is the one of the final model, never a best-of-many)."""
  ts, t = cfg.timeseries, cfg.train
  if jax.process_count() > 1:
    raise ConfigError("time-series training runs in a single process; start it without --num-processes")
  splits = ts_data.load_splits(ts, t.seed)
  classification = ts.task == "classification"
  n_outputs = len(splits.train.classes) if classification else 1
  if classification and n_outputs < 2:
    raise ConfigError(f"{ts.source} has a single class in its training split; a classifier needs two or more")
  model = ts_model.TimeSeriesModel(cfg.model, ts, n_outputs)
  params = ts_model.init_params(cfg.model, ts, n_outputs, splits.train.features, jax.random.key(t.seed))
  state = create_train_state(params, optimizer, t.seed)
  scale = None if classification else ts_metrics.TargetScale.of(splits.train.y)
  present = [s for s in (splits.train, splits.val, splits.test) if s is not None]
  padded = any(not s.mask.all() for s in present)  # Without padding the layers skip their masking work.

  def forward(params, series, mask):
    return model.apply({"params": params}, series, mask if padded else None)[0]

  def loss_fn(params, batch):
    return ts_metrics.loss(forward(params, batch["series"], batch["mask"]), batch["labels"], ts.task, scale)

  predict = jax.jit(forward)
  val = None if splits.val is None else ts_data.eval_batches(splits.val, t.batch_size)
  test = None if splits.test is None else ts_data.eval_batches(splits.test, t.batch_size)

  def evaluate(params, final: bool) -> dict[str, Any]:
    row = {} if val is None else ts_metrics.evaluate(predict, params, val, ts.task, scale, "val_")
    if final and test is not None:
      row.update(ts_metrics.evaluate(predict, params, test, ts.task, scale, "test_"))
    return row

  def make_loader():
    return ts_data.SeriesLoader(splits.train, t.batch_size, t.seed, worker_threads=cfg.data.worker_threads,
                                prefetch=cfg.data.prefetch)

  patches = -(-splits.train.length // ts.patch)
  # 2 FLOPs per multiply-add per patch, training = 3x forward; the heads and the spectrum (per series, not per
  # patch) are left out as negligible, as is attention's QK^T and AV.
  flops = 6 * ts_model.matmul_params(params) * patches * t.batch_size
  return Task(model, state, make_loader, loss_fn, evaluate, flops, "series", t.batch_size)
