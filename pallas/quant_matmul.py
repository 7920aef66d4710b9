"""A Pallas matmul that reads int8 or packed int4 weights and applies their scales after the product.

  y[m, n] = sum_g scale[g, n] * sum_{k in group g} x[m, k] * w[k, n]

x [M, K] is floating point; the weight is int8 values in groups of K along the fan-in, G = K / group groups, with a
float32 scale per (group, output channel):
  int8:  values [G, group, N], one value per byte (per-output-channel int8 is G = 1);
  int4:  values [G, group / 2, N], two per byte: row i of a group holds input i in its low nibble and input
         i + group / 2 in its high nibble (two's complement, values in [-7, 7]), so a group unpacks into two
         contiguous halves, each multiplied by a contiguous half of x's group.
Weights stay integers in memory and in the loads: each program converts a [rows, block_n] tile to x's dtype in
registers, so a decoding step (M = batch rows, a few) reads 1 or 1/2 byte per weight plus 4 / group bytes of scale.

Grid (M / block_m, N / block_n): one output tile per program, looping over the groups (and, for long int8 groups,
over chunks of `block_k` rows), accumulating in float32. M is padded to block_m (at least 16: Triton's dot needs
16-row tiles); N must be a multiple of block_n and the group (int4: half the group) of block_k, both powers of two
of at least 16.

Lowering: through `ltm_pallas.backend.call`, Triton on GPU and the interpreter on CPU (where it only checks numerics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4


def unpack_int4(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int8 rows of packed nibbles -> (low, high) int8 values, sign-extended: the first and second half of a group."""
  return jnp.right_shift(jnp.left_shift(packed, 4), 4), jnp.right_shift(packed, 4)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, packed: bool, block_k: int):
  """One [block_m, block_n] output tile. x_ref [block_m, K], w_ref [G, rows, block_n], s_ref [G, block_n]."""
  groups, rows = w_ref.shape[0], w_ref.shape[1]
  group = 2 * rows if packed else rows
  dtype = x_ref.dtype

  def dot(x, w):
    return jnp.dot(x, w.astype(dtype), preferred_element_type=jnp.float32)

  def one_group(g, acc):
    start = g * group
    if packed:  # One load of the packed rows, two products against the group's two halves of x.
      low, high = unpack_int4(w_ref[g, :, :])
      part = dot(x_ref[:, pl.ds(start, rows)], low) + dot(x_ref[:, pl.ds(start + rows, rows)], high)
    else:
      def chunk(c, part):
        offset = c * block_k
        return part + dot(x_ref[:, pl.ds(start + offset, block_k)], w_ref[g, pl.ds(offset, block_k), :])
      part = jax.lax.fori_loop(0, rows // block_k, chunk, jnp.zeros(o_ref.shape, jnp.float32))
    return acc + part * s_ref[pl.ds(g, 1), :]

  acc = jax.lax.fori_loop(0, groups, one_group, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _power_of_two_at_most(n: int, limit: int) -> int:
  """The largest power of two <= limit that divides n (1 if n is odd)."""
  block = 1
  while block * 2 <= limit and n % (block * 2) == 0:
    block *= 2
  return block


def supported(k: int, n: int, groups: int, packed: bool) -> bool:
  """Whether the kernel takes a weight of fan-in k, n outputs and `groups` groups: 16-row tiles along n and within
  each group (int4: each half group)."""
  if k % groups:
    return False
  rows = k // groups // (2 if packed else 1)
  return n % 16 == 0 and rows % 16 == 0 and (packed is False or rows & (rows - 1) == 0)


@functools.partial(jax.jit, static_argnames=("packed", "block_m", "block_n", "block_k", "interpret"))
def quant_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, packed: bool, block_m: int = BLOCK_M,
                 block_n: int = BLOCK_N, block_k: int = BLOCK_K, interpret: bool | None = None) -> jax.Array:
  """x [M, K] @ the quantised weight (values int8 [G, rows, N], scale float32 [G, N]) -> [M, N] in x's dtype; see
  the module docstring. `block_n` and `block_k` are upper bounds: the largest powers of two dividing N and the group
  are used. `interpret=None`: Triton on GPU, the interpreter elsewhere."""
  m, k = x.shape
  groups, rows, n = values.shape
  if values.dtype != jnp.int8 or scale.shape != (groups, n):
    raise ValueError(f"quant_matmul: values must be int8 [G, rows, N] and scale [G, N]; got {values.dtype} "
                     f"{values.shape} and {scale.shape}")
  if k != groups * rows * (2 if packed else 1):
    raise ValueError(f"quant_matmul: x has {k} inputs but the weight {groups} groups of {rows} "
                     f"{'packed ' if packed else ''}rows")
  if not supported(k, n, groups, packed):
    raise ValueError(f"quant_matmul: the kernel needs N and the group rows to be multiples of 16 (int4: a power of "
                     f"two), got N {n}, rows {rows}")
  block_n = _power_of_two_at_most(n, block_n)
  block_k = rows if packed else _power_of_two_at_most(rows, block_k)
  padded = -(-m // block_m) * block_m
  xp = jnp.pad(x, ((0, padded - m), (0, 0))) if padded != m else x
  out = backend.call(
      functools.partial(_kernel, packed=packed, block_k=block_k),
      out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
      grid=(padded // block_m, n // block_n),
      in_specs=[pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
                pl.BlockSpec((groups, rows, block_n), lambda i, j: (0, 0, j)),
                pl.BlockSpec((groups, block_n), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      num_warps=NUM_WARPS, interpret=interpret, name="quant_matmul_int4" if packed else "quant_matmul_int8",
  )(xp, values, scale.astype(jnp.float32))
  return out[:m]
