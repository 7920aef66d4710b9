"""Pallas kernels for the key side of an RWKV-7 time-mix before WKV-7: the normalised key, the delta rule's inputs, the
in-context-learning-rate key and the r.k bonus sums, in one pass forward and one pass backward, tied by a
`jax.custom_vjp`.

With k, z, r [R, C] (R = B*T rows, C = H heads of N channels; z the in-context learning rate's low-rank term) and
s, m, u, z0 [C] (the key-norm scale, the key's iclr mix, the bonus and the learning rate's base):

  a = sigmoid(z0 + z)                                       (the in-context learning rate, in (0, 1))
  kk = (k * s) / max(|k * s|_head, eps)                     (per row and head, over its N channels)
  neg_kk = -kk,  b = kk * a                                 (the delta rule's removal and replacement keys)
  k2 = k * (1 + (a - 1) * m)                                (the key WKV-7 writes)
  rk = sum_head(r * k2 * u)                                 ([H, R] float32: the per-head bonus sums)

Arithmetic is float32 whatever the inputs' dtypes; neg_kk, b and k2 are rounded once, to k's dtype.

Kernels (grid over blocks of rows, `block_rows` forward and at most BACKWARD_BLOCK_ROWS backward, and over heads; one
program holds a [rows, N] tile of one head):
  forward:  reads k, z, r; writes neg_kk, b, k2 and rk.
  backward: reads k, z, r and the four cotangents; recomputes a, kk and k2 and writes dk, dz, dr (in the inputs'
            dtypes) and each row block's partial sums of ds, dm, du and dz0 ([R / block_rows, C] float32, summed
            outside).

Bytes per element of [R, C] (s = itemsize): forward 6s (k, z, r read, three outputs written), backward 10s.

Lowering and tiling as `ltm_pallas.rwkv7_out` (`supported`, `block_rows_for`): Triton on GPU, `interpret=True` on
CPU; N a power of two, row blocks a power of two of at least MIN_BLOCK_ROWS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ltm_pallas import backend
from ltm_pallas.rwkv7_out import MIN_BLOCK_ROWS, block_rows_for, supported  # noqa: F401  (the same tiling)
from ltm_pallas.rwkv7_out import _specs

BLOCK_ROWS = 64
# The backward holds about ten float32 tiles at once: at 64 rows of N = 64 on 4 warps it needs all 255 registers a
# thread may have (ptxas, sm_90a); 32 rows halve that.
BACKWARD_BLOCK_ROWS = 32
NUM_WARPS = 4
_SECOND_ORDER = ("rwkv7_key: impl='pallas' (the Pallas RWKV-7 key-side kernels) has no second derivative; "
                 "impl='xla' has one")


def _key_side(k, a, s, m, eps):
  """(kk, 1 / max(|k s|, eps), k2) in float32 for one [rows, N] tile."""
  ks = k * s
  inv = 1.0 / jnp.maximum(jnp.sqrt(jnp.sum(ks * ks, axis=1, keepdims=True)), eps)
  return ks * inv, inv, k * (1.0 + (a - 1.0) * m)


def _rate(z_ref, z0_ref):
  return jax.nn.sigmoid(z0_ref[...][None, :] + z_ref[...].astype(jnp.float32))


def _forward_kernel(k_ref, z_ref, r_ref, s_ref, m_ref, u_ref, z0_ref, negkk_ref, b_ref, k2_ref, rk_ref, *, eps):
  k = k_ref[...].astype(jnp.float32)
  a = _rate(z_ref, z0_ref)
  kk, _, k2 = _key_side(k, a, s_ref[...][None, :], m_ref[...][None, :], eps)
  negkk_ref[...] = (-kk).astype(negkk_ref.dtype)
  b_ref[...] = (kk * a).astype(b_ref.dtype)
  k2_ref[...] = k2.astype(k2_ref.dtype)
  rk_ref[...] = jnp.sum(r_ref[...].astype(jnp.float32) * k2 * u_ref[...][None, :], axis=1)


def _backward_kernel(k_ref, z_ref, r_ref, s_ref, m_ref, u_ref, z0_ref, dnegkk_ref, db_ref, dk2_ref, drk_ref,
                     dk_ref, dz_ref, dr_ref, ds_ref, dm_ref, du_ref, dz0_ref, *, eps):
  k = k_ref[...].astype(jnp.float32)
  a = _rate(z_ref, z0_ref)
  r = r_ref[...].astype(jnp.float32)
  s, m, u = s_ref[...][None, :], m_ref[...][None, :], u_ref[...][None, :]
  kk, inv, k2 = _key_side(k, a, s, m, eps)
  drk = drk_ref[...][:, None]
  db = db_ref[...].astype(jnp.float32)
  dk2 = dk2_ref[...].astype(jnp.float32) + drk * r * u  # k2 reaches the output directly and through rk.
  dr_ref[...] = (drk * k2 * u).astype(dr_ref.dtype)
  du_ref[...] = jnp.sum(drk * r * k2, axis=0)
  dkk = db * a - dnegkk_ref[...].astype(jnp.float32)
  dz = (db * kk + dk2 * k * m) * a * (1.0 - a)
  dz_ref[...] = dz.astype(dz_ref.dtype)
  dz0_ref[...] = jnp.sum(dz, axis=0)
  dm_ref[...] = jnp.sum(dk2 * k * (a - 1.0), axis=0)
  # Through the normalisation: d(ks) = (dkk - kk <dkk, kk>) / |ks| while |ks| > eps, dkk / eps below it.
  unclamped = (inv < 1.0 / eps).astype(jnp.float32)
  dks = (dkk - unclamped * kk * jnp.sum(dkk * kk, axis=1, keepdims=True)) * inv
  ds_ref[...] = jnp.sum(dks * k, axis=0)
  dk_ref[...] = (dk2 * (1.0 + (a - 1.0) * m) + dks * s).astype(dk_ref.dtype)


def _forward(k, z, r, s, m, u, z0, *, n, eps, block_rows, interpret):
  rows, c = k.shape
  heads = c // n
  tile, per_row, per_channel, _ = _specs(n, block_rows)
  tiles = jax.ShapeDtypeStruct((rows, c), k.dtype)
  return backend.call(
      functools.partial(_forward_kernel, eps=eps),
      out_shape=(tiles, tiles, tiles, jax.ShapeDtypeStruct((heads, rows), jnp.float32)),
      grid=(rows // block_rows, heads),
      in_specs=[tile, tile, tile, per_channel, per_channel, per_channel, per_channel],
      out_specs=(tile, tile, tile, per_row), num_warps=NUM_WARPS, interpret=interpret, name="rwkv7_key_forward",
  )(k, z, r, s, m, u, z0)


def _backward(k, z, r, s, m, u, z0, dnegkk, db, dk2, drk, *, n, eps, block_rows, interpret):
  rows, c = k.shape
  heads = c // n
  block_rows = min(block_rows, BACKWARD_BLOCK_ROWS)  # Powers of two: it still divides the rows.
  blocks = rows // block_rows
  tile, per_row, per_channel, partial = _specs(n, block_rows)
  sums = jax.ShapeDtypeStruct((blocks, c), jnp.float32)
  dk, dz, dr, ds, dm, du, dz0 = backend.call(
      functools.partial(_backward_kernel, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((rows, c), k.dtype), jax.ShapeDtypeStruct((rows, c), z.dtype),
                 jax.ShapeDtypeStruct((rows, c), r.dtype), sums, sums, sums, sums),
      grid=(blocks, heads),
      in_specs=[tile, tile, tile, per_channel, per_channel, per_channel, per_channel, tile, tile, tile, per_row],
      out_specs=(tile, tile, tile, partial, partial, partial, partial), num_warps=NUM_WARPS, interpret=interpret,
      name="rwkv7_key_backward",
  )(k, z, r, s, m, u, z0, dnegkk, db, dk2, drk)
  total = lambda x: jnp.sum(x, axis=0)
  return dk, dz, dr, total(ds), total(dm), total(du), total(dz0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def key_side(k, z, r, s, m, u, z0, n: int, eps: float, block_rows: int = BLOCK_ROWS,
             interpret: bool | None = None):
  """(neg_kk, b, k2 [R, C] in k's dtype, rk [H, R] float32), as the module docstring defines them.

  k, z, r: [R, C] (C = H * n), one dtype; s, m, u, z0: [C] float32. `block_rows`, a power of two, must divide R
  (`block_rows_for`).
  """
  return _forward(k, z, r, s, m, u, z0, n=n, eps=eps, block_rows=block_rows, interpret=interpret)


def _key_side_fwd(k, z, r, s, m, u, z0, n, eps, block_rows, interpret):
  inputs = backend.first_order_only(_SECOND_ORDER, k, z, r, s, m, u, z0)
  return _forward(*inputs, n=n, eps=eps, block_rows=block_rows, interpret=interpret), inputs


def _key_side_bwd(n, eps, block_rows, interpret, residuals, cotangents):
  residuals, cotangents = backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
  return _backward(*residuals, *cotangents, n=n, eps=eps, block_rows=block_rows, interpret=interpret)


key_side.defvjp(_key_side_fwd, _key_side_bwd)
