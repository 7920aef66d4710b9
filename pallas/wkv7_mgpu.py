"""WKV-7 chunked forward as a Pallas Mosaic GPU kernel for Hopper (sm_90+): wgmma chunk products, TMA tile loads,
the state kept on chip (registers and shared memory) from the first chunk to the last.

The math is `wkv7_chunked`'s WY form (see that module for the derivation). Per (batch, head) and chunk of L tokens,
with g the chunk's cumulative log-decays, g⁻ = g - w, S_0 the state entering the chunk and every [L, N] tile holding
one token per row:

  Â = a e^{g⁻}, R̂ = r e^{g}, B̌ = b e^{-g}, Ǩ = k e^{-g}                                  (elementwise, bfloat16)
  M_ab = strict(Â B̌^T), M_ak = strict(Â Ǩ^T), P_rb = incl(R̂ B̌^T), P_rk = incl(R̂ Ǩ^T)   [L, L]
  U = (I - M_ab)^{-1} (Â S_0^T + M_ak V)
  Y = R̂ S_0^T + P_rb U + P_rk V
  S_L = (S_0 + U^T B̌ + V^T Ǩ) diag(e^{g_L})

The last line is `wkv7_chunked`'s S_0 diag(e^{g_L}) + U^T B̄ + V^T K̄ with the chunk-end decay taken out of the
products: B̄ and K̄ need no tiles of their own, and the state's accumulator gets the decay once per chunk.

Layout. Grid (B, H, N / BV), one warpgroup (128 threads) per program: a program owns BV = 64 value rows of one
head's state (rows never interact), walks the chunks in order and keeps its [BV, N] float32 block of S in registers
(the wgmma accumulator layout) between chunks, and in g⁻'s shared-memory tile during a chunk's products. Each
chunk's r, k, a, b, g, g⁻ tiles [L, N] and v tile [L, BV] come in by TMA; the decayed tiles overwrite r, a, b, k
in shared memory as bfloat16 wgmma operands. Every product is a wgmma with M = 64 rows (Hopper's instruction
height, hence L = 64 and BV = 64): the [L, L] pair matrices and the [L, BV] value tiles accumulate in float32, and
the [L, L] ones are stored to shared memory as bfloat16 to enter later products from there (every wgmma operand is
a shared-memory tile: Mosaic GPU interpret mode takes no register operand, and one kernel serves both). The inverse
of the unit lower-triangular I - M_ab is the finite series (I + M)(I + M^2)(I + M^4)(I + M^8)(I + M^16)(I + M^32),
exact since M^64 = 0, on bfloat16 operands with float32 accumulation. y leaves by TMA from shared memory.

Operands. Every product takes bfloat16 operands (the decayed keys, the state, U, the pair matrices), float32 inputs
included: Hopper's float32 wgmma (TF32) needs both operands K-major, which the V, U and U^T products are not. The
chunk's cumulative log-decays g and g⁻ are float32 inputs, computed by XLA beside the kernel (`chunk_log_decays`).

Range. As in `wkv7_chunked`, factoring e^{g_t - g_s} = e^{g_t} e^{-g_s} needs every factor finite: exact while
w >= min_log_decay() = -LOG_RANGE / 64 = -0.9375 (RWKV-7's layers keep w >= -0.61); `in_range` checks it.

Registers. One warpgroup holds every float32 [64, 64] tile in 32 registers a thread (the [64, N] state in N / 2),
within ptxas' 255. Two choices keep the chunk loop from spilling: (1) every shared-memory tile is the single slot of
a [1, ...] buffer, indexed in the loop body by a zero the compiler cannot see through (`one_chunk`), so that LLVM
does not hoist the tiles' element addresses out of the loop and hold them in registers across it (in the PTX at
N = 128, 168 64-bit values defined before the loop are used in it without the slot, 20 with it); (2) once Â is
made, the float32 state waits in g⁻'s tile through the chunk's products instead of in registers. The decays are
applied in [64, 64] column pieces, reading g from shared memory at each use (3 to 4 registers fewer at N = 128).

Compiled for an H100 without one (sm_90a; `benchmarks/gpu_aot.py --mgpu` reads ptxas' report and the launch from
Mosaic GPU's dump): dynamic shared memory 141,376 B at N = 64 (bfloat16), 215,104 B at N = 128 (bfloat16) and
223,296 B at N = 128 (float32 y); 185, 215 and 219 registers a thread, no spills. The loads of a chunk are not
overlapped with the products of the previous one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ltm_pallas import backend
from ltm_pallas import wkv7_chunked

CHUNK = 64  # Tokens per chunk L: the wgmma instruction height.
BLOCK = 64  # Value rows per program BV.
SIZES = (64, 128)  # Head sizes N the kernel takes (shared memory bounds N = 256).
OPERANDS = jnp.bfloat16


def min_log_decay() -> float:
  """The most negative w the kernel takes (chunks of 64)."""
  return wkv7_chunked.min_log_decay(CHUNK)


def in_range(w: jax.Array) -> jax.Array:
  """Whether every log-decay of w is in the kernel's range (a scalar bool array)."""
  return wkv7_chunked.in_range(w, CHUNK)


def supported(size: int) -> bool:
  """Whether the kernel takes head size `size`."""
  return size in SIZES


def chunk_log_decays(w: jax.Array, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
  """(g, g⁻) float32 [B, T, H, N] from w [B, T, H, N], T a multiple of `chunk`: g the cumulative sum of w from each
  chunk's start (inclusive), g⁻ the same through the token before (g shifted by one token, 0 first: exactly the
  previous token's g, where g - w would round)."""
  batch, length, heads, size = w.shape
  g = jnp.cumsum(w.astype(jnp.float32).reshape(batch, length // chunk, chunk, heads, size), axis=2)
  g_before = jnp.pad(g[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0), (0, 0)))
  return g.reshape(batch, length, heads, size), g_before.reshape(batch, length, heads, size)


def _smem(shape, dtype):
  """A shared-memory tile [1, *shape] (one slot, see `one_chunk`) in the layout wgmma and TMA use: (8, 128-byte)
  tiles, 128-byte swizzle."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
  return plgpu.SMEM((1, *shape), dtype, transforms=(tiling, plgpu.SwizzleTransform(128)))


def _kernel(r_ref, k_ref, a_ref, b_ref, v_ref, g_ref, gp_ref, s0_ref, y_ref, s_ref,
            r_s, k_s, a_s, b_s, g_s, gp_s, v_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s, barriers, *,
            num_chunks):
  """One program: BV value rows of one (batch, head)'s state through every chunk."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  wgmma_layout = plgpu.Layout.WGMMA
  batch, head, block = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
  size = r_s.shape[-1]
  values = pl.ds(block * BLOCK, BLOCK)

  def load(ref):
    return plgpu.load(ref, layout=wgmma_layout).astype(jnp.float32)

  def product(shape, *terms):
    """The sum of x @ y over `terms` [shape] (wgmma, float32 accumulation)."""
    def run(acc):
      for x, y in terms:
        plgpu.wgmma(acc, x, y)
      return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

  rows_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout)
  cols_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
  strict, incl = rows_iota > cols_iota, rows_iota >= cols_iota

  # The state block enters through g's tile (both [64, N] float32).
  plgpu.copy_gmem_to_smem(s0_ref.at[batch, head, values], g_s.at[0], barriers.at[7])
  plgpu.barrier_wait(barriers.at[7])
  state = plgpu.load(g_s.at[0], layout=wgmma_layout)

  tiles = (r_s, k_s, a_s, b_s, g_s, gp_s, v_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s)

  def one_chunk(c, state):
    # Each tile is the only slot of a [1, ...] buffer, taken at an index that is 0 but opaque to the compiler: the
    # tiles' addresses then stay in the loop body instead of being hoisted out of it and held in registers across it.
    slot = lax.optimization_barrier(c) - c
    r_s, k_s, a_s, b_s, g_s, gp_s, v_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s = (
        tile.at[slot] for tile in tiles)
    tokens = pl.ds(c * CHUNK, CHUNK)
    sources = (r_ref, k_ref, a_ref, b_ref, g_ref, gp_ref)
    for i, (src, dst) in enumerate(zip(sources, (r_s, k_s, a_s, b_s, g_s, gp_s))):
      plgpu.copy_gmem_to_smem(src.at[batch, tokens, head], dst, barriers.at[i])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, tokens, head, values], v_s, barriers.at[6])
    for i in range(7):
      plgpu.barrier_wait(barriers.at[i])

    for start in range(0, size, BLOCK):  # [64, 64] pieces: fewer float32 values live beside the state.
      cols = (slice(None), pl.ds(start, BLOCK))
      a_s[cols] = (load(a_s.at[cols]) * jnp.exp(load(gp_s.at[cols]))).astype(OPERANDS)
      r_s[cols] = (load(r_s.at[cols]) * jnp.exp(load(g_s.at[cols]))).astype(OPERANDS)
      b_s[cols] = (load(b_s.at[cols]) * jnp.exp(-load(g_s.at[cols]))).astype(OPERANDS)
      k_s[cols] = (load(k_s.at[cols]) * jnp.exp(-load(g_s.at[cols]))).astype(OPERANDS)
    state_s[...] = state.astype(OPERANDS)
    gp_s[...] = state  # g⁻ is spent: the state waits there in float32 through the chunk's products.
    plgpu.commit_smem()

    pairs = (CHUNK, CHUNK)
    m_ab = jnp.where(strict, product(pairs, (a_s, b_s.T)), 0.0)
    m_ak_s[...] = jnp.where(strict, product(pairs, (a_s, k_s.T)), 0.0).astype(OPERANDS)
    p_rb_s[...] = jnp.where(incl, product(pairs, (r_s, b_s.T)), 0.0).astype(OPERANDS)
    p_rk_s[...] = jnp.where(incl, product(pairs, (r_s, k_s.T)), 0.0).astype(OPERANDS)

    # (I - M_ab)^{-1} = (I + M)(I + M^2)(I + M^4)...: each round squares the power and multiplies it in.
    solve = jnp.where(rows_iota == cols_iota, 1.0, m_ab)
    power, span = m_ab, 2
    while span < CHUNK:
      power_s[...] = power.astype(OPERANDS)
      solve_s[...] = power.astype(OPERANDS)  # A wgmma's operands must be two buffers.
      plgpu.commit_smem()
      power = product(pairs, (solve_s, power_s))
      power_s[...] = power.astype(OPERANDS)
      solve_s[...] = solve.astype(OPERANDS)
      plgpu.commit_smem()
      solve = solve + product(pairs, (solve_s, power_s))
      span *= 2
    solve_s[...] = solve.astype(OPERANDS)
    plgpu.commit_smem()

    block_shape = (CHUNK, BLOCK)
    x_s[...] = product(block_shape, (a_s, state_s.T), (m_ak_s, v_s)).astype(OPERANDS)
    plgpu.commit_smem()
    u = product(block_shape, (solve_s, x_s))
    x_s[...] = u.astype(OPERANDS)
    plgpu.commit_smem()
    y = product(block_shape, (r_s, state_s.T), (p_rb_s, x_s), (p_rk_s, v_s))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous chunk's y has left y_s.
    y_s[...] = y.astype(y_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_s, y_ref.at[batch, tokens, head, values])

    state = plgpu.load(gp_s, layout=wgmma_layout) + product((BLOCK, size), (x_s.T, b_s), (v_s.T, k_s))
    decay_total = jnp.exp(jnp.min(load(g_s), axis=0))  # e^{g_L}: g falls along the chunk (w <= 0).
    return state * lax.broadcast_in_dim(decay_total, state.shape, [1])

  state = lax.fori_loop(0, num_chunks, one_chunk, state)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  g_s[0] = state
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(g_s.at[0], s_ref.at[batch, head, values])
  plgpu.wait_smem_to_gmem(0)


def _build(shape: tuple[int, int, int, int], y_dtype: str, interpreted: bool):
  """The kernel for inputs [B, T, H, N] (T a multiple of CHUNK), y in `y_dtype`: interpreted on the CPU (Mosaic GPU
  interpret mode) or compiled."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  batch, length, heads, size = shape
  scratch = [_smem((CHUNK, size), OPERANDS) for _ in range(4)]  # r, k, a, b; then R̂, Ǩ, Â, B̌.
  scratch += [_smem((CHUNK, size), jnp.float32) for _ in range(2)]  # g, g⁻.
  scratch += [_smem((CHUNK, BLOCK), OPERANDS), _smem((BLOCK, size), OPERANDS), _smem((CHUNK, BLOCK), OPERANDS)]  # v, S_0, X then U.
  scratch += [_smem((CHUNK, CHUNK), OPERANDS) for _ in range(5)]  # M_ak, P_rb, P_rk, M^(2^i), the inverse.
  scratch.append(_smem((CHUNK, BLOCK), y_dtype))
  scratch.append(plgpu.Barrier(num_barriers=8))
  params = dict(interpret=plgpu.InterpretGPUParams()) if interpreted else dict(
      compiler_params=plgpu.CompilerParams())
  return plgpu.kernel(
      functools.partial(_kernel, num_chunks=length // CHUNK),
      out_type=(jax.ShapeDtypeStruct(shape, y_dtype), jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32)),
      scratch_types=scratch,
      grid=(batch, heads, size // BLOCK),
      grid_names=("batch", "head", "block"),
      **params)


def forward(r, w, k, v, a, b, state, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """WKV-7 forward: (y [B, T, H, N] in v's dtype, the final state [B, H, N, N] float32).

  r, w, k, v, a, b: [B, T, H, N], any float dtype and any T (padded to a multiple of CHUNK with identity tokens), N
  in SIZES, w >= min_log_decay() (`in_range`; stronger decays overflow the factored form). state: [B, H, N, N]
  float32. interpret: Mosaic GPU interpret mode (None: interpret unless compiling for a GPU). No derivative: the op
  backend (`ltm_jax.ops.wkv7.pallas_mgpu`) supplies one.
  """
  batch, length, heads, size = r.shape
  if not supported(size):
    raise ValueError(f"wkv7_mgpu: head size {size} not supported; sizes {SIZES}")
  r, w, k, v, a, b = wkv7_chunked.pad_tokens(CHUNK, r, w, k, v, a, b)
  g, g_exclusive = chunk_log_decays(w)
  operands = [x.astype(OPERANDS) for x in (r, k, a, b, v)]
  y_dtype = jnp.dtype(v.dtype).name
  run = backend.mosaic_gpu_call(functools.partial(_build, r.shape, y_dtype), interpret)
  y, final = run(*operands, g, g_exclusive, state.astype(jnp.float32))
  return y[:, :length], final
