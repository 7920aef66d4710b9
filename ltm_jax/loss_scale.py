"""Dynamic loss scaling for float16 compute (model.dtype=float16).

float16 keeps 5 exponent bits: gradients of activations below ~6e-8 flush to zero (and below ~6e-5 lose precision).
Multiplying the loss by a large scale S lifts every backward value by S; the float32 parameter gradients are divided by
S again before the optimizer. S is found on the fly: halved (and the step skipped) whenever a gradient overflows to
inf/nan, doubled after `period` steps in a row without overflow. bfloat16 has float32's exponent range and needs none
of this.

Usage inside a jitted train step (the state is a pytree, so it lives in the train state and in checkpoints):

  scaled_loss, grads = jax.value_and_grad(lambda p: scale_loss(ls, loss(p)))(params)
  grads = unscale(ls, grads)
  finite = all_finite(grads)
  new_params, new_opt_state = select(finite, (new_params, new_opt_state), (params, opt_state))  # skip bad steps
  ls = update(ls, finite)
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LossScale:
  """scale: float32 scalar, a power of two (so scaling and unscaling are exact); good_steps: int32 scalar, steps in a
  row with finite gradients since the scale last changed. `period`, `factor`, `min_scale`, `max_scale` are static
  (not traced, not checkpointed as arrays)."""
  scale: jax.Array
  good_steps: jax.Array
  period: int = flax.struct.field(pytree_node=False, default=2000)
  factor: float = flax.struct.field(pytree_node=False, default=2.0)
  min_scale: float = flax.struct.field(pytree_node=False, default=1.0)
  max_scale: float = flax.struct.field(pytree_node=False, default=2.0**24)


def initial(scale: float = 2.0**15, *, period: int = 2000, factor: float = 2.0, min_scale: float = 1.0,
            max_scale: float = 2.0**24) -> LossScale:
  """A fresh loss scale. 2^15 is a common start: large enough for small gradients, and the first overflows (if any)
  halve it within a few steps."""
  if not (period >= 1 and factor > 1 and 0 < min_scale <= scale <= max_scale):
    raise ValueError(f"loss scale: need period >= 1, factor > 1 and 0 < min_scale <= scale <= max_scale; got "
                     f"period={period}, factor={factor}, scale={scale}, min_scale={min_scale}, max_scale={max_scale}")
  return LossScale(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), period, factor, min_scale, max_scale)


def scale_loss(loss_scale: LossScale, loss: jax.Array) -> jax.Array:
  """loss * S (differentiate this one)."""
  return loss * loss_scale.scale.astype(loss.dtype)


def unscale(loss_scale: LossScale, grads: Any) -> Any:
  """Gradients of the scaled loss divided by S, in float32 whatever their dtype."""
  inverse = 1.0 / loss_scale.scale
  return jax.tree.map(lambda g: g.astype(jnp.float32) * inverse, grads)


def all_finite(tree: Any) -> jax.Array:
  """bool scalar: no inf or nan in any leaf."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def update(loss_scale: LossScale, finite: jax.Array) -> LossScale:
  """The scale after a step: divided by `factor` (not below min_scale) on overflow; multiplied by `factor` (not above
  max_scale) after `period` finite steps in a row; the counter restarts whenever the scale changes or overflows."""
  good = loss_scale.good_steps + 1
  grow = finite & (good >= loss_scale.period)
  grown = jnp.minimum(loss_scale.scale * loss_scale.factor, loss_scale.max_scale)
  shrunk = jnp.maximum(loss_scale.scale / loss_scale.factor, loss_scale.min_scale)
  scale = jnp.where(finite, jnp.where(grow, grown, loss_scale.scale), shrunk)
  good_steps = jnp.where(finite & ~grow, good, 0).astype(jnp.int32)
  return loss_scale.replace(scale=scale.astype(jnp.float32), good_steps=good_steps)


def select(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the step's gradients were finite, else `old` (the step is skipped): leaf by leaf."""
  return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
