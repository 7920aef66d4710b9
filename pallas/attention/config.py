"""Static settings of one flash-attention call, and the block arithmetic shared by its kernels.

Positions: query i sits at position i + offset (offset = S - T, so the last query lines up with the last key) and key
j at position j. Key j is visible from query i when all that apply hold:
  causal:     j <= i + offset
  window=W:   i + offset - j < W          (needs causal)
  segments:   q_segment[i] == kv_segment[j]
  padding:    j < S                        (keys past the caller's length never count)
Queries past T are padding too; they are computed like any row and thrown away (their cotangent is zero, so they add
nothing to dk/dv).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and Triton launch settings of the three kernels. A field left None takes its value from
  `default_block_sizes` for the call's head dim and dtype.

  Tiles are powers of two >= 16 (Triton's tl.dot). Each is cut down to its sequence's next power of two, so short
  sequences do not pad to a whole tile.

  Attributes:
    fwd_q, fwd_k: forward kernel: query rows per program, keys per inner step.
    dq_q, dq_k: dq kernel: query rows per program, keys per inner step.
    dkv_k, dkv_q: dk/dv kernel: key rows per program, query rows per inner step.
    fwd_warps, dq_warps, dkv_warps: Triton warps per program of each kernel.
    fwd_stages, dq_stages, dkv_stages: Triton software-pipelining depth of each kernel's inner loop.
    dkv_stream_kv: dk/dv kernel: read the program's key and value tiles again at every inner step instead of once
      before the loop. Held across the loop, they stay in the layout of the products that read them; for float32
      (IEEE products on the CUDA cores, each thread holding whole rows of the contraction) that is 2 x D values per
      thread, which at D >= 128 cannot fit 255 registers. Read per step (from L1/L2), only the step's working set is
      live.
  """

  fwd_q: int | None = None
  fwd_k: int | None = None
  dq_q: int | None = None
  dq_k: int | None = None
  dkv_k: int | None = None
  dkv_q: int | None = None
  fwd_warps: int | None = None
  dq_warps: int | None = None
  dkv_warps: int | None = None
  fwd_stages: int | None = None
  dq_stages: int | None = None
  dkv_stages: int | None = None
  dkv_stream_kv: bool | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None:
        continue
      if field.name == "dkv_stream_kv" and not isinstance(value, bool):
        raise ValueError(f"BlockSizes.dkv_stream_kv must be a bool, got {value!r}")
      if field.name.endswith("_warps") and value not in (1, 2, 4, 8, 16):
        raise ValueError(f"BlockSizes.{field.name} must be 1, 2, 4, 8 or 16, got {value}")
      if field.name.endswith("_stages") and value < 1:
        raise ValueError(f"BlockSizes.{field.name} must be >= 1, got {value}")
      if field.name.endswith(("_q", "_k")) and (value < 16 or value & (value - 1)):
        raise ValueError(f"BlockSizes.{field.name} must be a power of two >= 16, got {value}")

  def or_defaults(self, defaults: BlockSizes) -> BlockSizes:
    """These settings, with every None taken from `defaults`."""
    return dataclasses.replace(defaults, **{k: v for k, v in dataclasses.asdict(self).items() if v is not None})


def _tiles(fwd: tuple[int, int, int, int], dq: tuple[int, int, int, int],
           dkv: tuple[int, int, int, int], dkv_stream_kv: bool = False) -> BlockSizes:
  """BlockSizes from (rows per program, rows per inner step, warps, stages) of each kernel."""
  return BlockSizes(fwd_q=fwd[0], fwd_k=fwd[1], fwd_warps=fwd[2], fwd_stages=fwd[3],
                    dq_q=dq[0], dq_k=dq[1], dq_warps=dq[2], dq_stages=dq[3],
                    dkv_k=dkv[0], dkv_q=dkv[1], dkv_warps=dkv[2], dkv_stages=dkv[3], dkv_stream_kv=dkv_stream_kv)


# Default settings by padded head dim (the 64 row serves 16 to 64) and operand width in bytes (2: bfloat16 and
# float16; 4: float32). Each kernel's entry is (rows per program, rows per inner step, warps, stages).
#
# Chosen without a GPU, from what `benchmarks/gpu_aot.py` reports when it compiles the kernels for an H100 (ptxas
# registers and spills, shared memory; results in benchmarks/results/gpu-aot-h100.json). Candidates per kernel:
# tiles of 32 to 128 rows (2-byte) or 16 to 64 (float32), 4 or 8 warps, 1 to 3 stages, compiled at the causal GQA
# case of the row (the float32 64 row at head dim 32 as well). A candidate must fit the 227 KiB of shared memory and
# use at most 240 registers without spilling (the 255 limit less headroom: masks, segment ids and the jax version
# move the count by up to 30). Each kernel then takes, in order: the highest estimated occupancy (resident threads
# per SM), the larger tile per program (it loads its own rows once and streams the others), the larger step, the
# fewer registers, the more stages. The 2-byte rows keep at least 64 rows per program (one Hopper warpgroup MMA) and
# 32 per step, since tensor-core throughput and not occupancy alone sets their speed; the float32 rows, whose IEEE
# products run on the CUDA cores, keep no such floor. Every case of benchmarks/aot_cases.py was then compiled with the
# result: nothing spills, and the most registers is 228 (head dim 256, dk/dv). Occupancy is an estimate, and no tiles
# but these defaults have been timed: on one H100 (bfloat16, head dims 64 and 128; in benchmarks/results/,
# attention-d64-nvidia-h100-80gb-hbm3.json and attention-d128-nvidia-h100-80gb-hbm3.json) their forward+backward took
# 1.4-2.6x cuDNN's time under a causal mask and 0.9-1.6x under a 256-token window. Timing other tiles would rank them.
DEFAULT_BLOCK_SIZES: dict[tuple[int, int], BlockSizes] = {
    (64, 2): _tiles(fwd=(64, 32, 8, 2), dq=(64, 32, 8, 2), dkv=(64, 128, 8, 1)),
    (128, 2): _tiles(fwd=(128, 32, 8, 3), dq=(128, 32, 8, 2), dkv=(64, 128, 8, 1)),
    (256, 2): _tiles(fwd=(64, 64, 8, 2), dq=(64, 32, 8, 2), dkv=(64, 32, 8, 1)),
    (64, 4): _tiles(fwd=(32, 16, 8, 3), dq=(32, 16, 8, 1), dkv=(32, 16, 8, 1)),
    (128, 4): _tiles(fwd=(16, 32, 8, 2), dq=(16, 32, 8, 1), dkv=(32, 16, 16, 1), dkv_stream_kv=True),
    (256, 4): _tiles(fwd=(16, 16, 8, 1), dq=(32, 16, 8, 1), dkv=(16, 32, 8, 1), dkv_stream_kv=True),
}
# The float32 dk/dv kernel at head dims 128 and 256 reads its key/value tiles at every step (dkv_stream_kv): Triton
# multiplies IEEE float32 tiles on the CUDA cores with each thread holding whole rows of the contraction (over D for
# q k^T and do v^T), so k and v held across the loop take 2 x D registers per thread, and every setting spilled
# (tiles 16 to 64, 2 to 16 warps, 1 to 3 stages: 0.7 to 63 KB). Streamed, a dozen settings compile without spills;
# ptxas then trades registers for occupancy on its own, spilling a little in some mask variants of a setting and not
# others, so the best of them (three at head dim 128, four at 256) were also compiled at window + segment, non-causal
# segment, cross-length padded, windowed MQA and unaligned head-dim shapes; these two spill at none of them: (32, 16)
# on 16 warps at head dim 128 (64 registers, 25% occupancy, bound by its 114 KiB of shared memory), (16, 32) on 8
# warps at head dim 256 (105 to 171 registers, 12%, bound by its 162 KiB of shared memory). (16, 32) on 16 warps
# would estimate 50% at head dim 128, and (16, 16) or (32, 16) on 16 warps 25% at head dim 256, but they spill at some
# of those shapes.


# Rows whose defaults are known to spill registers on an H100; `benchmarks/gpu_aot.py` lets their cases spill. None
# since the float32 dk/dv kernel streams its key/value tiles (above).
SPILLING_DEFAULTS: frozenset[tuple[int, int]] = frozenset()


def _row(head_dim_pad: int, dtype) -> tuple[int, int]:
  return min(max(next_power_of_two(head_dim_pad), 64), 256), 4 if jnp.dtype(dtype).itemsize >= 4 else 2


def default_block_sizes(head_dim_pad: int, dtype) -> BlockSizes:
  """The `DEFAULT_BLOCK_SIZES` row for a padded head dim (above 256 the 256 row) and dtype."""
  return DEFAULT_BLOCK_SIZES[_row(head_dim_pad, dtype)]


def defaults_spill(head_dim: int, dtype) -> bool:
  """Whether the default settings for this head dim and dtype spill registers on an H100 (`SPILLING_DEFAULTS`)."""
  return _row(max(16, head_dim), dtype) in SPILLING_DEFAULTS


def next_power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def fit_block(block: int, length: int) -> int:
  """`block` cut to the smallest power of two >= length (but >= 16)."""
  return min(block, max(16, next_power_of_two(length)))


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything about a call that shapes the kernels (hashable: it is a nondiff argument of the custom_vjp).

  t and s are the caller's lengths; the arrays the kernels see are padded to t_pad, s_pad and head_dim_pad.
  """

  causal: bool
  window: int | None
  scale: float
  t: int
  s: int
  t_pad: int
  s_pad: int
  head_dim_pad: int
  group: int
  has_segments: bool
  fwd_q: int
  fwd_k: int
  dq_q: int
  dq_k: int
  dkv_k: int
  dkv_q: int
  fwd_warps: int
  dq_warps: int
  dkv_warps: int
  fwd_stages: int
  dq_stages: int
  dkv_stages: int
  dkv_stream_kv: bool
  interpret: bool | None
  float32_inputs: bool

  @property
  def offset(self) -> int:
    return self.s - self.t

  @property
  def has_mask(self) -> bool:
    """Whether any tile can hold an invisible pair; if not, the kernels trace no masked steps at all."""
    return self.causal or self.has_segments or self.s_pad > self.s

  @property
  def precision(self):
    # Triton's default for float32 operands is TF32; float32 callers asked for float32.
    return lax.Precision.HIGHEST if self.float32_inputs else None


def _floor_div(x, d: int):
  """floor(max(x, 0) / d) for an int32 scalar (traced in kernels); clamping keeps lax.div's truncation a floor."""
  return lax.div(jnp.maximum(x, 0), d)


def _ceil_div(x, d: int):
  return lax.div(jnp.maximum(x, 0) + (d - 1), d)


def _order(lo, full_lo, full_hi, hi):
  """Clamps to lo <= full_lo <= full_hi <= hi, so three consecutive loops cover [lo, hi) exactly once."""
  hi = jnp.maximum(hi, lo)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, full_lo, full_hi, hi


def key_block_range(st: Static, q_block, block_q: int, block_k: int):
  """Key blocks that query block `q_block` must visit: (lo, full_lo, full_hi, hi).

  Blocks outside [lo, hi) hold no visible key for any query of the block and are never loaded, which is what makes
  a windowed call cost O(T * W). Inside [full_lo, full_hi) every (query, key) pair is visible, so those steps skip
  the mask.
  """
  q_first = q_block * block_q + st.offset  # Position of the block's first query.
  q_last = q_first + (block_q - 1)
  whole_blocks = st.s // block_k  # Key blocks without padding.
  if st.causal:
    hi = _ceil_div(jnp.minimum(q_last + 1, st.s), block_k)
    full_hi = _floor_div(q_first + 1, block_k)  # Blocks whose last key is <= q_first.
  else:
    hi = jnp.int32(_cdiv(st.s, block_k))
    full_hi = jnp.int32(whole_blocks)
  if st.window is not None:
    lo = _floor_div(q_first - st.window + 1, block_k)
    full_lo = _ceil_div(q_last - st.window + 1, block_k)  # Blocks whose first key is in every query's window.
  else:
    lo = full_lo = jnp.int32(0)
  full_hi = jnp.minimum(full_hi, whole_blocks)
  if st.has_segments:
    full_lo = full_hi = lo  # Segment ids are data: every block is masked.
  return _order(lo, full_lo, full_hi, hi)


def query_block_range(st: Static, k_block, block_q: int, block_k: int):
  """Query blocks that see any key of key block `k_block`: (lo, full_lo, full_hi, hi), as in `key_block_range`."""
  k_first = k_block * block_k
  k_last = k_first + (block_k - 1)
  real_blocks = _cdiv(st.t, block_q)  # Blocks past T hold only padding queries: skipped.
  if st.causal:
    lo = _floor_div(k_first - st.offset, block_q)  # First query whose position reaches k_first.
    full_lo = _ceil_div(k_last - st.offset, block_q)  # Blocks whose first query already sees k_last.
  else:
    lo = full_lo = jnp.int32(0)
  if st.window is not None:
    hi = _ceil_div(jnp.minimum(k_last + st.window - st.offset, st.t), block_q)
    full_hi = _floor_div(k_first + st.window - st.offset, block_q)  # Blocks whose last query still sees k_first.
  else:
    hi = full_hi = jnp.int32(real_blocks)
  hi = jnp.minimum(hi, real_blocks)
  # A block holding padded keys needs the length mask everywhere.
  full_hi = jnp.where(k_last < st.s, full_hi, full_lo)
  if st.has_segments:
    full_lo = full_hi = lo
  return _order(lo, full_lo, full_hi, hi)


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def visible(st: Static, q_index: jax.Array, k_index: jax.Array, q_segment=None, kv_segment=None) -> jax.Array:
  """[bq, bk] bool visibility of one tile.

  Args:
    q_index: [bq, 1] int32 query indices (rows of the padded array).
    k_index: [1, bk] int32 key indices.
    q_segment: [bq] int32 or None.
    kv_segment: [bk] int32 or None.
  """
  mask = None

  def both(a, b):
    return b if a is None else a & b

  if st.causal:
    q_pos = q_index + st.offset
    mask = both(mask, k_index <= q_pos)
    if st.window is not None:
      mask = both(mask, q_pos - k_index < st.window)
  if st.s_pad > st.s:
    mask = both(mask, k_index < st.s)
  if st.has_segments:
    mask = both(mask, q_segment[:, None] == kv_segment[None, :])
  assert mask is not None, "an unmasked call has no masked steps"
  return jnp.broadcast_to(mask, (q_index.shape[0], k_index.shape[1]))
