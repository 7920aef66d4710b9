"""Divergence: a loss or gradient norm that stops being finite, or a training loss far above its running best.

Both are tracked on device every step (no host round trip) and checked on the host at log and save steps, so the
steps named are exact. The loss is "high" at a step when it is not finite, its gradient norm is not finite, or it
exceeds max(train.spike_factor x best, best + train.spike_margin), best being the lowest value so far of the loss's
moving average (decay SMOOTHING: one lucky batch does not lower the bar); the rise begins at the first step of the
current run of high steps. train.spike_steps high steps in a row stop the run like a non-finite loss (0: never).

The error names the way back: the newest kept checkpoint saved before the rise began (checkpoint k's parameters give
the loss of step k + 1, so k + 1 must precede the rise), or says that none is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ltm_jax.config import TrainConfig
from ltm_jax.errors import TrainingError

SMOOTHING = 0.9
FIX = "a lower train.lr or a train.grad_clip"


class Guard:
  """The device-side record of one run (from its first step, or the step it resumed from) and its host checks."""

  def __init__(self, t: TrainConfig):
    self.t = t
    self._bounds = (jnp.float32(t.spike_factor), jnp.float32(t.spike_margin))
    self.record = {
        "nonfinite": jnp.full((2,), -1, jnp.int32),  # The first steps whose loss / grad_norm were not finite.
        "smoothed": jnp.float32(jnp.nan),  # The loss's moving average (NaN before the first finite loss).
        "best": jnp.float32(jnp.inf),  # Its lowest value so far.
        "rise": jnp.int32(-1),  # The first step of the current run of high steps (-1: the last step was not high).
    }

  def update(self, loss: jax.Array, grad_norm: jax.Array, step: jax.Array) -> None:
    self.record = _track(self.record, loss, grad_norm, step, *self._bounds)

  def check(self, step: int, loss: float, kept: Callable[[], list[int]]) -> None:
    """TrainingError when the loss or gradient norm stopped being finite, or the loss has been high for
    train.spike_steps steps up to `step` (whose loss is `loss`); `kept()`: the steps of the kept checkpoints."""
    record = jax.device_get(self.record)
    first = {name: int(s) for name, s in zip(("loss", "grad_norm"), record["nonfinite"]) if int(s) >= 0}
    rise = int(record["rise"]) if int(record["rise"]) >= 0 else None
    if first:
      what = "; ".join(f"{name} became non-finite at step {s}" for name, s in first.items())
      raise TrainingError(f"{what}; {recovery(kept(), rise)}")
    spike = self.t.spike_steps
    if spike and rise is not None and step - rise + 1 >= spike:
      best = float(record["best"])
      bar = max(self.t.spike_factor * best, best + self.t.spike_margin)
      raise TrainingError(
          f"loss spike: {loss:.4g} at step {step}, above {bar:.4g} for the {step - rise + 1} steps since step {rise} "
          f"(train.spike_steps={spike}; the bar is the higher of train.spike_factor={self.t.spike_factor:g} x and "
          f"train.spike_margin={self.t.spike_margin:g} + the best moving average of the loss, {best:.4g}); "
          f"{recovery(kept(), rise)}")

  def rise(self) -> int | None:
    """The step the current rise began at (None: the last step's loss was not high)."""
    rise = int(jax.device_get(self.record["rise"]))
    return rise if rise >= 0 else None


@jax.jit
def _track(record, loss, grad_norm, step, factor, margin):
  loss, grad_norm, step = loss.astype(jnp.float32), grad_norm.astype(jnp.float32), step.astype(jnp.int32)
  bad = ~jnp.isfinite(jnp.stack([loss, grad_norm]))
  best = record["best"]
  high = bad.any() | (loss > jnp.maximum(factor * best, best + margin))
  smoothed = jnp.where(jnp.isnan(record["smoothed"]), loss, SMOOTHING * record["smoothed"] + (1 - SMOOTHING) * loss)
  smoothed = jnp.where(bad[0], record["smoothed"], smoothed)
  return {
      "nonfinite": jnp.where((record["nonfinite"] < 0) & bad, step, record["nonfinite"]),
      "smoothed": smoothed,
      "best": jnp.where(jnp.isnan(smoothed), best, jnp.minimum(best, smoothed)),
      "rise": jnp.where(high, jnp.where(record["rise"] < 0, step, record["rise"]), -1),
  }


def recovery(kept: list[int], rise: int | None) -> str:
  """What a diverged run can do next, given the steps of its kept checkpoints and the step its rise began at (None:
  no rise, every kept checkpoint is healthy)."""
  if not kept:
    return f"no checkpoint was saved; start again in a new workdir with {FIX}"
  healthy = [k for k in kept if rise is None or k + 1 < rise]
  if not healthy:
    listed = ", ".join(str(k) for k in kept)
    return (f"every kept checkpoint (steps {listed}) was saved after the loss began to rise at step {rise}, so none "
            f"is healthy; start again in a new workdir with {FIX}")
  before = "" if rise is None else f" saved before the loss began to rise at step {rise}"
  return (f"the newest checkpoint{before} is step {healthy[-1]}; resume from it with {FIX}: ltm train --from-step "
          f"{healthy[-1]} ... (deletes the checkpoints after it)")
