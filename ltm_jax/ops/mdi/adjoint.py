"""The MDI recurrence with a hand-written backward pass: the fast sequential form.

The gate g_t = sigmoid(gate_z_t + h_{t-1} W_h) and the RMSNorm make h_t a nonlinear function of h_{t-1}, so the
steps do not compose into an associative operator (as the affine steps of a linear recurrence do) and no parallel
scan applies: the recurrence stays a sequential loop, and the work is in making each step cheap.

Forward: the reference's loop, keeping per token the gate g_t and the norm's reciprocal r_t ([B, T, D] and [B, T])
besides h_t. Backward: one reverse loop that carries dL/dh_{t-1} only; its one matmul per step (the gate's
da_t W_h^T) is the only work that has to be sequential. Every other gradient (of gate_z, z, gamma, the norm scale, and
the weight gradient sum_t h_{t-1}^T da_t, which autodiff of the scan accumulates one [B, D] x [D, D] outer product
per step) is an elementwise expression of the saved values and the per-token dL/dh_t, computed after the loop for all
tokens at once, the weight gradient as a single [D, B T] x [B T, D] product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_time_major = lambda x: jnp.moveaxis(x, 1, 0)


def _forward_step(h, gate_z, z, gamma, keep, w_h, scale, eps, clip):
  g = jax.nn.sigmoid(gate_z + h @ w_h)
  u = (1 - g) * h + g * z + gamma * h
  r = lax.rsqrt(jnp.mean(u * u, axis=-1, keepdims=True) + eps)
  new = jnp.where(keep[:, None] > 0, jnp.clip(u * r * scale, -clip, clip), h)
  return new, g, r[..., 0]


def _local_grads(p, gate_z, z, gamma, keep, g, r, scale, dh, clip):
  """Gradients of one step (any leading shape) given dL/dh_t: (da: into the gate's logits, du: into the pre-norm
  sum, dn_scale: into the norm scale per position, dp: into h_{t-1} except through the gate's matmul)."""
  del gate_z
  keep = keep[..., None] > 0
  u = p * (1 - g + gamma) + g * z
  unit = u * r[..., None]
  inside = jnp.abs(unit * scale) <= clip  # The clip passes gradients only where it does not bind.
  dn = jnp.where(keep & inside, dh, 0)
  d_unit = dn * scale
  du = r[..., None] * (d_unit - unit * jnp.mean(d_unit * unit, axis=-1, keepdims=True))
  da = du * (z - p) * g * (1 - g)
  dp = du * (1 - g + gamma) + jnp.where(keep, 0, dh)
  return da, du, dn * unit, dp


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def mdi(gate_z, z, gamma, keep, w_h, scale, h0, eps: float, clip: float):
  """See `ltm_jax.ops.mdi.mdi`; inputs already in the compute dtype, keep [B, T] in it too.
  Returns (hs [B, T, D], h_T [B, D])."""
  (hs, h), _ = _mdi_fwd(gate_z, z, gamma, keep, w_h, scale, h0, eps, clip)
  return hs, h


def _mdi_fwd(gate_z, z, gamma, keep, w_h, scale, h0, eps, clip):
  def body(h, token):
    h, g, r = _forward_step(h, *token, w_h, scale, eps, clip)
    return h, (h, g, r)

  h, (hs, gs, rs) = lax.scan(body, h0, tuple(map(_time_major, (gate_z, z, gamma, keep))))
  hs, gs, rs = _time_major(hs), _time_major(gs), _time_major(rs)
  return (hs, h), (gate_z, z, gamma, keep, w_h, scale, h0, hs, gs, rs)


def _mdi_bwd(eps, clip, saved, cotangents):
  del eps
  gate_z, z, gamma, keep, w_h, scale, h0, hs, gs, rs = saved
  d_hs, d_h = cotangents
  prev = jnp.concatenate([h0[:, None], hs[:, :-1]], axis=1)  # h_{t-1} for every t.

  def body(carry, token):
    p, gz, zt, gm, kp, g, r, dy = token
    dh = dy + carry
    da, _, _, dp = _local_grads(p, gz, zt, gm, kp, g, r, scale, dh, clip)
    return dp + da @ w_h.T, dh

  tokens = tuple(map(_time_major, (prev, gate_z, z, gamma, keep, gs, rs, d_hs)))
  d_h0, dhs = lax.scan(body, d_h, tokens, reverse=True)
  da, du, d_scale, _ = _local_grads(prev, gate_z, z, gamma, keep, gs, rs, scale, _time_major(dhs), clip)
  d_w = jnp.einsum("btd,bte->de", prev, da)
  return (da, du * gs, du * prev, jnp.zeros_like(keep), d_w, jnp.sum(d_scale, axis=(0, 1)), d_h0)


mdi.defvjp(_mdi_fwd, _mdi_bwd)
