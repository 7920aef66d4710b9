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
  """Tile sizes (powers of two, >= 16 for Triton's tl.dot) and Triton launch settings.

  The defaults are reasoned, not tuned: no GPU was available when they were written (see benchmarks/attention.py).
  Each size is cut down to the sequence length's next power of two, so short sequences do not pad to 128.

  Attributes:
    fwd_q, fwd_k: query rows per program and keys per inner step of the forward kernel.
    bwd_q, bwd_k: the same for both backward kernels (dq: a program per query block; dk/dv: one per key block).
    num_warps: None picks 4 for head dims <= 64 and 8 above.
    fwd_stages, bwd_stages: Triton software-pipelining depth of the inner loops.
  """

  fwd_q: int = 128
  fwd_k: int = 64
  bwd_q: int = 64
  bwd_k: int = 64
  num_warps: int | None = None
  fwd_stages: int = 3
  bwd_stages: int = 2

  def __post_init__(self):
    for name in ("fwd_q", "fwd_k", "bwd_q", "bwd_k"):
      size = getattr(self, name)
      if size < 16 or size & (size - 1):
        raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {size}")


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
  bwd_q: int
  bwd_k: int
  num_warps: int
  fwd_stages: int
  bwd_stages: int
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
