"""The divergence guard: the first non-finite step, the loss-spike stop, and the checkpoint the error sends a user
back to."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax.config import TrainConfig, apply_overrides, validate
from ltm_jax.errors import ConfigError, TrainingError
from ltm_jax.train import train
from ltm_jax.train.divergence import Guard, recovery


def _run(losses, norms=None, **train_keys) -> Guard:
  """A guard fed `losses` (and gradient norms, default 1) as steps 1, 2, ..."""
  guard = Guard(TrainConfig(**train_keys))
  for step, (loss, norm) in enumerate(zip(losses, norms or [1.0] * len(losses)), 1):
    guard.update(jnp.float32(loss), jnp.float32(norm), jnp.int32(step))
  return guard


def test_the_first_nonfinite_steps_and_the_rise_are_tracked_on_device():
  guard = _run([5.6, 5.0, 4.0, 30.0, np.inf, np.nan, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, np.nan, np.nan])
  assert guard.rise() == 4  # 30 > max(2 x 4.x, 4.x + 1): the rise began there and never ended.
  with pytest.raises(TrainingError, match=r"^loss became non-finite at step 5; grad_norm became non-finite at step 6; "
                                          r"the newest checkpoint saved before the loss began to rise at step 4 is "
                                          r"step 2; resume from it with a lower train.lr or a train.grad_clip: ltm "
                                          r"train --from-step 2 \.\.\. \(deletes the checkpoints after it\)$"):
    guard.check(7, 1.0, lambda: [1, 2, 3])  # Checkpoint 3 gave step 4's loss: already risen.


def test_the_advice_says_plainly_when_no_checkpoint_is_healthy():
  assert recovery([3, 4], 4) == ("every kept checkpoint (steps 3, 4) was saved after the loss began to rise at step "
                                 "4, so none is healthy; start again in a new workdir with a lower train.lr or a "
                                 "train.grad_clip")
  assert recovery([], 2) == "no checkpoint was saved; start again in a new workdir with a lower train.lr or a " \
                            "train.grad_clip"
  assert recovery([2, 4], None).startswith("the newest checkpoint is step 4; resume from it")


def test_a_spike_stops_the_run_after_spike_steps_high_steps_only():
  healthy = [5.0, 4.0, 3.0, 2.5, 2.2, 2.0]
  high = [9.0, 9.5, 9.0]  # Above max(2 x best, best + 1) of the moving average (~2.9 at its lowest).
  _run(healthy + high, spike_steps=4).check(9, 9.0, lambda: [3])  # 3 high steps: not yet.
  with pytest.raises(TrainingError, match=r"^loss spike: 9\.5 at step 10, above [\d.]+ for the 4 steps since step 7 "
                                          r"\(train.spike_steps=4; .*; the newest checkpoint saved before the loss "
                                          r"began to rise at step 7 is step 3; "):
    _run(healthy + high + [9.5], spike_steps=4).check(10, 9.5, lambda: [3, 6, 9])
  _run(healthy + high + [2.1, 9.0], spike_steps=4).check(11, 9.0, lambda: [3])  # A step back down ends the run.
  _run(healthy + high * 5, spike_steps=0).check(21, 9.0, lambda: [3])  # 0: never.


def test_noisy_healthy_curves_never_trip_the_default_guard():
  """An LM's loss falling from 5.6 to 1.2 and a classifier's falling to 0.01, each step's loss off by up to 40% of
  the curve (far noisier than a batch of the shipped configs), and an early bump while the learning rate warms up."""
  rng = np.random.default_rng(0)
  steps = np.arange(1, 3001)
  lm = 1.2 + 4.4 * np.exp(-steps / 300) + 0.8 * np.exp(-((steps - 60) / 20) ** 2)
  classifier = 0.01 + 0.7 * np.exp(-steps / 100)
  for curve in (lm, classifier):
    noisy = curve * (1 + 0.4 * rng.uniform(-1, 1, curve.shape))
    guard = _run(list(noisy))
    guard.check(len(noisy), float(noisy[-1]), lambda: [])
    assert guard.rise() is None


def test_bad_guard_settings_are_refused():
  for key in ("train.spike_factor=0.5", "train.spike_margin=-1", "train.spike_steps=-1"):
    with pytest.raises(ConfigError, match=r"train.spike_factor must be >= 1"):
      validate(apply_overrides(micro_config(), [key]))


def test_a_run_that_diverges_from_its_first_steps_is_stopped_with_no_healthy_checkpoint(tmp_path):
  """train.lr=3 without clipping: the loss jumps from 5.6 to about 85 at step 2 and stays far above its start while
  staying finite; a checkpoint every 2 steps keeps only diverged ones by the time the guard stops the run."""
  cfg = apply_overrides(micro_config(), ["train.lr=3", "train.grad_clip=0", "train.warmup_steps=0", "train.steps=12",
                                         "train.log_every=1", "train.checkpoint_every=2", "train.eval_every=1000",
                                         "train.spike_steps=6"])
  with pytest.raises(TrainingError, match=r"^loss spike: [\d.]+ at step 7, above [\d.]+ for the 6 steps since step 2 "
                                          r".*; every kept checkpoint \(steps 2, 4, 6\) was saved after the loss "
                                          r"began to rise at step 2, so none is healthy; start again in a new workdir "
                                          r"with a lower train.lr or a train.grad_clip$"):
    train(cfg, tmp_path, progress=False)
