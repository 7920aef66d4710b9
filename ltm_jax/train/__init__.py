"""Training: optimizer, jitted steps, checkpoints, metrics and the loop."""

from ltm_jax.train.loop import TrainResult, train
