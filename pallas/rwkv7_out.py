"""Pallas kernels for the output stage of an RWKV-7 time-mix: per-head group norm, the r.k bonus and the output gate
in one pass forward and one pass backward, tied by a `jax.custom_vjp`.

With y [R, C] the WKV output (R = B*T rows, C = H heads of N channels), rk [H, R] the per-head bonus sum(r*k*bonus),
v and g [R, C] the values and the gate, and scale, bias [C]:

  yhat = (y - mean_head(y)) / sqrt(var_head(y) + eps)        (per row and head, over its N channels)
  z = yhat * scale + bias + rk * v
  out = z * g

Arithmetic is float32 whatever the inputs' dtypes; `out` is rounded once, to g's dtype.

Kernels (grid over blocks of `block_rows` rows and over heads; one program holds a [block_rows, N] tile of one head):
  forward:  reads y, v, g and rk; writes out.
  backward: reads y, v, g, rk and d_out; recomputes yhat and z and writes dy, dv, dg (in the inputs' dtypes), d_rk
            [H, R] float32, and each row block's partial sums of d_scale and d_bias ([R / block_rows, C] float32,
            summed outside).

Bytes per element of [R, C] (s = itemsize): forward 4s (y, v, g read, out written), backward 7s; the XLA form of the
same computation writes and re-reads float32 intermediates between its fusions in the backward.

Lowering: through `ltm_pallas.backend.call`, i.e. Triton on GPU and `interpret=True` on CPU. Triton constraints
honoured here: every block is a power-of-two [block_rows, N] tile or [block_rows] / [N] row; N must be a power of
two, and block_rows is the largest power of two up to BLOCK_ROWS that divides R, at least MIN_BLOCK_ROWS
(`supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend

BLOCK_ROWS = 64
NUM_WARPS = 4
_SECOND_ORDER = ("rwkv7_out: impl='pallas' (the Pallas RWKV-7 output-stage kernels) has no second derivative; "
                 "impl='xla' has one")


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


MIN_BLOCK_ROWS = 8


def block_rows_for(rows: int, most: int = BLOCK_ROWS) -> int:
  """The largest power of two <= `most` that divides `rows`: the row block the kernels use for R = `rows`."""
  block = 1
  while block * 2 <= most and rows % (block * 2) == 0:
    block *= 2
  return block


def supported(rows: int, head_size: int) -> bool:
  """Whether the kernels take R = `rows` rows of heads of `head_size` channels: a power-of-two head size and a row
  block of at least MIN_BLOCK_ROWS (else use the XLA form)."""
  return _pow2(head_size) and block_rows_for(rows) >= MIN_BLOCK_ROWS


def _normalize(y, eps):
  mean = jnp.mean(y, axis=1, keepdims=True)
  yc = y - mean
  rstd = jax.lax.rsqrt(jnp.mean(yc * yc, axis=1, keepdims=True) + eps)
  return yc * rstd, rstd


def _forward_kernel(y_ref, rk_ref, v_ref, g_ref, scale_ref, bias_ref, out_ref, *, eps):
  yhat, _ = _normalize(y_ref[...].astype(jnp.float32), eps)
  z = (yhat * scale_ref[...][None, :] + bias_ref[...][None, :]
       + rk_ref[...][:, None] * v_ref[...].astype(jnp.float32))
  out_ref[...] = (z * g_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _backward_kernel(y_ref, rk_ref, v_ref, g_ref, scale_ref, bias_ref, dout_ref,
                     dy_ref, drk_ref, dv_ref, dg_ref, dscale_ref, dbias_ref, *, eps):
  yhat, rstd = _normalize(y_ref[...].astype(jnp.float32), eps)
  scale = scale_ref[...][None, :]
  rk = rk_ref[...][:, None]
  v = v_ref[...].astype(jnp.float32)
  g = g_ref[...].astype(jnp.float32)
  dout = dout_ref[...].astype(jnp.float32)
  z = yhat * scale + bias_ref[...][None, :] + rk * v
  dg_ref[...] = (dout * z).astype(dg_ref.dtype)
  dz = dout * g
  dv_ref[...] = (dz * rk).astype(dv_ref.dtype)
  drk_ref[...] = jnp.sum(dz * v, axis=1)
  dscale_ref[...] = jnp.sum(dz * yhat, axis=0)
  dbias_ref[...] = jnp.sum(dz, axis=0)
  dyhat = dz * scale
  dy = rstd * (dyhat - jnp.mean(dyhat, axis=1, keepdims=True)
               - yhat * jnp.mean(dyhat * yhat, axis=1, keepdims=True))
  dy_ref[...] = dy.astype(dy_ref.dtype)


def _specs(n: int, block_rows: int):
  tile = pl.BlockSpec((block_rows, n), lambda i, h: (i, h))
  per_row = pl.BlockSpec((None, block_rows), lambda i, h: (h, i))  # rk, d_rk: [H, R].
  per_channel = pl.BlockSpec((n,), lambda i, h: (h,))
  partial = pl.BlockSpec((None, n), lambda i, h: (i, h))  # [R / block_rows, C] partial sums.
  return tile, per_row, per_channel, partial


def _forward(y, rk, v, g, scale, bias, *, n, eps, block_rows, interpret):
  rows, c = y.shape
  heads = c // n
  tile, per_row, per_channel, _ = _specs(n, block_rows)
  return backend.call(
      functools.partial(_forward_kernel, eps=eps),
      out_shape=jax.ShapeDtypeStruct((rows, c), g.dtype),
      grid=(rows // block_rows, heads),
      in_specs=[tile, per_row, tile, tile, per_channel, per_channel],
      out_specs=tile, num_warps=NUM_WARPS, interpret=interpret, name="rwkv7_out_forward",
  )(y, rk, v, g, scale, bias)


def _backward(y, rk, v, g, scale, bias, dout, *, n, eps, block_rows, interpret):
  rows, c = y.shape
  heads = c // n
  blocks = rows // block_rows
  tile, per_row, per_channel, partial = _specs(n, block_rows)
  f32 = jnp.float32
  dy, drk, dv, dg, dscale, dbias = backend.call(
      functools.partial(_backward_kernel, eps=eps),
      out_shape=(jax.ShapeDtypeStruct((rows, c), y.dtype), jax.ShapeDtypeStruct((heads, rows), f32),
                 jax.ShapeDtypeStruct((rows, c), v.dtype), jax.ShapeDtypeStruct((rows, c), g.dtype),
                 jax.ShapeDtypeStruct((blocks, c), f32), jax.ShapeDtypeStruct((blocks, c), f32)),
      grid=(blocks, heads),
      in_specs=[tile, per_row, tile, tile, per_channel, per_channel, tile],
      out_specs=(tile, per_row, tile, tile, partial, partial), num_warps=NUM_WARPS, interpret=interpret,
      name="rwkv7_out_backward",
  )(y, rk, v, g, scale, bias, dout)
  return dy, drk, dv, dg, jnp.sum(dscale, axis=0), jnp.sum(dbias, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def output(y, rk, v, g, scale, bias, n: int, eps: float, block_rows: int = BLOCK_ROWS,
           interpret: bool | None = None):
  """out [R, C] (g's dtype) = (groupnorm(y) * scale + bias + rk * v) * g, as the module docstring defines it.

  y, v, g: [R, C] (C = H * n); rk: [H, R] float32; scale, bias: [C] float32. `block_rows`, a power of two, must
  divide R (`block_rows_for`).
  """
  return _forward(y, rk, v, g, scale, bias, n=n, eps=eps, block_rows=block_rows, interpret=interpret)


def _output_fwd(y, rk, v, g, scale, bias, n, eps, block_rows, interpret):
  y, rk, v, g, scale, bias = backend.first_order_only(_SECOND_ORDER, y, rk, v, g, scale, bias)
  out = _forward(y, rk, v, g, scale, bias, n=n, eps=eps, block_rows=block_rows, interpret=interpret)
  return out, (y, rk, v, g, scale, bias)


def _output_bwd(n, eps, block_rows, interpret, residuals, dout):
  (y, rk, v, g, scale, bias), dout = backend.first_order_only(_SECOND_ORDER, residuals, dout)
  return _backward(y, rk, v, g, scale, bias, dout, n=n, eps=eps, block_rows=block_rows, interpret=interpret)


output.defvjp(_output_fwd, _output_bwd)
