"""Sequential reference backend of the RWKV-7 WKV op: one `lax.scan` step per token, float32 state.

Per head, with S the [N, N] state (row i = value index, column j = key index):

  sa = S a_t;   S <- S·diag(e^{w_t}) + sa b_t^T + v_t k_t^T;   y_t = S r_t

This is the recurrence as written, no reformulation: the other backends are tested against it, and it against a
float64 reference in the tests. Gradients come from JAX autodiff of the scan (it keeps one [B, H, N, N] state per
token for the backward, so it is meant for checking and short sequences, not for long training runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by a sequential scan over time; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv7.wkv7`: r, w, k, v, a, b are [B, T, H, N], state is [B, H, N, N] float32.
  """
  # Time-major float32 so that the scan slices one [B, H, N] token per step.
  to_steps = lambda x: jnp.swapaxes(x, 0, 1).astype(jnp.float32)
  xs = tuple(to_steps(x) for x in (r, w, k, v, a, b))

  def step(s, x):
    r_t, w_t, k_t, v_t, a_t, b_t = x
    sa = jnp.einsum("bhij,bhj->bhi", s, a_t)
    s = s * jnp.exp(w_t)[:, :, None, :] + sa[..., None] * b_t[:, :, None, :] + v_t[..., None] * k_t[:, :, None, :]
    return s, jnp.einsum("bhij,bhj->bhi", s, r_t)

  state, y = jax.lax.scan(step, state.astype(jnp.float32), xs)
  return jnp.swapaxes(y, 0, 1).astype(v.dtype), state
