"""Sequential reference backend of the RWKV-4 WKV op: one `lax.scan` step per token.

The state is carried in the running-max form of the official RWKV-4 CUDA kernel, a = num·e^mx and b = den·e^mx,
so no exponential ever sees more than the gap between two log-scales and nothing overflows. Unlike that kernel, the
log-scale is carried as an anchor plus a whole number of decay steps, mx = anchor + n·w: adding w to mx at every
step rounds each time, and with |w| ~ 1e-4 against |mx| ~ 1 that drift reaches ~1e-3 in a and b after 16k tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nonzero(denominator: jax.Array) -> jax.Array:
  """y_t's denominator, 1 where it is 0: only a token of weight 0 on an empty state (left padding) has 0 there, and
  its y_t = 0 / 0 would be NaN, as would every gradient through it even where the output is masked."""
  return jnp.where(denominator > 0, denominator, 1.0)


def wkv4(
    w: jax.Array,
    u: jax.Array,
    k: jax.Array,
    v: jax.Array,
    state: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """WKV by a sequential scan over time; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv4.wkv4`, with `state` a plain (num, den, mx) tuple of [B, C] float32.
  """
  w = w.astype(jnp.float32)
  u = u.astype(jnp.float32)
  # Time-major so that scan slices one [B, C] token per step.
  kt = jnp.swapaxes(k, 0, 1).astype(jnp.float32)
  vt = jnp.swapaxes(v, 0, 1).astype(jnp.float32)

  def step(carry, kv):
    num, den, anchor, n = carry
    k_t, v_t = kv
    # Output: the state before t plus the current token weighted by e^{u+k}, both rescaled to their common max.
    mx = anchor + n.astype(jnp.float32) * w
    uk = u + k_t
    p = jnp.maximum(mx, uk)
    e_state, e_tok = jnp.exp(mx - p), jnp.exp(uk - p)
    y_t = (e_state * num + e_tok * v_t) / nonzero(e_state * den + e_tok)
    # State update: decay the old state by e^w and add the current token weighted by e^k.
    decayed = anchor + (n + 1).astype(jnp.float32) * w
    p = jnp.maximum(decayed, k_t)
    e_state, e_tok = jnp.exp(decayed - p), jnp.exp(k_t - p)
    num, den = e_state * num + e_tok * v_t, e_state * den + e_tok
    # The new log-scale p is either the old one one step on (keep the anchor, count the step) or k_t (re-anchor).
    keep = decayed >= k_t
    return (num, den, jnp.where(keep, anchor, k_t), jnp.where(keep, n + 1, 0)), y_t

  num, den, mx = (s.astype(jnp.float32) for s in state)
  init = (num, den, mx, jnp.zeros(mx.shape, jnp.int32))
  (num, den, anchor, n), y = jax.lax.scan(step, init, (kt, vt))
  return jnp.swapaxes(y, 0, 1).astype(v.dtype), (num, den, anchor + n.astype(jnp.float32) * w)
