"""Chunked backend of the RWKV-7 WKV op: exact, pure JAX, differentiable by autodiff.

The sequence is cut into chunks of L tokens. Within a chunk, with g_t = w_1 + ... + w_t the cumulative log-decay
from the chunk start (g_0 = 0) and S_0 the state entering the chunk, the recurrence unrolls to

  S_t = S_0·diag(e^{g_t}) + sum_{s<=t} (u_s b_s^T + v_s k_s^T)·diag(e^{g_t - g_s}),   u_t = S_{t-1} a_t,

a generalized delta rule. Stacking the u_t as rows of U [L, N] gives a unit lower-triangular system

  (I - A_ab) U = Ã S_0^T + A_ak V,   A_xy[t, s] = sum_j x_tj y_sj e^{g_{t-1,j} - g_{s,j}}  (s < t),  Ã_t = a_t e^{g_{t-1}}

whose solution T = (I - A_ab)^{-1} (the WY form) turns each chunk into an affine map of its incoming state,
S_L = S_0 M + C. Only that N x N map is passed sequentially from chunk to chunk; everything else is a batch of
small matrix products over all chunks at once. The outputs follow from the chunk's incoming state:

  Y = R̃ S_0^T + A_rb U + A_rk V,   A_ry[t, s] = sum_j r_tj y_sj e^{g_{t,j} - g_{s,j}}  (s <= t),  R̃_t = r_t e^{g_t}.

Every exponent above is a decay over a span that runs forwards in time, so it is <= 0 and nothing overflows
whatever the decay (w = -1e4 is as safe as w = -1e-6); factoring e^{g_t - g_s} into e^{g_t}·e^{-g_s}, the usual
trick, overflows float32 once a chunk's total decay passes ~88. The price is one [L, L, N] tensor of pairwise decays
per chunk (L·N exponentials per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
  """(I - a)^{-1} for strictly lower-triangular a [..., L, L]: the finite series I + a + a^2 + ... by doubling.

  a is nilpotent (a^L = 0), so (I + a)(I + a^2)(I + a^4)... with ceil(log2 L) factors is exact; it is a handful of
  batched matmuls, which autodiff and every backend handle well, unlike a batched triangular solve.
  """
  size = a.shape[-1]
  inverse = jnp.eye(size, dtype=a.dtype) + a
  power, span = a, 2
  while span < size:
    power = power @ power
    inverse = inverse + inverse @ power
    span *= 2
  return inverse


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    chunk: int = 16,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 chunk by chunk; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv7.wkv7`; `chunk` is the chunk length L (any T works: the tail is padded
  with identity steps, w = k = v = a = b = r = 0, which leave the state unchanged).
  """
  batch, length, heads, size = r.shape
  out_dtype = v.dtype
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length

  def to_chunks(x):  # [B, T, H, N] -> [B, H, C, L, N] float32
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.reshape(batch, num_chunks, chunk, heads, size).transpose(0, 3, 1, 2, 4)

  r, w, k, v, a, b = (to_chunks(x) for x in (r, w, k, v, a, b))
  g = jnp.cumsum(w, axis=-2)  # Log-decay from the chunk start through token t, inclusive.
  # ... through token t - 1: g shifted by one, not g - w, so that g_before[t] - g[t - 1] is exactly 0. With w = -400,
  # g - w would round by ~eps·|g| and turn the undecayed e^0 = 1 of the previous token into 1 ± 4e-4.
  g_before = jnp.pad(g[..., :-1, :], ((0, 0),) * (g.ndim - 2) + ((1, 0), (0, 0)))
  g_total = g[..., -1:, :]

  # Pairwise decays from just after token s to just before token t, for s < t; zero elsewhere. The mask goes on the
  # exponent, not the result, so the positive exponents above the diagonal are never evaluated.
  rows = jnp.arange(chunk)
  strict = (rows[:, None] > rows[None, :])[:, :, None]  # [L(t), L(s), 1]
  decay_before = jnp.exp(jnp.where(strict, g_before[..., :, None, :] - g[..., None, :, :], -jnp.inf))
  # Through token t instead: one more step of decay, and the diagonal s = t is the undecayed token itself.
  decay_through = decay_before * jnp.exp(w)[..., :, None, :] + jnp.eye(chunk, dtype=jnp.float32)[:, :, None]

  pair = lambda x, d, y: jnp.einsum("...tj,...tsj,...sj->...ts", x, d, y)
  a_b, a_k = pair(a, decay_before, b), pair(a, decay_before, k)
  r_b, r_k = pair(r, decay_through, b), pair(r, decay_through, k)

  # u_t = S_0 (a_t e^{g_{t-1}}) + (the chunk's own tokens) => U = W S_0^T + U_own.
  solve = _unit_lower_inverse(a_b)
  w_state = solve @ (a * jnp.exp(g_before))  # [.., L, N(key)]
  u_own = solve @ (a_k @ v)  # [.., L, N(value)]
  # Each token's contribution decayed to the chunk end.
  to_end = jnp.exp(g_total - g)
  b_end, k_end = b * to_end, k * to_end
  # S_L = S_0 (diag(e^{g_L}) + W^T B_end) + (U_own^T B_end + V^T K_end)
  transition = jnp.einsum("...tj,...tl->...jl", w_state, b_end) + jnp.exp(g_total)[..., 0, :, None] * jnp.eye(size)
  inflow = jnp.einsum("...ti,...tj->...ij", u_own, b_end) + jnp.einsum("...ti,...tj->...ij", v, k_end)

  def carry_state(s, chunk_map):
    m, c = chunk_map
    return s @ m + c, s

  chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # Scan over chunks: [C, B, H, N, N].
  final, starts = jax.lax.scan(carry_state, state.astype(jnp.float32), (chunk_major(transition), chunk_major(inflow)))
  starts = jnp.moveaxis(starts, 0, 2)  # [B, H, C, N(value), N(key)], the state entering each chunk.

  u = jnp.einsum("...tj,...ij->...ti", w_state, starts) + u_own
  y = jnp.einsum("...tj,...ij->...ti", r * jnp.exp(g), starts) + r_b @ u + r_k @ v
  y = y.transpose(0, 2, 3, 1, 4).reshape(batch, num_chunks * chunk, heads, size)[:, :length]
  return y.astype(out_dtype), final
