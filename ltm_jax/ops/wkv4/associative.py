"""Parallel backend of the RWKV-4 WKV op: `jax.lax.associative_scan` over time, O(log T) depth.

The state recurrence s_t = e^w·s_{t-1} + e^{k_t}·(v_t, 1) is an affine map with a per-channel diagonal decay, so a
span of tokens composes into one element: its weighted sums (num, den) on a log-scale mx, plus the decay of the whole
span. Because w is the same at every step, the span's decay is e^{n·w} with n its length in tokens; carrying the exact
integer n (one multiply, one rounding) instead of a float sum of n copies of w keeps T = 16k accurate for w near 0
and near -20 alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops.wkv4 import scan


def _combine(w: jax.Array):
  """The associative operator on (n, mx, nd): `left` covers the earlier tokens, `right` the later ones.

  n is [1, 1, T', 1] int32, mx [1, B, T', C] and nd = (num, den) stacked on the leading axis, [2, B, T', C]; keeping
  num and den in one array halves the slicing that the scan (and its transpose) emits.
  """

  def combine(left, right):
    n_l, mx_l, nd_l = left
    n_r, mx_r, nd_r = right
    # The earlier span decays over every step of the later one before the two are added.
    decayed = mx_l + n_r.astype(jnp.float32) * w
    mx = jnp.maximum(decayed, mx_r)
    return n_l + n_r, mx, jnp.exp(decayed - mx) * nd_l + jnp.exp(mx_r - mx) * nd_r

  return combine


def wkv4(
    w: jax.Array,
    u: jax.Array,
    k: jax.Array,
    v: jax.Array,
    state: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """WKV by a parallel prefix scan over time; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv4.wkv4`, with `state` a plain (num, den, mx) tuple of [B, C] float32.
  """
  w = w.astype(jnp.float32)
  u = u.astype(jnp.float32)
  k32 = k.astype(jnp.float32)[None]  # [1, B, T, C]
  v32 = v.astype(jnp.float32)
  num0, den0, mx0 = (s.astype(jnp.float32)[None, :, None, :] for s in state)  # [1, B, 1, C]
  nd0 = jnp.concatenate([num0, den0])
  combine = _combine(w)

  # Token t alone is one step long and adds e^{k_t}·(v_t, 1). The count is the same for every batch row and
  # channel, so it is [1, 1, T, 1] and broadcasts inside `combine`.
  t = k.shape[1]
  n = jnp.ones((1, 1, t, 1), jnp.int32)
  nd = jnp.stack([v32, jnp.ones_like(v32)])  # [2, B, T, C]
  # Folding the incoming state (a zero-length span) into token 0 makes the inclusive scan yield the states after
  # every token directly, with no extra pass over T.
  _, mx_first, nd_first = combine((jnp.zeros_like(n[:, :, :1]), mx0, nd0), (n[:, :, :1], k32[:, :, :1], nd[:, :, :1]))
  elems = (
      n,
      jnp.concatenate([mx_first, k32[:, :, 1:]], axis=2),
      jnp.concatenate([nd_first, nd[:, :, 1:]], axis=2),
  )
  _, mx, nd = jax.lax.associative_scan(combine, elems, axis=2)

  # y_t reads the state before t (the exclusive prefix): the incoming state, then the states after 0..T-2.
  prev_mx = jnp.concatenate([mx0, mx[:, :, :-1]], axis=2)[0]
  prev_num, prev_den = jnp.concatenate([nd0, nd[:, :, :-1]], axis=2)
  uk = u + k32[0]
  p = jnp.maximum(prev_mx, uk)
  e_state, e_tok = jnp.exp(prev_mx - p), jnp.exp(uk - p)
  y = (e_state * prev_num + e_tok * v32) / scan.nonzero(e_state * prev_den + e_tok)
  return y.astype(v.dtype), (nd[0, :, -1], nd[1, :, -1], mx[0, :, -1])
