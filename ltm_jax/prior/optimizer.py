"""The prior's optimizer: AdamW with linear warmup and cosine decay to a tenth of the peak rate, optionally after
global-norm clipping."""

from __future__ import annotations

import optax

from ltm_jax.config import PriorConfig


def make_optimizer(cfg: PriorConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1),
                                                end_value=0.1 * cfg.lr)
  clip = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  return optax.chain(*clip, optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=cfg.weight_decay))
