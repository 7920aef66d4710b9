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


def global_norm(tree) -> jax.Array:
  """The L2 norm of all leaves together, optax.tree.norm's value (float32; the summation order differs).

  On one device the leaves are concatenated into one float32 vector, materialised behind an optimization barrier,
  and reduced once: `optax.tree.norm` compiles to one reduction kernel per leaf (287 launches for small_rwkv7's 205
  leaves, most of them a few microseconds of launch for a few kilobytes), and without the barrier XLA rewrites the
  reduction of a concatenation back into per-leaf reductions. On several devices the leaves may be sharded, and a
  concatenation would gather them; there each leaf's partial sums are reduced where they lie (`optax.tree.norm`).
  The price on one device: a float32 copy of the gradients lives for the reduction (4 bytes a parameter).
  """
  leaves = jax.tree.leaves(tree)
  if len(leaves) < 2 or jax.device_count() > 1:
    return optax.tree.norm(tree)
  flat = jax.lax.optimization_barrier(jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]))
  return jnp.sqrt(jnp.sum(jnp.square(flat)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm with the norm of `global_norm`: the same rule (updates kept below `max_norm`, else
  scaled by max_norm / norm) and the same empty state, so checkpoints of either restore with the other."""

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    keep = norm < max_norm
    return jax.tree.map(lambda u: jax.lax.select(keep, u, (u / norm.astype(u.dtype)) * max_norm), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      mask=lambda params: decay_mask(params, t.decay_embeddings))
  # identity() has the same (empty) state as clipping, so toggling train.grad_clip keeps checkpoints restorable.
  clip = clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity()
  return optax.chain(clip, adamw)
