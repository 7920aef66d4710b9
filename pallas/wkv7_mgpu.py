"""WKV-7 chunked forward and backward as Pallas Mosaic GPU kernels for Hopper (sm_90+): wgmma chunk products, TMA
tile loads, the state (forward) or its gradient (backward) kept on chip from the first chunk to the last.

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
head's state (rows never interact), walks the chunks in order and keeps its [BV, N] float32 block of S in a
shared-memory tile from chunk to chunk. Each chunk's r, k, a, b, w tiles [L, N] and v tile [L, BV] come in by
TMA; the decayed tiles overwrite r, a, b, k in shared memory as bfloat16 wgmma operands. Every product is a wgmma
with M = 64 rows (Hopper's instruction height, hence L = 64 and BV = 64): the [L, L] pair matrices and the [L, BV]
value tiles accumulate in float32, and the [L, L] matrices are stored to shared memory as bfloat16 to enter later products from there (every wgmma operand is
a shared-memory tile: Mosaic GPU interpret mode takes no register operand, and one kernel serves both). The inverse
of the unit lower-triangular I - M_ab is the finite series (I + M)(I + M^2)(I + M^4)(I + M^8)(I + M^16)(I + M^32),
exact since M^64 = 0, on bfloat16 operands with float32 accumulation. y leaves by TMA from shared memory.

Overlapped loads (`pipelined`, default `pipelines(N)`). Where two slots of every input tile fit Hopper's shared
memory (N = 64), each input tile has two, each with its own TMA barriers: before chunk c's products the program
starts chunk c + 1's loads (chunk c - 1's in the backward) into the other slot, whose last reader was chunk c - 1, so
those loads run during chunk c's products and chunk c + 1 waits only for what is left of them. At N = 128 a second
slot of the inputs would take 104 KiB (forward) or 96 KiB (backward) beyond the 219,193 B and 229,449 B the kernels
take of Hopper's 232,448, so there each chunk's loads come before its products (one slot; `pipelined=False` at N =
64 too). Both forms run the same products on the same operands.

Operands. Every product takes bfloat16 operands (the decayed keys, the state, U, the pair matrices), float32 inputs
included: Hopper's float32 wgmma (TF32) needs both operands K-major, which the V, U and U^T products are not.

Log-decays. The forward takes w in float32 and sums it along each chunk itself (`_log_decays`): Mosaic GPU has no
cumulative sum, so g = incl(1) w is a product, [L, L] ones times w split into three bfloat16 parts (8 significant
bits each, float32's 24), the exact products summed in float32: in interpret mode 1.4e-6 at most from the float64
running sum at |g| <= 60 (a fifth of a float32 ulp of 60); a tensor core's float32 accumulation may round differently, a few ulps
at most, far below the operands' bfloat16 rounding, and the backward reads the forward's g, so the two agree. g⁻ =
g - w, float32. Three products per [L, 64] column piece of g, against XLA's cumulative sum and two float32 tiles
in, written and read back, beside the kernel. e^{g_L} is taken as e^{min_t g_t} (g falls along the chunk): where
rounding left g_{L-1} a few ulps above g_{L-2} (w_{L-1} that small), the minimum is the row before, a relative
difference of that size in the state's decay.

Range. As in `wkv7_chunked`, factoring e^{g_t - g_s} = e^{g_t} e^{-g_s} needs every factor finite: exact while
w >= min_log_decay() = -LOG_RANGE / 64 = -0.9375 (RWKV-7's layers keep w >= -0.61); `in_range` checks it.

Registers. One warpgroup holds every float32 [64, 64] tile in 32 registers a thread (the [64, N] state in N / 2),
within ptxas' 255. Two choices keep the chunk loop from spilling: (1) every working tile is the single slot of a
[1, ...] buffer, indexed in the loop body by a zero the compiler cannot see through (`one_chunk`; the input tiles at
that zero plus the chunk's slot), so that LLVM
does not hoist the tiles' element addresses out of the loop and hold them in registers across it (in the PTX at
N = 128, 168 64-bit values defined before the loop are used in it without the slot, 20 with it); (2) the float32
state is held in a shared-memory tile from chunk to chunk, not in registers. The decays are made and applied in
[64, 64] column pieces, reading g from shared memory at each use but Â's; the matrix of ones is made in the loop
from the opaque zero (as a loop invariant it was held in registers across the loop).

Residuals. With `checkpoints`, the forward also writes what the backward reads (`Residuals`), each by TMA from
the shared-memory tile its own products read: the state entering each chunk, [B, H, T / L, N, N] in bfloat16 from
the S_0 operand tile, and (from the programs of value block 0) the decayed operands R̂, Ǩ, Â, B̌ [B, T, H, N] in
bfloat16 and g in float32. bfloat16 states because the backward reads S_0 only as a product operand (and in one
column sum, below), and the forward's products read it in bfloat16 too: the backward recomputes U from exactly the
forward's operands, at half the bytes of float32 (1 GiB at B 8, T 4096, C 4096, N 128).

Backward (`backward`). Chunks in reverse, same grid and warpgroup; a program carries its [BV, N] float32 block of dS
(the gradient of the state leaving the chunk) in a shared-memory tile. Its inputs per chunk, by TMA: the decayed
tiles R̂, Ǩ, Â, B̌ [L, N] in bfloat16 (the forward's own, from its residuals: w and g as float32 tiles in the
kernel would take another 64 KiB at N = 128, beyond Hopper's 227 KiB), v and dy [L, BV], the chunk's S_0 block
[BV, N] and e^{g_L} [N] (from the forward's g). With dS̄ = dS diag(e^{g_L}) (the only form in which the
chunk uses dS), the adjoint of the equations above is

  U as in the forward; dU = P_rb^T dY + B̌ dS̄^T; dX = (I - M_ab)^{-T} dU
  dV = P_rk^T dY + M_ak^T dX + Ǩ dS̄^T;  dS_0 = dY^T R̂ + dX^T Â + dS̄  (carried to the chunk before)
  dP_rb = incl(dY U^T), dP_rk = incl(dY V^T), dM_ab = strict(dX U^T), dM_ak = strict(dX V^T)
  dR̂ = dY S_0 + dP_rb B̌ + dP_rk Ǩ,  dÂ = dX S_0 + dM_ab B̌ + dM_ak Ǩ
  dB̌ = dP_rb^T R̂ + dM_ab^T Â + U dS̄,  dǨ = dP_rk^T R̂ + dM_ak^T Â + V dS̄
  dg_L = Σ_i dS̄_i ⊙ S_0,i + column sums of (U dS̄) ⊙ B̌ + (V dS̄) ⊙ Ǩ   (the gradient of g_L, a row [N])

dV is local to the program's value rows and leaves whole. The key-side gradients dR̂, dÂ, dB̌, dǨ [L, N] and the
row dg_L sum over all value rows: each program writes its block's share, float32, to its own slice of outputs
[N / BV, B, T, H, N] (and [N / BV, B, H, T / L, N]), and XLA beside the kernel adds the N / BV shares (no atomics),
multiplies by the decay factors (dr = dR̂ e^{g}, da = dÂ e^{g⁻}, db = dB̌ e^{-g}, dk = dǨ e^{-g}) and takes the
log-decays' gradient: g_t gets dr r - db b - dk k, g⁻_t gets da a and g_L the row; w_s enters g_t for t >= s,
g⁻_t for t > s and g_L, so dw is a reverse cumulative sum within each chunk. The key-side products run in [L, 64]
column pieces, each leaving by TMA through one float32 tile. Every product has bfloat16 operands as in the forward,
dU and dX and the [L, L] gradients included.

Compiled for an H100 without one (sm_90a; `benchmarks/gpu_aot.py --mgpu` reads ptxas' report and the launch from
Mosaic GPU's dump; benchmarks/results/gpu-aot-h100-wkv7-mgpu.json; shared memory is the launch's, REDUCTION_SCRATCH
included). Forward, loads before products: 145,465 B at N = 64 (bfloat16), 219,193 B at N = 128 (bfloat16) and
227,385 B at N = 128 (float32 y); 206, 236 and 244 registers a thread (238 at N = 128 bfloat16 with residuals), no
spills. Forward, loads overlapped (N = 64): 202,857 B (bfloat16 y) or 211,049 B (float32 y), 211 / 209 registers
(200 with residuals), no spills. Backward, loads before products: 163,913 B and 239 registers at N = 64, 229,449 B
and 243 (bfloat16) or 244 (float32 dv) registers at N = 128; loads overlapped (N = 64): 221,321 B and 236 (bfloat16)
or 240 (float32 dv) registers; no spills. A chunk waits at 104 warpgroup barriers in the forward (112 at N = 128)
and 132 in the backward, 34 and 52 with `explicit_barriers` (`_launch`; 242 / 243 registers in that backward). The
forward holds its float32 state in shared memory between chunks and reads g from there for all but Â: with the
state or g in registers through the cumulative sums' products it spilled (255 registers, 16 to 272 B) at N = 128
float32. The barriers of the
overlapped loads are indexed by the chunk's slot number without the opaque zero (the other form's by constants):
indexed at the tiles' opaque slot, the backward took 247 registers instead of 239 at N = 128 and 245 instead of 236
overlapped (float32 dv), with Pallas' default reduction scratch. What keeps the backward from
spilling (docs/kernels.md has each step's registers): the tiles indexed at an opaque zero as in the forward, in the
chunk loop and again in the loop over the key-side pieces; the [L, L] masks made inside the chunk loop; the [L, 64]
pieces as loops rather than unrolled; g_L's column sums one product at a time. The backward's key-side pieces
leave one at a time through their one tile. Nothing here has run on a GPU: whether the overlap pays is not measured.

State-only kernels (`end_states`, `state_gradients`), the extra passes of the segmented form (`wkv7_segmented`):
same grid, warpgroup and chunks, each chunk's loads before its products, and only the tiles the state or its
gradient needs. `end_states` walks the chunks keeping U and the state (a float32 [BV, N] block in shared memory, its
bfloat16 copy the operand): g, Â, B̌, Ǩ made in the kernel from w as in the forward, M_ab and M_ak, the
inverse, X and U, then S_L = (S_0 + U^T B̌ + V^T Ǩ) diag(e^{g_L}) in [BV, 64] column pieces; no R̂, P matrices or
y. Without values (k, v None) it skips k, v, Ǩ, M_ak and their products: from the identity, the transition A with
S_end = S_start A. `state_gradients` walks the chunks in reverse carrying dS: the backward's value side alone on
the forward's residuals R̂, Â, B̌ and e^{g_L} and on dy (M_ab, P_rb, the inverse, dU, dX, dS_0), no S_0, v or k. The
tile code shared with the forward and backward (the log-decays, the decays, the series inverse, dS̄, dU and dX,
dS_0) is in the module's helpers. No Mosaic GPU kernel here needs XLA to sum w (the backward and the state
gradients take e^{g}-factors and e^{g_L} from the forward's g).
Compiled (sm_90a, B 8, T 4096, C 4096, bfloat16): end states 192 / 198 registers and 120,881 / 186,417 B at N = 64 /
128, transitions 192 / 198 and 96,289 / 153,633 B, state gradients 149 / 174 and 91,185 / 140,337 B; no spills.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

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
REDUCTION_SCRATCH = 6 * 1024  # Shared-memory bytes for cross-warp reductions (`_launch`).


def min_log_decay() -> float:
  """The most negative w the kernel takes (chunks of 64)."""
  return wkv7_chunked.min_log_decay(CHUNK)


def in_range(w: jax.Array) -> jax.Array:
  """Whether every log-decay of w is in the kernel's range (a scalar bool array)."""
  return wkv7_chunked.in_range(w, CHUNK)


def bounded(w_min: float | None) -> bool:
  """Whether a caller's static bound w >= w_min (None: no bound) keeps w in the kernel's range."""
  return wkv7_chunked.bounded(w_min, CHUNK)


def supported(size: int) -> bool:
  """Whether the kernel takes head size `size`."""
  return size in SIZES


def _smem(shape, dtype, slots: int = 1):
  """A shared-memory buffer [slots, *shape] in the layout wgmma and TMA use: (8, 128-byte) tiles, 128-byte swizzle.
  One slot for a working tile (see `one_chunk`), two for a double-buffered input (`pipelines`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  tiling = plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize))
  return plgpu.SMEM((slots, *shape), dtype, transforms=(tiling, plgpu.SwizzleTransform(128)))


def _tile_bytes(shapes_dtypes) -> int:
  return sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in shapes_dtypes)


def _forward_tiles(size: int, y_dtype, slots: int) -> tuple[list, list]:
  """(inputs, working tiles) of the forward as (shape, dtype) pairs; each input [slots, ...]: r, k, a, b (then R̂,
  Ǩ, Â, B̌), w (then g), v; working tiles: the float32 state, S_0, X then U, M_ak, P_rb, P_rk, M^(2^i), the
  inverse, y."""
  inputs = [((slots, CHUNK, size), OPERANDS)] * 4 + [((slots, CHUNK, size), jnp.float32)]
  inputs.append(((slots, CHUNK, BLOCK), OPERANDS))
  work = [((1, CHUNK, size), jnp.float32), ((1, BLOCK, size), OPERANDS), ((1, CHUNK, BLOCK), OPERANDS)]
  work += [((1, CHUNK, CHUNK), OPERANDS)] * 5 + [((1, CHUNK, BLOCK), y_dtype)]
  return inputs, work


def _backward_tiles(size: int, slots: int) -> tuple[list, list]:
  """(inputs, working tiles) of the backward as (shape, dtype) pairs; each input [slots, ...]: R̂, Ǩ, Â, B̌, v, dy,
  S_0, e^{g_L}; working tiles: dS̄, dS, M_ak, P_rb, P_rk, M^(2^i), the inverse, X, U, the key-side pieces' float32
  tile, the log-decay row (dv leaves through M^(2^i)'s tile or the float32 one)."""
  inputs = [((slots, CHUNK, size), OPERANDS)] * 4 + [((slots, CHUNK, BLOCK), OPERANDS)] * 2
  inputs += [((slots, BLOCK, size), OPERANDS), ((slots, size), jnp.float32)]
  work = [((1, BLOCK, size), OPERANDS), ((1, BLOCK, size), jnp.float32)] + [((1, CHUNK, CHUNK), OPERANDS)] * 5
  work += [((1, CHUNK, BLOCK), OPERANDS)] * 2 + [((1, CHUNK, BLOCK), jnp.float32), ((1, size), jnp.float32)]
  return inputs, work


# Shared memory a block may take on Hopper (227 KiB), less a margin for what the launch takes beyond the tiles
# themselves (their alignment, the barriers, Mosaic GPU's own scratch, REDUCTION_SCRATCH among it; measured at N = 64
# with Pallas' default 2 KiB of it: 2,112 to 2,168 B in the forward, 3,464 to 3,656 B in the backward).
SMEM_BUDGET = 232448 - 8192


def pipelines(size: int, backward: bool = False, y_dtype="float32") -> bool:
  """Whether the forward (or with `backward` the backward) overlaps each chunk's loads with the previous chunk's
  products by default at head size `size`: where two slots of every input tile fit Hopper's shared memory (N = 64,
  not N = 128). `y_dtype`: the forward's y (a float32 y tile takes 8 KiB more than a bfloat16 one)."""
  inputs, work = _backward_tiles(size, 2) if backward else _forward_tiles(size, y_dtype, 2)
  return _tile_bytes(inputs + work) <= SMEM_BUDGET


def _load(ref):
  """A shared-memory tile in the wgmma accumulator layout, as float32."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)


def _product(shape, *terms):
  """The sum of x @ y over `terms` [shape] (wgmma, float32 accumulation)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  def run(acc):
    for x, y in terms:
      plgpu.wgmma(acc, x, y)
    return acc[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _no_sync() -> None:
  """Where Pallas' own barriers guard every shared-memory store (`explicit_barriers=False`), a kernel needs none."""


def _inverse(m_ab, diagonal, power_s, solve_s, sync=_no_sync):
  """(I - M_ab)^{-1} = (I + M)(I + M^2)(I + M^4)...(I + M^32) [L, L] into solve_s as a bfloat16 operand: each round
  squares the power and multiplies it in. m_ab: the strictly lower [L, L] float32 M_ab; diagonal: the [L, L] mask
  of the diagonal; power_s, solve_s: [L, L] bfloat16 tiles (a wgmma's operands must be two buffers); sync: the
  warpgroup barrier between a product and the stores over its operands (`_launch`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  pairs = (CHUNK, CHUNK)
  solve = jnp.where(diagonal, 1.0, m_ab)
  power, span = m_ab, 2
  while span < CHUNK:
    power_s[...] = power.astype(OPERANDS)
    solve_s[...] = power.astype(OPERANDS)
    plgpu.commit_smem()
    power = _product(pairs, (solve_s, power_s))
    sync()
    power_s[...] = power.astype(OPERANDS)
    solve_s[...] = solve.astype(OPERANDS)
    plgpu.commit_smem()
    solve = solve + _product(pairs, (solve_s, power_s))
    sync()
    span *= 2
  solve_s[...] = solve.astype(OPERANDS)
  plgpu.commit_smem()


def _decay(size, g_s, b_s, r_s=None, k_s=None):
  """R̂ = r e^{g}, B̌ = b e^{-g}, Ǩ = k e^{-g} in place as bfloat16 operands (r, k: where given; Â is made with g in
  `_log_decays`), in [64, 64] column pieces (fewer float32 values live at once), reading g from shared memory at
  each use."""
  for start in range(0, size, BLOCK):
    cols = (slice(None), pl.ds(start, BLOCK))
    if r_s is not None:
      r_s[cols] = (_load(r_s.at[cols]) * jnp.exp(_load(g_s.at[cols]))).astype(OPERANDS)
    b_s[cols] = (_load(b_s.at[cols]) * jnp.exp(-_load(g_s.at[cols]))).astype(OPERANDS)
    if k_s is not None:
      k_s[cols] = (_load(k_s.at[cols]) * jnp.exp(-_load(g_s.at[cols]))).astype(OPERANDS)


def _split(x):
  """float32 x as three bfloat16 parts whose float32 sum is x (8 significant bits each: float32's 24)."""
  high = x.astype(OPERANDS)
  rest = x - high.astype(jnp.float32)
  middle = rest.astype(OPERANDS)
  return high, middle, (rest - middle.astype(jnp.float32)).astype(OPERANDS)


def _log_decays(size, w_s, inclusive_s, parts, a_s, sync=_no_sync):
  """The chunk's cumulative log-decays g [L, N] (g_t the sum of w for s <= t) in place of w in w_s, float32, and
  Â = a e^{g⁻} in place of a (a bfloat16 operand), with g⁻ = g - w (`_decay` makes the other operands). In [L, 64]
  column pieces: each piece of w is split into three bfloat16 parts (`_split`) that enter one product with the
  inclusive lower-triangular matrix of ones `inclusive_s` [L, L] bfloat16: exact products summed in float32, as a
  float32 running sum (Mosaic GPU has no cumulative sum). parts: three [L, 64] bfloat16 tiles."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top

  def piece(j, carry):
    cols = (slice(None), pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK))
    for part_s, part in zip(parts, _split(_load(w_s.at[cols]))):
      part_s[...] = part
    plgpu.commit_smem()
    g = _product((CHUNK, BLOCK), *((inclusive_s, part_s) for part_s in parts))
    sync()  # Every warp's share of the product has read the parts (overwritten next).
    a_s[cols] = (_load(a_s.at[cols]) * jnp.exp(g - _load(w_s.at[cols]))).astype(OPERANDS)
    w_s[cols] = g
    return carry

  lax.fori_loop(0, size // BLOCK, piece, 0)


def _scale_gradient(ds_s, dsb_s, decay_s, size, s0_s=None, row_s=None):
  """dS̄ = dS diag(e^{g_L}) in place in ds_s (float32) and as the bfloat16 operand dsb_s, in [BV, 64] column pieces;
  with s0_s and row_s, row_s starts the log-decays' chunk sum with the column sums of dS̄ ⊙ S_0."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  row_layout = plgpu.Layout.WGMMA.reduce(0)
  piece = (BLOCK, BLOCK)

  def scale_piece(j, carry):
    start = pl.multiple_of(j * BLOCK, BLOCK)
    cols = (slice(None), pl.ds(start, BLOCK))
    decay = plgpu.load(decay_s.at[pl.ds(start, BLOCK)], layout=row_layout)
    ds = _load(ds_s.at[cols]) * lax.broadcast_in_dim(decay, piece, [1])
    ds_s[cols] = ds
    dsb_s[cols] = ds.astype(OPERANDS)
    if row_s is not None:
      row_s[pl.ds(start, BLOCK)] = jnp.sum(ds * _load(s0_s.at[cols]), axis=0)
    return carry

  lax.fori_loop(0, size // BLOCK, scale_piece, 0)
  plgpu.commit_smem()


def _value_adjoint(p_rb_s, dy_s, bc_s, dsb_s, solve_s, x_s, sync=_no_sync):
  """dU = P_rb^T dY + B̌ dS̄^T, then dX = (I - M_ab)^{-T} dU, both into x_s [L, BV] as bfloat16."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  block_shape = (CHUNK, BLOCK)
  x_s[...] = _product(block_shape, (p_rb_s.T, dy_s), (bc_s, dsb_s.T)).astype(OPERANDS)
  plgpu.commit_smem()
  dx = _product(block_shape, (solve_s.T, x_s)).astype(OPERANDS)
  sync()  # Every warp's share of the product has read dU.
  x_s[...] = dx
  plgpu.commit_smem()


def _state_gradient(ds_s, dy_s, rh_s, x_s, ah_s, size):
  """dS_0 = dY^T R̂ + dX^T Â + dS̄ in place in ds_s (holding dS̄), in [BV, 64] column pieces."""
  def state_piece(j, carry):
    cols = (slice(None), pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK))
    ds_s[cols] = _load(ds_s.at[cols]) + _product((BLOCK, BLOCK), (dy_s.T, rh_s.at[cols]), (x_s.T, ah_s.at[cols]))
    return carry

  lax.fori_loop(0, size // BLOCK, state_piece, 0)


def _kernel(r_ref, k_ref, a_ref, b_ref, v_ref, w_ref, s0_ref, y_ref, s_ref, *refs, num_chunks, residuals, slots,
            sync=_no_sync):
  """One program: BV value rows of one (batch, head)'s state through every chunk; with `residuals`, the first six of
  `refs` are the backward's residual outputs (`Residuals`: the bfloat16 state entering each chunk, R̂, Ǩ, Â, B̌ and
  g, the last five from the programs of value block 0). The input tiles have `slots` slots: with two, chunk c + 1's
  loads go to one while chunk c's products read the other."""
  out_refs, refs = (refs[:6], refs[6:]) if residuals else (None, refs)
  r_s, k_s, a_s, b_s, w_s, v_s, held_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s, barriers = refs
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  wgmma_layout = plgpu.Layout.WGMMA
  batch, head, block = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
  size = r_s.shape[-1]
  values = pl.ds(block * BLOCK, BLOCK)

  load, product = _load, _product

  rows_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout)
  cols_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
  strict, incl = rows_iota > cols_iota, rows_iota >= cols_iota

  inputs = (r_s, k_s, a_s, b_s, w_s, v_s)
  work = (held_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s)
  entry = len(inputs) * slots  # The barrier of the state's entry; barriers [6 s, 6 s + 6) track slot s's loads.

  def fetch(c, slot, parity):
    """Starts chunk c's loads into input slot `slot`, which is `parity` (a Python int where known) plus an opaque
    zero, tracked by that slot's barriers."""
    tokens = pl.ds(c * CHUNK, CHUNK)
    sources = (r_ref, k_ref, a_ref, b_ref, w_ref)
    for i, (src, dst) in enumerate(zip(sources, inputs)):
      plgpu.copy_gmem_to_smem(src.at[batch, tokens, head], dst.at[slot], barriers.at[parity * len(inputs) + i])
    plgpu.copy_gmem_to_smem(v_ref.at[batch, tokens, head, values], v_s.at[slot],
                            barriers.at[parity * len(inputs) + 5])

  if slots == 2:
    fetch(0, 0, 0)
  # The float32 state block is held in shared memory from chunk to chunk (not in registers: a chunk's products and
  # cumulative sums need them).
  plgpu.copy_gmem_to_smem(s0_ref.at[batch, head, values], held_s.at[0], barriers.at[entry])
  plgpu.barrier_wait(barriers.at[entry])

  def one_chunk(c, carry):
    # Each working tile is the only slot of a [1, ...] buffer, taken at an index that is 0 but opaque to the
    # compiler: the tiles' addresses then stay in the loop body instead of being hoisted out of it and held in
    # registers across it. The input tiles are taken at the same zero plus the chunk's slot.
    slot = lax.optimization_barrier(c) - c
    parity = lax.rem(c, slots) if slots > 1 else 0
    here = slot + parity if slots > 1 else slot
    r_s, k_s, a_s, b_s, w_s, v_s = (tile.at[here] for tile in inputs)
    held_s, state_s, x_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, y_s = (tile.at[slot] for tile in work)
    tokens = pl.ds(c * CHUNK, CHUNK)
    plgpu.commit_smem()  # Every thread is done with the input slot loaded next (the previous chunk's).
    if slots == 1:
      fetch(c, here, 0)
    else:
      @pl.when(c + 1 < num_chunks)
      def _():
        fetch(c + 1, slot + 1 - parity, 1 - parity)
    # The cumulative sums' ones until P_rb is made, from the opaque zero (not a constant held across the loop).
    p_rb_s[...] = jnp.where(rows_iota + slot >= cols_iota, 1.0, 0.0).astype(OPERANDS)
    state_s[...] = load(held_s).astype(OPERANDS)
    for i in range(len(inputs)):
      plgpu.barrier_wait(barriers.at[parity * len(inputs) + i])

    _log_decays(size, w_s, p_rb_s, (m_ak_s, power_s, solve_s), a_s, sync)
    g_s = w_s  # w is spent: its tile holds g.
    _decay(size, g_s, b_s, r_s, k_s)
    plgpu.commit_smem()
    if out_refs is not None:  # The backward's residuals: the operands themselves (read before they are next written).
      ckpt_ref, decayed_refs, g_ref = out_refs[0], out_refs[1:5], out_refs[5]
      plgpu.copy_smem_to_gmem(state_s, ckpt_ref.at[batch, head, c, values])

      @pl.when(block == 0)
      def _():
        for tile, ref in zip((r_s, k_s, a_s, b_s, g_s), (*decayed_refs, g_ref)):
          plgpu.copy_smem_to_gmem(tile, ref.at[batch, tokens, head])

    pairs = (CHUNK, CHUNK)
    m_ab = jnp.where(strict, product(pairs, (a_s, b_s.T)), 0.0)
    m_ak_s[...] = jnp.where(strict, product(pairs, (a_s, k_s.T)), 0.0).astype(OPERANDS)
    p_rb_s[...] = jnp.where(incl, product(pairs, (r_s, b_s.T)), 0.0).astype(OPERANDS)
    p_rk_s[...] = jnp.where(incl, product(pairs, (r_s, k_s.T)), 0.0).astype(OPERANDS)

    _inverse(m_ab, rows_iota == cols_iota, power_s, solve_s, sync)

    block_shape = (CHUNK, BLOCK)
    x_s[...] = product(block_shape, (a_s, state_s.T), (m_ak_s, v_s)).astype(OPERANDS)
    plgpu.commit_smem()
    u = product(block_shape, (solve_s, x_s))
    sync()  # Every warp's share of the product has read X.
    x_s[...] = u.astype(OPERANDS)
    plgpu.commit_smem()
    y = product(block_shape, (r_s, state_s.T), (p_rb_s, x_s), (p_rk_s, v_s))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous chunk's y (and this chunk's residuals) left.
    y_s[...] = y.astype(y_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(y_s, y_ref.at[batch, tokens, head, values])

    state = load(held_s) + product((BLOCK, size), (x_s.T, b_s), (v_s.T, k_s))
    decay_total = jnp.exp(jnp.min(load(g_s), axis=0))  # e^{g_L}: g falls along the chunk (w <= 0).
    held_s[...] = state * lax.broadcast_in_dim(decay_total, state.shape, [1])
    return carry

  lax.fori_loop(0, num_chunks, one_chunk, 0)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(held_s.at[0], s_ref.at[batch, head, values])
  plgpu.wait_smem_to_gmem(0)


def _check_size(size: int) -> None:
  if not supported(size):
    raise ValueError(f"wkv7_mgpu: head size {size} not supported; sizes {SIZES}")


def _launch(body, out_type, scratch, batch: int, heads: int, size: int, interpreted: bool,
            explicit_barriers: bool = False):
  """`body` as a Mosaic GPU kernel over grid (B, H, N / BV), one warpgroup a program: interpreted on the CPU (Mosaic
  GPU interpret mode) or compiled.

  Barriers. By default Pallas puts a warpgroup barrier before and after every store to shared memory, so that no
  thread overwrites what another still reads and every thread then reads what the others wrote. With
  `explicit_barriers` Pallas adds none (`unsafe_no_auto_barriers`) and `body` gets `sync`, a warpgroup barrier, for
  the places where the kernels' own commits do not already separate a read from a later overwrite by another
  thread: a product's operand tile overwritten by its result or by the next piece's operands (another warp's share
  of the wgmma may still read it: X -> U, dU -> dX, the inverse's tiles, the log-decays' parts)
  and the log-decay row's read-modify-write (its layout replicates each value across threads). A store over what the
  same thread read in the same layout needs none; a store that a product or a copy reads follows a commit_smem (fence
  and barrier) in both forms; `wait_smem_to_gmem` includes a barrier. Interpret mode runs one thread per warpgroup,
  so only a GPU can show a missed barrier (as outputs that differ from the default form's). Cross-warp reductions
  take REDUCTION_SCRATCH bytes (Pallas' default: 2 KiB), so that more columns are reduced between their barriers."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  if explicit_barriers:
    body = functools.partial(body, sync=plgpu.commit_smem)
  params = dict(interpret=plgpu.InterpretGPUParams()) if interpreted else dict(compiler_params=plgpu.CompilerParams(
      unsafe_no_auto_barriers=explicit_barriers, reduction_scratch_bytes=REDUCTION_SCRATCH))
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(batch, heads, size // BLOCK),
                      grid_names=("batch", "head", "block"), **params)


def _chunk_end_decay(grow: jax.Array) -> jax.Array:
  """e^{g_L} [B, H, T / L, N] from e^{g} [B, T, H, N]: each chunk's last row."""
  return jnp.swapaxes(grow[:, CHUNK - 1::CHUNK], 1, 2)


def _scratch(tiles):
  """Shared-memory buffers for (shape, dtype) pairs [slots, ...]: wgmma/TMA tiles, or plain rows [slots, N]."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return [_smem(shape[1:], dtype, shape[0]) if len(shape) == 3 else plgpu.SMEM(shape, dtype)
          for shape, dtype in tiles]


class Residuals(NamedTuple):
  """What `forward(..., checkpoints=True)` keeps for `backward`, the operands as the forward's products took them:
  the state entering each chunk [B, H, T / L, N, N] bfloat16, the decayed R̂, Ǩ, Â, B̌ [B, T, H, N] bfloat16 and the
  chunks' cumulative log-decays g [B, T, H, N] float32 (T padded to a multiple of CHUNK)."""
  states: jax.Array
  r_hat: jax.Array
  k_check: jax.Array
  a_hat: jax.Array
  b_check: jax.Array
  g: jax.Array


def _build(shape: tuple[int, int, int, int], y_dtype: str, residuals: bool, slots: int, explicit_barriers: bool,
           interpreted: bool):
  """The kernel for inputs [B, T, H, N] (T a multiple of CHUNK), y in `y_dtype`, with or without the backward's
  residuals (`Residuals`), with `slots` slots per input tile (2: double-buffered), barriers as `_launch` says:
  interpreted on the CPU (Mosaic GPU interpret mode) or compiled."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  batch, length, heads, size = shape
  inputs, work = _forward_tiles(size, y_dtype, slots)
  scratch = _scratch(inputs + work)
  scratch.append(plgpu.Barrier(num_barriers=len(inputs) * slots + 1))
  out_type = [jax.ShapeDtypeStruct(shape, y_dtype), jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32)]
  if residuals:
    out_type.append(jax.ShapeDtypeStruct((batch, heads, length // CHUNK, size, size), OPERANDS))
    out_type += [jax.ShapeDtypeStruct(shape, OPERANDS)] * 4 + [jax.ShapeDtypeStruct(shape, jnp.float32)]
  body = functools.partial(_kernel, num_chunks=length // CHUNK, residuals=residuals, slots=slots)
  return _launch(body, tuple(out_type), scratch, batch, heads, size, interpreted, explicit_barriers)


def forward(r, w, k, v, a, b, state, *, interpret: bool | None = None, checkpoints: bool = False,
            pipelined: bool | None = None, explicit_barriers: bool = False):
  """WKV-7 forward: (y [B, T, H, N] in v's dtype, the final state [B, H, N, N] float32), and with `checkpoints` also
  `backward`'s residuals (`Residuals`: the state entering each chunk, the chunks' decayed operands and g).

  r, w, k, v, a, b: [B, T, H, N], any float dtype and any T (padded to a multiple of CHUNK with identity tokens), N
  in SIZES, w >= min_log_decay() (`in_range`; stronger decays overflow the factored form). state: [B, H, N, N]
  float32. interpret: Mosaic GPU interpret mode (None: unless the default backend is a GPU). pipelined: each
  chunk's loads overlap the previous chunk's products (two slots per input tile; None: `pipelines(N)`, where they
  fit shared memory). explicit_barriers: the kernel's own barriers only (`_launch`; the same arithmetic). Not
  differentiable itself: the op backend (`ltm_jax.ops.wkv7.pallas_mgpu`) pairs it with `backward`.
  """
  batch, length, heads, size = r.shape
  _check_size(size)
  r, w, k, v, a, b = wkv7_chunked.pad_tokens(CHUNK, r, w, k, v, a, b)
  operands = [x.astype(OPERANDS) for x in (r, k, a, b, v)]
  y_dtype = jnp.dtype(v.dtype).name
  if pipelined is None:
    pipelined = pipelines(size, y_dtype=y_dtype)
  run = backend.mosaic_gpu_call(functools.partial(_build, r.shape, y_dtype, checkpoints, 2 if pipelined else 1,
                                                  explicit_barriers), interpret)
  outputs = run(*operands, w.astype(jnp.float32), state.astype(jnp.float32))
  y, final = outputs[0][:, :length], outputs[1]
  return (y, final, Residuals(*outputs[2:])) if checkpoints else (y, final)


def _backward_kernel(rh_ref, kc_ref, ah_ref, bc_ref, v_ref, dy_ref, ckpt_ref, decay_ref, ds_ref,
                     dv_ref, dr_ref, da_ref, db_ref, dk_ref, dg_ref, ds0_ref,
                     rh_s, kc_s, ah_s, bc_s, v_s, dy_s, s0_s, dsb_s, ds_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s,
                     x_s, u_s, out_s, row_s, decay_s, barriers, *, num_chunks, slots, sync=_no_sync):
  """One program: BV value rows of one (batch, head)'s state gradient through every chunk, last chunk first. The
  input tiles (R̂, Ǩ, Â, B̌, v, dy, S_0, e^{g_L}) have `slots` slots: with two, the next chunk's loads go to one while
  this chunk's products read the other."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
  batch, head, block = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
  size = rh_s.shape[-1]
  values = pl.ds(block * BLOCK, BLOCK)

  load, product = _load, _product

  pairs, block_shape, piece = (CHUNK, CHUNK), (CHUNK, BLOCK), (CHUNK, BLOCK)

  def masks(zero):
    """(strict, inclusive, diagonal) [L, L] masks, made from an opaque zero where used (not held across the loop)."""
    rows_iota = plgpu.broadcasted_iota(jnp.int32, pairs, 0, layout=wgmma_layout) + zero
    cols_iota = plgpu.broadcasted_iota(jnp.int32, pairs, 1, layout=wgmma_layout)
    return rows_iota > cols_iota, rows_iota >= cols_iota, rows_iota == cols_iota

  tiles = (rh_s, kc_s, ah_s, bc_s, v_s, dy_s, s0_s, dsb_s, ds_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, x_s, u_s,
           out_s, row_s, decay_s)
  inputs = (0, 1, 2, 3, 4, 5, 6, 18)  # The positions in `tiles` of the loaded ones, `slots` slots each.
  entry = len(inputs) * slots  # The barrier of dS's entry; barriers [8 s, 8 s + 8) track slot s's loads.
  dv_stage = 12 if dv_ref.dtype == OPERANDS else 16  # dv leaves through M^(2^i)'s tile (spent) or the float32 one.

  def at(slot, here):
    """The tiles, the working ones at `slot` (an opaque zero) and the loaded ones at `here` (that plus the slot)."""
    return [tile.at[here if n in inputs else slot] for n, tile in enumerate(tiles)]

  def fetch(c, slot, parity):
    """Starts chunk c's loads into input slot `slot`, which is `parity` (a Python int where known) plus an opaque
    zero, tracked by that slot's barriers."""
    tokens = pl.ds(c * CHUNK, CHUNK)
    sources = (rh_ref.at[batch, tokens, head], kc_ref.at[batch, tokens, head], ah_ref.at[batch, tokens, head],
               bc_ref.at[batch, tokens, head], v_ref.at[batch, tokens, head, values],
               dy_ref.at[batch, tokens, head, values], ckpt_ref.at[batch, head, c, values], decay_ref.at[batch, head, c])
    for n, (src, position) in enumerate(zip(sources, inputs)):
      plgpu.copy_gmem_to_smem(src, tiles[position].at[slot], barriers.at[parity * len(inputs) + n])

  if slots == 2:
    fetch(num_chunks - 1, 0, 0)
  # dS [BV, N] float32 lives in ds_s from the first chunk to the last.
  plgpu.copy_gmem_to_smem(ds_ref.at[batch, head, values], ds_s.at[0], barriers.at[entry])
  plgpu.barrier_wait(barriers.at[entry])

  def one_chunk(i, carry):
    c = num_chunks - 1 - i
    slot = lax.optimization_barrier(i) - i  # As in the forward: tile addresses stay in the loop body.
    parity = lax.rem(i, slots) if slots > 1 else 0
    this = slot + parity if slots > 1 else slot
    here = at(slot, this)
    (rh_s, kc_s, ah_s, bc_s, v_s, dy_s, s0_s, dsb_s, ds_s, m_ak_s, p_rb_s, p_rk_s, power_s, solve_s, x_s, u_s, out_s,
     row_s, decay_s) = here
    dv_s = here[dv_stage]
    tokens = pl.ds(c * CHUNK, CHUNK)
    # The input slot loaded next was last read before the previous chunk's closing commit_smem (a warpgroup barrier).
    if slots == 1:
      fetch(c, this, 0)
    else:
      @pl.when(c > 0)
      def _():
        fetch(c - 1, slot + 1 - parity, 1 - parity)
    for n in range(len(inputs)):
      plgpu.barrier_wait(barriers.at[parity * len(inputs) + n])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # The previous chunk's outputs have left their tiles.

    # dS̄ = dS diag(e^{g_L}): the only form in which the chunk uses dS. The row tile starts the log-decays' chunk
    # sum with the carried state's share, the column sums of dS̄ ⊙ S_0.
    _scale_gradient(ds_s, dsb_s, decay_s, size, s0_s, row_s)

    # The forward's tiles: pair matrices, the inverse, X and U.
    strict, incl, diagonal = masks(slot)
    m_ab = jnp.where(strict, product(pairs, (ah_s, bc_s.T)), 0.0)
    m_ak_s[...] = jnp.where(strict, product(pairs, (ah_s, kc_s.T)), 0.0).astype(OPERANDS)
    p_rb_s[...] = jnp.where(incl, product(pairs, (rh_s, bc_s.T)), 0.0).astype(OPERANDS)
    p_rk_s[...] = jnp.where(incl, product(pairs, (rh_s, kc_s.T)), 0.0).astype(OPERANDS)
    _inverse(m_ab, diagonal, power_s, solve_s, sync)
    x_s[...] = product(block_shape, (ah_s, s0_s.T), (m_ak_s, v_s)).astype(OPERANDS)
    plgpu.commit_smem()
    u_s[...] = product(block_shape, (solve_s, x_s)).astype(OPERANDS)
    plgpu.commit_smem()

    # Value side: dU = P_rb^T dY + B̌ dS̄^T, dX = (I - M_ab)^{-T} dU (both in x_s), dV, and dS_0 into ds_s.
    _value_adjoint(p_rb_s, dy_s, bc_s, dsb_s, solve_s, x_s, sync)
    dv = product(block_shape, (p_rk_s.T, dy_s), (m_ak_s.T, x_s), (kc_s, dsb_s.T))
    dv_s[...] = dv.astype(dv_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dv_s, dv_ref.at[batch, tokens, head, values])
    _state_gradient(ds_s, dy_s, rh_s, x_s, ah_s, size)

    # Key side: the masked pair-matrix gradients into the spent pair tiles, then this block's shares of the
    # gradients of R̂, Â, B̌, Ǩ [L, N] (before their decay factors) in [L, 64] pieces through out_s.
    dp_rb_s, dp_rk_s, dm_ab_s, dm_ak_s = p_rb_s, p_rk_s, solve_s, m_ak_s
    strict, incl, _ = masks(lax.optimization_barrier(c) - c)
    dp_rb_s[...] = jnp.where(incl, product(pairs, (dy_s, u_s.T)), 0.0).astype(OPERANDS)
    dp_rk_s[...] = jnp.where(incl, product(pairs, (dy_s, v_s.T)), 0.0).astype(OPERANDS)
    dm_ab_s[...] = jnp.where(strict, product(pairs, (x_s, u_s.T)), 0.0).astype(OPERANDS)
    dm_ak_s[...] = jnp.where(strict, product(pairs, (x_s, v_s.T)), 0.0).astype(OPERANDS)
    plgpu.commit_smem()

    def emit(value, ref, start, out_s):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_s[...] = value
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_s, ref.at[block, batch, tokens, head, pl.ds(start, BLOCK)])

    def key_piece(j, carry):
      # The tiles again at an opaque zero: their wgmma descriptors stay in this loop's body, not hoisted before it.
      piece_slot = lax.optimization_barrier(j) - j
      (rh_s, kc_s, ah_s, bc_s, v_s, dy_s, s0_s, dsb_s, _, m_ak_s, p_rb_s, p_rk_s, _, solve_s, x_s, u_s, out_s,
       row_s, _) = at(piece_slot, piece_slot + parity if slots > 1 else piece_slot)
      dp_rb_s, dp_rk_s, dm_ab_s, dm_ak_s = p_rb_s, p_rk_s, solve_s, m_ak_s
      start = pl.multiple_of(j * BLOCK, BLOCK)
      cols = (slice(None), pl.ds(start, BLOCK))
      emit(product(piece, (dy_s, s0_s.at[cols]), (dp_rb_s, bc_s.at[cols]), (dp_rk_s, kc_s.at[cols])), dr_ref, start,
           out_s)
      emit(product(piece, (x_s, s0_s.at[cols]), (dm_ab_s, bc_s.at[cols]), (dm_ak_s, kc_s.at[cols])), da_ref, start,
           out_s)
      # The state after the chunk takes B̌ and Ǩ through U dS̄ and V dS̄; with them, g_L's gradient.
      row = plgpu.load(row_s.at[pl.ds(start, BLOCK)], layout=row_layout)
      for side_s, key_s in ((u_s, bc_s), (v_s, kc_s)):
        row = row + jnp.sum(product(piece, (side_s, dsb_s.at[cols])) * load(key_s.at[cols]), axis=0)
      sync()  # Every thread holding a copy of the row has read it.
      row_s[pl.ds(start, BLOCK)] = row
      emit(product(piece, (dp_rb_s.T, rh_s.at[cols]), (dm_ab_s.T, ah_s.at[cols]), (u_s, dsb_s.at[cols])), db_ref,
           start, out_s)
      emit(product(piece, (dp_rk_s.T, rh_s.at[cols]), (dm_ak_s.T, ah_s.at[cols]), (v_s, dsb_s.at[cols])), dk_ref,
           start, out_s)
      return carry

    lax.fori_loop(0, size // BLOCK, key_piece, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(row_s, dg_ref.at[block, batch, head, c])
    return carry

  lax.fori_loop(0, num_chunks, one_chunk, 0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ds_s.at[0], ds0_ref.at[batch, head, values])
  plgpu.wait_smem_to_gmem(0)


def _build_backward(shape: tuple[int, int, int, int], dv_dtype: str, slots: int, explicit_barriers: bool,
                    interpreted: bool):
  """The backward kernel for inputs [B, T, H, N] (T a multiple of CHUNK), dv in `dv_dtype` (bfloat16 or float32),
  `slots` slots per input tile (2: double-buffered), barriers as `_launch` says."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  batch, length, heads, size = shape
  chunks, blocks = length // CHUNK, size // BLOCK
  inputs, work = _backward_tiles(size, slots)
  # In the kernel's order: R̂, Ǩ, Â, B̌, v, dy, S_0; dS̄, dS, M_ak, P_rb, P_rk, M^(2^i), the inverse, X (then dU, dX),
  # U, the key-side gradients' [L, 64] pieces on their way out, the log-decay row; e^{g_L}.
  scratch = _scratch(inputs[:7] + work + inputs[7:])
  scratch.append(plgpu.Barrier(num_barriers=len(inputs) * slots + 1))
  partial = jax.ShapeDtypeStruct((blocks, *shape), jnp.float32)
  out_type = (jax.ShapeDtypeStruct(shape, dv_dtype), partial, partial, partial, partial,
              jax.ShapeDtypeStruct((blocks, batch, heads, chunks, size), jnp.float32),
              jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32))
  body = functools.partial(_backward_kernel, num_chunks=chunks, slots=slots)
  return _launch(body, out_type, scratch, batch, heads, size, interpreted, explicit_barriers)


def backward(r, w, k, v, a, b, residuals: Residuals, dy, ds, *, interpret: bool | None = None,
             pipelined: bool | None = None, explicit_barriers: bool = False):
  """The gradients (dr, dw, dk, dv, da, db in the inputs' dtypes, dstate [B, H, N, N] float32) of `forward` at
  r, w, k, v, a, b [B, T, H, N], given its `residuals` (`forward(..., checkpoints=True)`), dy [B, T, H, N] (y's
  gradient) and ds [B, H, N, N] (the final state's gradient). Same range and sizes as `forward`. pipelined: each
  chunk's loads overlap the previous chunk's products (None: `pipelines(N, backward=True)`). explicit_barriers: as
  in `forward`."""
  batch, length, heads, size = r.shape
  _check_size(size)
  r, w, k, v, a, b, dy = wkv7_chunked.pad_tokens(CHUNK, r, w, k, v, a, b, dy)
  padded = r.shape[1]
  g = residuals.g
  grow, shrink, grow_before = jnp.exp(g), jnp.exp(-g), jnp.exp(g - w.astype(jnp.float32))
  operands = [residuals.r_hat, residuals.k_check, residuals.a_hat, residuals.b_check, v.astype(OPERANDS),
              dy.astype(OPERANDS)]
  decay_total = _chunk_end_decay(grow)
  dv_dtype = "bfloat16" if v.dtype == jnp.bfloat16 else "float32"
  if pipelined is None:
    pipelined = pipelines(size, backward=True)
  run = backend.mosaic_gpu_call(functools.partial(_build_backward, r.shape, dv_dtype, 2 if pipelined else 1,
                                                  explicit_barriers), interpret)
  dv, dr, da, db, dk, dg_total, dstate = run(*operands, residuals.states, decay_total, ds.astype(jnp.float32))
  # The value blocks' shares summed, and each decayed tile's gradient taken back to its input.
  dr, da = dr.sum(0) * grow, da.sum(0) * grow_before
  db, dk = db.sum(0) * shrink, dk.sum(0) * shrink
  # Log-decays: g_t gets dr r - db b - dk k, g⁻_t gets da a, g_L (every token of the chunk) the row sums; w_s enters
  # g_t for t >= s, g⁻_t for t > s and g_L.
  f32 = lambda x: x.astype(jnp.float32)
  dg = dr * f32(r) - db * f32(b) - dk * f32(k)
  dgp = da * f32(a)
  by_chunk = lambda x: x.reshape(batch, padded // CHUNK, CHUNK, heads, size)
  both = by_chunk(dg + dgp)
  suffix = lax.cumsum(both, axis=2, reverse=True)
  dw = suffix - by_chunk(dgp) + jnp.swapaxes(dg_total.sum(0), 1, 2)[:, :, None]
  dw = dw.reshape(r.shape)
  grads = [x[:, :length].astype(y.dtype) for x, y in zip((dr, dw, dk, dv, da, db), (r, w, k, v, a, b))]
  return (*grads, dstate)


# State-only kernels: the passes that find each segment's entering state (`end_states`) and the gradient of the state
# entering each segment (`state_gradients`) for `wkv7_segmented`. Same grid, warpgroup and chunks as the forward and
# backward, with only the tiles the state (or its gradient) needs.


def _end_state_kernel(*refs, num_chunks, values):
  """One program: BV rows of one (batch, head)'s state through every chunk, no y. With `values` the inputs are k, v,
  a, b, w and the state; without, a, b, w and the state (v = 0: the chunks' transition applied to it).

  Per chunk: g (in place of w), Â, B̌ (and Ǩ) as in the forward; M_ab (and M_ak), the inverse,
  U = (I - M_ab)^{-1} (Â S_0^T + M_ak V) and S_L = (S_0 + U^T B̌ + V^T Ǩ) diag(e^{g_L}). The float32 state stays in
  shared memory from the first chunk to the last (updated in [BV, 64] column pieces), its bfloat16 copy the
  products' operand."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  if values:
    (k_ref, v_ref, a_ref, b_ref, w_ref, s0_ref, s_ref,
     k_s, v_s, a_s, b_s, w_s, held_s, state_s, x_s, ones_s, m_ak_s, power_s, solve_s, barriers) = refs
    sources, inputs = (k_ref, a_ref, b_ref, w_ref), (k_s, a_s, b_s, w_s)
    work = (held_s, state_s, x_s, m_ak_s, power_s, solve_s)
  else:
    (a_ref, b_ref, w_ref, s0_ref, s_ref, a_s, b_s, w_s, held_s, state_s, x_s, ones_s, power_s, solve_s,
     barriers) = refs
    sources, inputs = (a_ref, b_ref, w_ref), (a_s, b_s, w_s)
    work = (held_s, state_s, x_s, power_s, solve_s)
  wgmma_layout = plgpu.Layout.WGMMA
  batch, head, block = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
  size = a_s.shape[-1]
  values_block = pl.ds(block * BLOCK, BLOCK)
  loads = len(inputs) + values  # v is loaded too, with values.
  v_tile = v_s if values else None
  plgpu.copy_gmem_to_smem(s0_ref.at[batch, head, values_block], held_s.at[0], barriers.at[loads])
  rows_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout)
  cols_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
  ones_s[0] = jnp.where(rows_iota >= cols_iota, 1.0, 0.0).astype(OPERANDS)  # The cumulative sums' ones.
  plgpu.barrier_wait(barriers.at[loads])

  def one_chunk(c, carry):
    slot = lax.optimization_barrier(c) - c  # As in the forward: tile addresses stay in the loop body.
    if values:
      k_s, v_s = inputs[0].at[slot], v_tile.at[slot]
    a_s, b_s, w_s = (tile.at[slot] for tile in inputs[-3:])
    held_s, state_s, x_s, *rest = (tile.at[slot] for tile in work)
    m_ak_s, power_s, solve_s = rest if values else (None, *rest)
    tokens = pl.ds(c * CHUNK, CHUNK)
    plgpu.commit_smem()  # Every thread is done with the previous chunk's input tiles.
    for i, (src, dst) in enumerate(zip(sources, inputs)):
      plgpu.copy_gmem_to_smem(src.at[batch, tokens, head], dst.at[slot], barriers.at[i])
    if values:
      plgpu.copy_gmem_to_smem(v_ref.at[batch, tokens, head, values_block], v_tile.at[slot], barriers.at[len(inputs)])
    for i in range(loads):
      plgpu.barrier_wait(barriers.at[i])

    _log_decays(size, w_s, ones_s.at[slot], (x_s, power_s, solve_s), a_s)
    g_s = w_s  # w is spent: its tile holds g.
    _decay(size, g_s, b_s, k_s=k_s if values else None)
    state_s[...] = _load(held_s).astype(OPERANDS)
    plgpu.commit_smem()
    rows_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout) + slot
    cols_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
    strict = rows_iota > cols_iota
    pairs, block_shape = (CHUNK, CHUNK), (CHUNK, BLOCK)
    m_ab = jnp.where(strict, _product(pairs, (a_s, b_s.T)), 0.0)
    if values:
      m_ak_s[...] = jnp.where(strict, _product(pairs, (a_s, k_s.T)), 0.0).astype(OPERANDS)
    _inverse(m_ab, rows_iota == cols_iota, power_s, solve_s)
    terms = ((a_s, state_s.T), (m_ak_s, v_s)) if values else ((a_s, state_s.T),)
    x_s[...] = _product(block_shape, *terms).astype(OPERANDS)
    plgpu.commit_smem()
    x_s[...] = _product(block_shape, (solve_s, x_s)).astype(OPERANDS)
    plgpu.commit_smem()

    def state_piece(j, carry):
      cols = (slice(None), pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK))
      terms = ((x_s.T, b_s.at[cols]), (v_s.T, k_s.at[cols])) if values else ((x_s.T, b_s.at[cols]),)
      decay = jnp.exp(jnp.min(_load(g_s.at[cols]), axis=0))  # e^{g_L}: g falls along the chunk (w <= 0).
      state = _load(held_s.at[cols]) + _product((BLOCK, BLOCK), *terms)
      held_s[cols] = state * lax.broadcast_in_dim(decay, (BLOCK, BLOCK), [1])
      return carry

    lax.fori_loop(0, size // BLOCK, state_piece, 0)
    return carry

  lax.fori_loop(0, num_chunks, one_chunk, 0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(held_s.at[0], s_ref.at[batch, head, values_block])
  plgpu.wait_smem_to_gmem(0)


def _state_tiles(size: int, values: bool) -> list:
  """The end-state kernel's tiles as (shape, dtype) pairs, in its order: (k,) (v,) a, b, w (then g); the float32
  state, its bfloat16 operand, X then U, the cumulative sums' ones, (M_ak,) M^(2^i), the inverse."""
  keys = [((1, CHUNK, size), OPERANDS)]
  tiles = (keys + [((1, CHUNK, BLOCK), OPERANDS)] if values else []) + keys * 2
  tiles += [((1, CHUNK, size), jnp.float32)]
  tiles += [((1, BLOCK, size), jnp.float32), ((1, BLOCK, size), OPERANDS), ((1, CHUNK, BLOCK), OPERANDS)]
  return tiles + [((1, CHUNK, CHUNK), OPERANDS)] * (4 if values else 3)


def _build_end_state(shape: tuple[int, int, int, int], values: bool, interpreted: bool):
  """The end-state kernel for inputs [B, T, H, N] (T a multiple of CHUNK), with or without values."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  batch, length, heads, size = shape
  scratch = _scratch(_state_tiles(size, values))
  scratch.append(plgpu.Barrier(num_barriers=(5 if values else 3) + 1))
  body = functools.partial(_end_state_kernel, num_chunks=length // CHUNK, values=values)
  return _launch(body, jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32), scratch, batch, heads, size,
                 interpreted)


def end_states(w, k, v, a, b, state, *, interpret: bool | None = None):
  """The state after each sequence [B, H, N, N] float32 from `state` [B, H, N, N] before it, without y. w, k, v, a, b:
  [B, T, H, N], any float dtype and T (padded with identity tokens). With k and v None: the sequences' transitions
  applied to `state` (v = 0; from the identity, the transition matrices A with S_end = S_start A). Same range and
  sizes as `forward`, whose operands (bfloat16, the decays taken in the kernel) these are."""
  size = w.shape[-1]
  _check_size(size)
  values = v is not None
  keys = (k, v, a, b) if values else (a, b)
  w, *keys = wkv7_chunked.pad_tokens(CHUNK, w, *keys)
  operands = [x.astype(OPERANDS) for x in keys]
  run = backend.mosaic_gpu_call(functools.partial(_build_end_state, w.shape, values), interpret)
  return run(*operands, w.astype(jnp.float32), state.astype(jnp.float32))


def _state_gradient_kernel(rh_ref, ah_ref, bc_ref, dy_ref, decay_ref, ds_ref, ds0_ref,
                           rh_s, ah_s, bc_s, dy_s, decay_s, ds_s, dsb_s, p_rb_s, power_s, solve_s, x_s, barriers, *,
                           num_chunks):
  """One program: BV rows of one (batch, head)'s state gradient through every chunk, last chunk first, without the
  inputs' gradients. Per chunk, the backward's value side on R̂, Â, B̌ (bfloat16, the forward's as for `backward`),
  dy and e^{g_L}: dS̄ = dS diag(e^{g_L}), M_ab, P_rb, the inverse, dU = P_rb^T dY + B̌ dS̄^T,
  dX = (I - M_ab)^{-T} dU and dS_0 = dY^T R̂ + dX^T Â + dS̄ (float32 in shared memory from the last chunk to the
  first)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  wgmma_layout = plgpu.Layout.WGMMA
  batch, head, block = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("block")
  size = rh_s.shape[-1]
  values = pl.ds(block * BLOCK, BLOCK)
  tiles = (rh_s, ah_s, bc_s, dy_s, decay_s, ds_s, dsb_s, p_rb_s, power_s, solve_s, x_s)
  plgpu.copy_gmem_to_smem(ds_ref.at[batch, head, values], ds_s.at[0], barriers.at[5])
  plgpu.barrier_wait(barriers.at[5])

  def one_chunk(i, carry):
    c = num_chunks - 1 - i
    slot = lax.optimization_barrier(i) - i  # As in the forward: tile addresses stay in the loop body.
    rh_s, ah_s, bc_s, dy_s, decay_s, ds_s, dsb_s, p_rb_s, power_s, solve_s, x_s = (tile.at[slot] for tile in tiles)
    tokens = pl.ds(c * CHUNK, CHUNK)
    plgpu.commit_smem()  # Every thread is done with the previous chunk's input tiles.
    sources = (rh_ref.at[batch, tokens, head], ah_ref.at[batch, tokens, head], bc_ref.at[batch, tokens, head],
               dy_ref.at[batch, tokens, head, values], decay_ref.at[batch, head, c])
    for n, (src, dst) in enumerate(zip(sources, (rh_s, ah_s, bc_s, dy_s, decay_s))):
      plgpu.copy_gmem_to_smem(src, dst, barriers.at[n])
    for n in range(len(sources)):
      plgpu.barrier_wait(barriers.at[n])

    _scale_gradient(ds_s, dsb_s, decay_s, size)
    pairs = (CHUNK, CHUNK)
    rows_iota = plgpu.broadcasted_iota(jnp.int32, pairs, 0, layout=wgmma_layout) + slot
    cols_iota = plgpu.broadcasted_iota(jnp.int32, pairs, 1, layout=wgmma_layout)
    m_ab = jnp.where(rows_iota > cols_iota, _product(pairs, (ah_s, bc_s.T)), 0.0)
    p_rb_s[...] = jnp.where(rows_iota >= cols_iota, _product(pairs, (rh_s, bc_s.T)), 0.0).astype(OPERANDS)
    _inverse(m_ab, rows_iota == cols_iota, power_s, solve_s)
    _value_adjoint(p_rb_s, dy_s, bc_s, dsb_s, solve_s, x_s)
    _state_gradient(ds_s, dy_s, rh_s, x_s, ah_s, size)
    return carry

  lax.fori_loop(0, num_chunks, one_chunk, 0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ds_s.at[0], ds0_ref.at[batch, head, values])
  plgpu.wait_smem_to_gmem(0)


def _gradient_tiles(size: int) -> list:
  """The state-gradient kernel's tiles as (shape, dtype) pairs, in its order: R̂, Â, B̌, dy, e^{g_L}; dS (float32),
  dS̄ (bfloat16), P_rb, M^(2^i), the inverse, X (dU, then dX)."""
  keys = [((1, CHUNK, size), OPERANDS)] * 3
  return keys + [((1, CHUNK, BLOCK), OPERANDS), ((1, size), jnp.float32), ((1, BLOCK, size), jnp.float32),
                 ((1, BLOCK, size), OPERANDS)] + [((1, CHUNK, CHUNK), OPERANDS)] * 3 + [((1, CHUNK, BLOCK), OPERANDS)]


def _build_state_gradient(shape: tuple[int, int, int, int], interpreted: bool):
  """The state-gradient kernel for inputs [B, T, H, N] (T a multiple of CHUNK)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  batch, length, heads, size = shape
  scratch = _scratch(_gradient_tiles(size))
  scratch.append(plgpu.Barrier(num_barriers=6))
  body = functools.partial(_state_gradient_kernel, num_chunks=length // CHUNK)
  return _launch(body, jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32), scratch, batch, heads, size,
                 interpreted)


def state_gradients(residuals: Residuals, dy, ds, *, interpret: bool | None = None):
  """The gradient of the state before each sequence [B, H, N, N] float32, given the forward's `residuals`
  (`forward(..., checkpoints=True)`: its decayed operands and g), dy [B, T, H, N] (y's gradient, T the forward's
  inputs' length) and ds [B, H, N, N] (the gradient of the state after it), without the inputs' gradients. Same range
  and sizes as `forward`; the operands are `backward`'s."""
  size = dy.shape[-1]
  _check_size(size)
  (dy,) = wkv7_chunked.pad_tokens(CHUNK, dy)
  operands = [residuals.r_hat, residuals.a_hat, residuals.b_check, dy.astype(OPERANDS)]
  run = backend.mosaic_gpu_call(functools.partial(_build_state_gradient, dy.shape), interpret)
  return run(*operands, _chunk_end_decay(jnp.exp(residuals.g)), ds.astype(jnp.float32))
