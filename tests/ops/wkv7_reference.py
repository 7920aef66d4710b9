"""The WKV-7 recurrence written plainly, token by token, for the tests to run in float64."""

import jax
import jax.numpy as jnp


def wkv7_reference(r, w, k, v, a, b, state):
  """S_t = S_{t-1} (diag(e^{w_t}) + a_t b_t^T) + v_t k_t^T, y_t = S_t r_t over [B, T, H, N] inputs from the
  [B, H, N, N] state; returns (y [B, T, H, N], the final state)."""
  size = r.shape[-1]

  def step(s, x):
    r_t, w_t, k_t, v_t, a_t, b_t = x  # Each [B, H, N].
    transition = jnp.exp(w_t)[..., :, None] * jnp.eye(size) + a_t[..., :, None] * b_t[..., None, :]
    s = s @ transition + v_t[..., :, None] * k_t[..., None, :]
    return s, (s @ r_t[..., :, None])[..., 0]

  state, y = jax.lax.scan(step, state, tuple(jnp.swapaxes(x, 0, 1) for x in (r, w, k, v, a, b)))
  return jnp.swapaxes(y, 0, 1), state
