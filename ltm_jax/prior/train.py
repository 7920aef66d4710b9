"""Training the latent prior (stage 2): a DiT fitted by denoising to the decoder's collected posteriors.

Every step draws a fresh z = mu + sigma * eps from each record's stored posterior (an exact sample of the aggregate
posterior, so the stored (mu, logvar) give new samples at every epoch), standardises it, and takes one AdamW step on
the epsilon-prediction loss (`diffusion.denoising_loss`); an EMA of the weights is what samples. Batches come from
grain over the ArrayRecord shards (a shuffled order per epoch, batch i a pure function of i), so a resumed run sees
exactly the batches the interrupted one would have. Checkpoints, metrics.jsonl and TensorBoard files go to
WORKDIR/prior; Ctrl-C / SIGTERM save a checkpoint and stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ltm_jax.config import Config, PriorConfig
from ltm_jax.errors import ConfigError, LtmError
from ltm_jax.prior import posteriors as posteriors_lib
from ltm_jax.prior.diffusion import denoising_loss, schedule_of
from ltm_jax.prior.model import (PriorState, abstract_state, decoder_latent_shape, denoiser, folder_of, init_params,
                                 prior_config)
from ltm_jax.prior.optimizer import make_optimizer
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train import workdir as workdir_lib
from ltm_jax.train.loop import StopFlag
from ltm_jax.train.metrics import MetricsWriter, read_metrics

STRUCTURAL_KEYS = ("width", "depth", "n_heads", "mlp_ratio")


@dataclasses.dataclass
class PriorTrainResult:
  step: int
  metrics: dict[str, Any]
  interrupted_by: int | None
  seconds: float


def _check_batch_size(posteriors: posteriors_lib.PosteriorSet, batch_size: int) -> None:
  if posteriors.num_train < batch_size:
    raise ConfigError(f"prior.batch_size={batch_size} exceeds the {posteriors.num_train} training posteriors; "
                      "lower it or collect more")


def _other_posteriors(folder: pathlib.Path, posteriors: posteriors_lib.PosteriorSet, logs: str) -> LtmError:
  return LtmError(f"the prior in {folder} was trained on other posteriors than {posteriors.folder} holds now "
                  f"(collected again?); to train a new prior on these, delete {folder / 'checkpoints'}, {logs}")


def _check_same_posteriors(data_state: dict, posteriors: posteriors_lib.PosteriorSet, folder: pathlib.Path,
                           logs: str) -> None:
  """LtmError when a prior checkpoint's data record names another decoder step or record count than the posteriors
  it would resume on."""
  if (data_state.get("decoder_step"), data_state.get("posteriors")) != (posteriors.manifest["decoder_step"],
                                                                        posteriors.num_records):
    raise _other_posteriors(folder, posteriors, logs)


def batches(posteriors: posteriors_lib.PosteriorSet, batch_size: int, seed: int) -> grain.MapDataset:
  """Batch i: float32 [batch_size, 2, *latent_shape] (mu, logvar) of training records, reshuffled every epoch."""
  _check_batch_size(posteriors, batch_size)
  return (grain.MapDataset.source(posteriors.source)[:posteriors.num_train].shuffle(seed=seed).repeat()
          .map(lambda record: posteriors_lib.decode_record(record)[1:]).batch(batch_size, drop_remainder=True))


def make_train_step(cfg: PriorConfig, optimizer):
  schedule = schedule_of(cfg)

  def loss_fn(params, x0, key):
    return denoising_loss(denoiser(cfg, params), x0, key, schedule).mean()

  @jax.jit
  def step(state: PriorState, mu_logvar: jax.Array, key: jax.Array):
    sample_key, loss_key = jax.random.split(key)
    mu, logvar = mu_logvar[:, 0], mu_logvar[:, 1]
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(sample_key, mu.shape, mu.dtype)
    loss, grads = jax.value_and_grad(loss_fn)(state.params, (z - state.mean) / state.std, loss_key)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # The usual EMA warm-up: early weights are forgotten quickly, whatever ema_decay is.
    decay = jnp.minimum(cfg.ema_decay, (1.0 + state.step) / (10.0 + state.step))
    ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state.ema, params)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return state._replace(params=params, ema=ema, opt_state=opt_state, step=state.step + 1), metrics

  @jax.jit
  def heldout_loss(params, state: PriorState, z: jax.Array, key: jax.Array):
    return loss_fn(params, (z - state.mean) / state.std, key)

  return step, heldout_loss


def train_prior(workdir: str | pathlib.Path, overrides=(), *, log=None) -> PriorTrainResult:
  """Trains (or resumes) the prior of the latent decoder in `workdir` on WORKDIR/prior/posteriors; `overrides` may
  set prior.* keys. Structural keys (width, depth, n_heads, mlp_ratio) cannot change on resume."""
  started = time.time()
  workdir, folder = pathlib.Path(workdir), folder_of(workdir)
  say = log or (lambda text: print(text, file=sys.stderr))
  decoder = ckpt_lib.read_config_json(workdir)
  if not decoder.latent.enabled:
    raise LtmError(f"{workdir} holds a decoder without latent thoughts (latent.enabled=false): there is no prior "
                   "to train")
  posteriors = posteriors_lib.PosteriorSet(posteriors_lib.folder_of(workdir))
  shape = decoder_latent_shape(decoder)
  if posteriors.latent_shape != shape:
    raise LtmError(f"{posteriors.folder} holds latents of shape {list(posteriors.latent_shape)}, but the decoder in "
                   f"{workdir} has {list(shape)}; collect them again with `ltm fit-prior`")

  cfg = prior_config(decoder, overrides)  # Bad keys are refused before the workdir is touched.
  if not (folder / "checkpoints").is_dir():  # A new prior: its batch size is refused before anything is written.
    _check_batch_size(posteriors, cfg.prior.batch_size)
  logs = f"{folder / 'metrics.jsonl'} and {folder / 'tensorboard'} (the posteriors in {posteriors.folder} stay)"
  start_over = f"delete {logs}"
  with contextlib.ExitStack() as cleanup:
    cleanup.enter_context(workdir_lib.exclusive(folder))
    workdir_lib.check_writable(folder / "checkpoints")
    workdir_lib.check_checkpoints_kept(folder, read_metrics(folder), start_over)
    checkpointer = ckpt_lib.Checkpointer(folder, keep=2)
    cleanup.callback(checkpointer.close)
    start, state = 0, None
    if checkpointer.all_steps():

      def read(at: int) -> tuple[Config, PriorState]:
        saved = checkpointer.saved_config(at)
        resumed = prior_config(saved, overrides)
        changed = [k for k in STRUCTURAL_KEYS if getattr(saved.prior, k) != getattr(resumed.prior, k)]
        if changed:
          raise ConfigError(f"{folder} holds a prior with other {', '.join('prior.' + k for k in changed)}; use the "
                            "saved values or remove its checkpoints")
        target = ckpt_lib.abstract(abstract_state(resumed.prior, shape, make_optimizer(resumed.prior)))
        state, data = checkpointer.restore(at, target)  # Checked against its checksums first.
        _check_same_posteriors(data, posteriors, folder, logs)
        if not (np.array_equal(state.mean, posteriors.mean) and np.array_equal(state.std, posteriors.std)):
          raise _other_posteriors(folder, posteriors, logs)
        return resumed, state

      start, (cfg, state), damaged = checkpointer.newest_readable(read)
      if start > cfg.prior.steps:
        raise ConfigError(f"prior.steps={cfg.prior.steps} is below the prior checkpoint resumed from (step {start})")
      _check_batch_size(posteriors, cfg.prior.batch_size)
      aside = checkpointer.set_aside(damaged)  # Only once nothing refuses the run.
      if aside is not None:
        say(f"warning: moved unreadable checkpoint(s) {damaged} to {aside}")
      say(f"resuming the prior from step {start}")
    p = cfg.prior
    optimizer = make_optimizer(p)
    if state is None:
      params = init_params(p, shape, jax.random.key(p.seed))
      state = PriorState(params, params, optimizer.init(params), jnp.zeros((), jnp.int32),
                         jnp.asarray(posteriors.mean), jnp.asarray(posteriors.std))

    data = batches(posteriors, p.batch_size, p.seed)
    heldout_z = jnp.asarray(posteriors.heldout()[:, 0])
    train_step, heldout_loss = make_train_step(p, optimizer)
    writer = MetricsWriter(folder, start)
    cleanup.callback(writer.close)
    if writer.dropped:
      say(f"dropped {len(writer.dropped)} metrics.jsonl row(s) (steps {writer.dropped[0]}-{writer.dropped[-1]}) "
          f"logged after prior step {start}, the checkpoint resumed from; this run logs those steps again")
    data_state = lambda at: {"step": at, "latent_shape": list(shape), "decoder_step": posteriors.manifest[
        "decoder_step"], "posteriors": posteriors.num_records}
    step, last, interval = start, {}, time.time()
    with StopFlag().installed() as stop:
      while step < p.steps and stop.signum is None:
        key = jax.random.fold_in(jax.random.key(p.seed), step)
        state, metrics = train_step(state, jnp.asarray(data[step]), key)
        step += 1
        checkpointer.check_for_errors()
        if step % p.log_every == 0 or step == p.steps:
          row = {k: float(v) for k, v in jax.device_get(metrics).items()}
          if not np.isfinite(row["loss"]):
            raise LtmError(f"the prior's loss is not finite at step {step}; lower prior.lr")
          eval_key = jax.random.key(p.seed + 1)  # The same t and noise at every evaluation: comparable numbers.
          row["heldout_loss"] = float(heldout_loss(state.ema, state, heldout_z, eval_key))
          row["steps_per_sec"] = p.log_every / (time.time() - interval)
          interval = time.time()
          writer.write(step, row)
          last = row
          say(f"prior step {step}/{p.steps} loss {row['loss']:.4f} heldout_loss (ema) {row['heldout_loss']:.4f}")
        if step % p.checkpoint_every == 0 or step == p.steps:
          checkpointer.save(step, state, data_state(step), cfg)
      if step % p.checkpoint_every and step != p.steps:  # Stopped by a signal between checkpoints.
        checkpointer.save(step, state, data_state(step), cfg)
      checkpointer.wait()
      if stop.signum is not None:
        say(f"stopped by signal {stop.signum} at prior step {step}; checkpoint saved, run again to resume")
  return PriorTrainResult(step, last, stop.signum, time.time() - started)
