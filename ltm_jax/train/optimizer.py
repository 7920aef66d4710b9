"""AdamW with linear warmup, cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ltm_jax import model as model_lib
from ltm_jax.config import TrainConfig


def learning_rate(t: TrainConfig) -> optax.Schedule:
  """lr * (step + 1) / warmup_steps while warming up (the first update already moves), then cosine from lr to
  lr * min_lr_ratio at step `steps`, constant after."""
  decay = optax.cosine_decay_schedule(t.lr, max(t.steps - t.warmup_steps, 1), alpha=t.min_lr_ratio)

  def schedule(step):
    warmup = t.lr * (step + 1) / max(t.warmup_steps, 1)
    return jnp.where(step < t.warmup_steps, warmup, decay(step - t.warmup_steps))

  return schedule


def decay_mask(params, decay_embeddings: bool):
  """True for matrices (kernels); False for norms, biases, per-channel vectors and, unless asked, embeddings."""
  def decays(path, leaf) -> bool:
    names = [getattr(p, "key", getattr(p, "name", "")) for p in path]
    if "embedding" in names:
      return decay_embeddings
    return leaf.ndim - model_lib.is_stacked(path) >= 2  # A scanned stack's leading axis is layers, not a matrix.
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      mask=lambda params: decay_mask(params, t.decay_embeddings))
  # identity() has the same (empty) state as clipping, so toggling train.grad_clip keeps checkpoints restorable.
  clip = optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
  return optax.chain(clip, adamw)
