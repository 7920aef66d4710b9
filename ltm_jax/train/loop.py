"""The training loop: resume, step, log, evaluate, checkpoint; Ctrl-C / SIGTERM save a checkpoint and stop cleanly."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import tqdm

from ltm_jax import model as model_lib
from ltm_jax import parallel
from ltm_jax import quantize as quantize_lib
from ltm_jax.config import Config
from ltm_jax.errors import CheckpointError, ConfigError, ShapeMismatchError, TrainingError
from ltm_jax.layers import pipeline
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train import divergence
from ltm_jax.train import task as task_lib
from ltm_jax.train import workdir as workdir_lib
from ltm_jax.train.metrics import MetricsWriter, read_metrics, throughput
from ltm_jax.train.optimizer import learning_rate, make_optimizer
from ltm_jax.train.step import make_train_step


@dataclasses.dataclass
class TrainResult:
  step: int
  metrics: dict[str, Any]  # The last logged train metrics merged with the last evaluation.
  interrupted_by: int | None  # The signal number that stopped the run early, if any.
  seconds: float


class StopFlag:
  """Turns the first SIGINT/SIGTERM into a request to stop after the current step; a second one kills as usual."""

  def __init__(self):
    self.signum: int | None = None

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield self  # Signal handlers can only be set from the main thread; elsewhere the caller controls stopping.
      return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
      del frame
      self.signum = signum
      for s, h in previous.items():
        signal.signal(s, h)

    for s in previous:
      signal.signal(s, handler)
    try:
      yield self
    finally:
      for s, h in previous.items():
        signal.signal(s, h)


def _qat_view(cfg: Config, params):
  """The parameters' quantisation-aware view for train.qat (None without QAT), checked against every weight here, so
  a group size that does not divide a fan-in is refused before the workdir is touched."""
  t = cfg.train
  if t.qat == "none":
    return None
  axes = model_lib.param_axes(cfg.model, cfg.latent)
  view = lambda p: quantize_lib.fake_quantize_params(p, axes, t.qat, t.qat_group)
  try:
    jax.eval_shape(view, params)
  except ValueError as e:
    raise ConfigError(f"train.qat={t.qat} with train.qat_group={t.qat_group}: {e}") from None
  return view


def train(cfg: Config, workdir: str | pathlib.Path, *, progress: bool | None = None,
          stop_at: int | None = None, from_step: int | None = None) -> TrainResult:
  """Trains `cfg` in `workdir`, resuming from its latest checkpoint. `progress=None` shows a bar only on a terminal.
  `stop_at` ends this call after that step (evaluating and saving a checkpoint there), with the learning-rate
  schedule still that of train.steps: a long run trained in pieces equals the run trained at once.
  `from_step` resumes from that kept checkpoint instead of the latest (the recovery from a divergence whose newest
  checkpoints hold finite but diverged parameters) and deletes the checkpoints and metrics rows after it once every
  check has passed; a step that is not kept is refused in one line naming the kept ones.
  What is trained (the decoder LM on tokens, or with timeseries.enabled a time-series model on labelled series)
  comes from `ltm_jax.train.task`; everything else here is shared.

  Everything that can refuse the run (bad data, a mesh that does not fit the devices or the model, another run
  holding the workdir's lock, a checkpoints folder that cannot be written, a checkpoint of another model, train.steps
  below the checkpoint resumed from, a `from_step` that is not kept, a data-iterator state that does not fit, an
  unreadable metrics.jsonl, a metrics.jsonl that logs training in a workdir without checkpoints) is checked before
  anything in the workdir is written: a refused run leaves every file and folder of the workdir as it was (the lock
  is a flock on the directory itself, which writes nothing). A checkpoint that cannot be read is named on stderr and
  moved to WORKDIR/damaged-checkpoints/; the run resumes from the newest one that can. metrics.jsonl rows logged
  after the step resumed from are dropped, and that is said. No checkpoint is saved whose parameters or optimizer
  state are not finite.

  Over several devices the run is sharded by `cfg.mesh` (ltm_jax.parallel); over several processes (after
  `parallel.initialize`) each loads its rows of every batch, and only process 0 writes metrics and config.json
  (orbax coordinates the checkpoint writes of all processes).
  """
  started = time.time()
  workdir = pathlib.Path(workdir)
  t = cfg.train
  optimizer = make_optimizer(t)
  task = task_lib.make_task(cfg, optimizer)  # Reads and checks the data: refusals come before any write.
  state, sharded = task.state, task.sharded
  params_view = _qat_view(cfg, state.params)
  main = parallel.is_main_process()

  if from_step is not None and not (workdir / "checkpoints").is_dir():  # Refused before the workdir is made.
    raise CheckpointError(f"cannot resume from step {from_step}: {workdir} has no checkpoints")
  with contextlib.ExitStack() as cleanup:
    if main:
      cleanup.enter_context(workdir_lib.exclusive(workdir))
      workdir_lib.check_writable(workdir / "checkpoints")
      workdir_lib.check_checkpoints_kept(workdir, read_metrics(workdir))  # Refuses a metrics.jsonl it cannot extend.
    checkpointer = ckpt_lib.Checkpointer(workdir, t.keep_checkpoints, t.async_checkpoint, keep_every=t.keep_every)
    cleanup.callback(checkpointer.close)
    loader = task.make_loader()
    cleanup.callback(loader.close)
    start, saved_step, damaged = 0, None, []
    kept = checkpointer.all_steps()
    if from_step is not None and from_step not in kept:
      raise CheckpointError(f"cannot resume from step {from_step}: {workdir} " +
                            (f"keeps checkpoints at steps {_listed(kept)} only" if kept else "has no checkpoints"))
    if kept:
      target = ckpt_lib.abstract(state, None if sharded is None else sharded.state)

      def read(step):
        ckpt_lib.check_compatible(checkpointer.saved_config(step), cfg, str(workdir))
        try:
          return checkpointer.restore(step, target)
        except ShapeMismatchError as e:  # Sizes no config key names: a time-series model's come from its data.
          data = (f"; {cfg.timeseries.source} has other classes or features than the data it was trained on"
                  if cfg.timeseries.enabled else "")
          raise ShapeMismatchError(f"{workdir}: {e}{data}; use another workdir") from None

      start, (state, data_state), damaged = checkpointer.newest_readable(
          read, None if from_step is None else [from_step])
      if start > t.steps:
        which = "latest checkpoint" if from_step is None else "checkpoint resumed from"
        raise ConfigError(f"train.steps={t.steps} is below the {which} in {workdir} (step {start}); "
                          "set train.steps >= that step or use another workdir")
      if data_state.get("format") is not None:  # Saved parameters (save_params) record no data position.
        loader.set_state(data_state)
      saved_step = start
    dropped = checkpointer.drop_after(from_step) if from_step is not None else []
    if main:
      aside = checkpointer.set_aside(damaged)
      if aside is not None:
        print(f"warning: moved unreadable checkpoint(s) {damaged} to {aside}", file=sys.stderr)
      ckpt_lib.write_config_json(workdir, cfg)
    train_step = make_train_step(task.model, optimizer, learning_rate(t), t.grad_accum, sharded,
                                 loss_fn=task.loss_fn, params_view=params_view)
    evaluated = jax.jit(params_view) if params_view is not None else (lambda params: params)

    writer = MetricsWriter(workdir, start) if main else None
    if writer is not None:
      cleanup.callback(writer.close)
    show_bar = (sys.stderr.isatty() if progress is None else progress) and main
    bar = tqdm.tqdm(total=t.steps, initial=start, disable=not show_bar, dynamic_ncols=True, unit="step")
    cleanup.callback(bar.close)
    say = bar.write if show_bar else print if main else lambda *_: None
    devices, device_kind = jax.device_count(), jax.devices()[0].device_kind
    stages = 1 if sharded is None else sharded.mesh.shape.get(pipeline.AXIS, 1)
    bubble = pipeline.bubble_fraction(stages, cfg.model.pipeline_micro_batches if stages > 1 else 1)
    if dropped:
      say(f"deleted the checkpoints after step {start} (steps {_listed(dropped)}) and their metrics rows")
    elif writer is not None and writer.dropped:
      say(f"dropped {len(writer.dropped)} metrics.jsonl row(s) (steps {writer.dropped[0]}-{writer.dropped[-1]}) "
          f"logged after step {start}, the checkpoint resumed from; this run logs those steps again")
    if start:
      say(f"resuming from step {start} in {workdir}")
    last: dict[str, Any] = {}
    step, unit = start, task.unit
    guard = divergence.Guard(t)
    interval_start, interval_steps = time.time(), 0
    last_step = t.steps if stop_at is None else min(t.steps, stop_at)
    kept_now = lambda: _kept_steps(checkpointer)
    with StopFlag().installed() as stop:
      while step < last_step and stop.signum is None:
        batch = task.put_batch(next(loader))
        state, metrics = train_step(state, batch)
        guard.update(metrics["loss"], metrics["grad_norm"], state.step)
        step, interval_steps = step + 1, interval_steps + 1
        checkpointer.check_for_errors()  # A failed background save stops the run at the next step.
        log_now, save_now = step % t.log_every == 0 or step == t.steps, step % t.checkpoint_every == 0
        row: dict[str, Any] = {}
        if log_now or save_now:
          metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
          guard.check(step, metrics["loss"], kept_now)
        if log_now:
          elapsed = time.time() - interval_start
          row.update(metrics, step_seconds=elapsed / interval_steps,
                     **{f"{unit}_per_sec": interval_steps * task.units_per_step / elapsed,
                        unit: step * task.units_per_step},
                     **throughput(task.flops_per_step, interval_steps, elapsed, devices, device_kind, bubble))
          bar.set_postfix(loss=f"{row['loss']:.3f}", per_s=f"{row[f'{unit}_per_sec']:.0f}")
          if not show_bar:
            extra = "".join(f" {k} {row[k]:.4f}" for k in ("kl", "accuracy", "mse") if k in row)
            say(f"step {step}/{t.steps} loss {row['loss']:.4f}{extra} lr {row['lr']:.2e} "
                f"grad_norm {row['grad_norm']:.3f} {unit}/s {row[f'{unit}_per_sec']:.0f}")
        if step % t.eval_every == 0 or step == last_step:
          evaluation = task.evaluate(evaluated(state.params), step == t.steps)  # Empty without validation data.
          row.update(evaluation, **{unit: step * task.units_per_step})
          if evaluation:
            say(f"step {step}: " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in evaluation.items()
                                            if k not in ("val_tokens", "val_series", "test_series")))
        if row:
          if writer is not None:
            writer.write(step, row)
          last.update(row)
          interval_start, interval_steps = time.time(), 0
        if save_now or step == last_step:
          _save(checkpointer, step, state, loader.get_state(), cfg, guard)
          saved_step = step
        bar.update(1)
      if step != (saved_step or 0):  # Stopped by a signal between checkpoints.
        guard.check(step, float(metrics["loss"]), kept_now)
        _save(checkpointer, step, state, loader.get_state(), cfg, guard)
      checkpointer.wait()  # A failed last save is an error, not a silent loss.
      if stop.signum is not None:
        say(f"stopped by signal {stop.signum} at step {step}; checkpoint saved, run again to resume")
  return TrainResult(step, last, stop.signum, time.time() - started)


@jax.jit
def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _listed(steps: list[int]) -> str:
  return ", ".join(str(s) for s in steps)


def _kept_steps(checkpointer: ckpt_lib.Checkpointer) -> list[int]:
  """The checkpoints kept once the save in flight (if any) has ended and train.keep_checkpoints has pruned."""
  with contextlib.suppress(CheckpointError):  # A failed last save is simply not among them.
    checkpointer.wait()
  return checkpointer.all_steps()


def _save(checkpointer: ckpt_lib.Checkpointer, step: int, state, data_state, cfg: Config,
          guard: divergence.Guard) -> None:
  """Saves unless the parameters or optimizer state hold a NaN or infinity (one device reduction)."""
  if not bool(_all_finite((state.params, state.opt_state))):
    raise TrainingError(f"parameters or optimizer state are not finite at step {step}; "
                        f"{divergence.recovery(_kept_steps(checkpointer), guard.rise())}")
  checkpointer.save(step, state, data_state, cfg)
