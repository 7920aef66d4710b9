"""Losses and metrics of the time-series heads. Classification: softmax cross-entropy and accuracy. Regression: the
head predicts the target standardised by the training targets' mean and standard deviation (`TargetScale`); the
loss is the mean squared error in those units, and RMSE / MAE are reported in the target's own units."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class TargetScale(NamedTuple):
  """Regression targets are learned as (y - mean) / std."""
  mean: float
  std: float

  @classmethod
  def of(cls, targets: np.ndarray) -> TargetScale:
    targets = np.asarray(targets, np.float64)
    return cls(float(targets.mean()), float(max(targets.std(), 1e-8)))


def loss(outputs, labels, task: str, scale: TargetScale | None = None):
  """outputs [B, n_outputs] float32, labels [B] -> (mean loss, {"accuracy"} or {"mse"} over the batch). The
  regression's mse is in the target's own units: a mean, so a step's micro-batches (train.grad_accum) average to the
  whole batch's, which a root of each would not."""
  if task == "classification":
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, labels)
    return ce.mean(), {"accuracy": (jnp.argmax(outputs, -1) == labels).mean()}
  error = outputs[:, 0] - (labels - scale.mean) / scale.std
  mse = jnp.mean(error**2)
  return mse, {"mse": mse * scale.std**2}


def evaluate(predict, params, batches, task: str, scale: TargetScale | None = None,
             prefix: str = "val_") -> dict[str, float]:
  """Metrics over every counted row of `batches` (from data.eval_batches), accumulated in float64; `predict(params,
  series, mask) -> outputs [B, n_outputs]` is the jitted model. Classification: loss (mean cross-entropy), accuracy,
  errors (misclassified series); regression: loss (standardised MSE), rmse, mae."""
  outputs, labels = [], []
  for batch in batches:
    keep = batch["count"] > 0
    outputs.append(np.asarray(jax.device_get(predict(params, batch["series"], batch["mask"])), np.float64)[keep])
    labels.append(batch["labels"][keep])
  out, y = np.concatenate(outputs), np.concatenate(labels)
  if task == "classification":
    logp = out - out.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    wrong = int((out.argmax(-1) != y).sum())
    metrics = {"loss": float(-logp[np.arange(len(y)), y].mean()), "accuracy": 1 - wrong / len(y), "errors": wrong}
  else:
    prediction = out[:, 0] * scale.std + scale.mean
    error = prediction - y.astype(np.float64)
    metrics = {"loss": float(np.mean((error / scale.std) ** 2)), "rmse": float(np.sqrt(np.mean(error**2))),
               "mae": float(np.mean(np.abs(error)))}
  return {f"{prefix}{k}": v for k, v in metrics.items()} | {f"{prefix}series": len(y)}
