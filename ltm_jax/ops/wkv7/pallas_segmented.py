"""Segmented Pallas backend of the RWKV-7 WKV op: the chunked kernels parallel over time (`pallas/wkv7_segmented.py`)
where the chunked kernels' own grid leaves most of a GPU idle, and the "pallas_chunked" backend everywhere else.

The chunked kernels run B·H·N/BV programs (BV: the forward's value rows per program), each walking all T tokens.
Fewer programs than the GPU has SMs leave SMs idle and make every program's serial walk the whole time: at
(B, T, H, N) = (1, 32768, 64, 64) that is 64 programs on an H100's 132 SMs. This backend then cuts the sequence into
S segments (`segments`): the fewest (a power of two) that give at least PROGRAMS_PER_SM programs per SM, each
segment at least MIN_SEGMENT tokens long. S = 8 at that shape: 512 programs of 4096 tokens, the grid of the chunked
kernels at (8, 4096, 64, 64). Shapes where the rule gives S = 1 (enough programs, or a short sequence) run
"pallas_chunked" unchanged. The extra passes (each segment's end state and transition forward, the state gradients
backward) and their cost, estimated and measured on an H100, are in docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax

from ltm_jax.ops.wkv7 import pallas_chunked
from ltm_pallas import wkv7_chunked as chunked
from ltm_pallas import wkv7_segmented as segmented

# An H100 SXM's streaming multiprocessors (the machine the kernels were measured on).
SM_COUNT = 132
# Programs per SM the segmented grid aims for: the chunked kernels' measured fast shape, (8, 4096, 64, 64) bf16, runs
# 512 programs (3.9 per SM) at 2.36 ms forward against 6.78 ms for the same tokens as 64 programs of 32768.
PROGRAMS_PER_SM = 3
# Shortest segment: each segment adds an [N, N] scan step and its transition; 1024 tokens keep them under 1/64 of
# the segment's own work.
MIN_SEGMENT = 1024


def segments(batch: int, length: int, heads: int, size: int, dtype) -> int:
  """How many segments the backend cuts a [B, T, H, N] sequence into: 1 (run the chunked kernels as they are) when
  the chunked forward's B·H·N/BV programs fill SM_COUNT SMs or T < 2·MIN_SEGMENT; else the fewest power of two S
  with B·H·N/BV·S >= PROGRAMS_PER_SM·SM_COUNT and T/S >= MIN_SEGMENT."""
  operands = chunked.operand_dtype(dtype)
  if not chunked.fits(size, operands):
    return 1
  return segment_count(batch * heads * (size // min(chunked.settings(size, operands)["forward_block"], size)), length)


def segment_count(programs: int, length: int) -> int:
  """The segments for a grid of `programs` programs each walking `length` tokens: 1 when they fill SM_COUNT SMs or
  T < 2·MIN_SEGMENT; else the fewest power of two S with programs·S >= PROGRAMS_PER_SM·SM_COUNT and
  T/S >= MIN_SEGMENT."""
  if programs >= SM_COUNT:
    return 1
  count = 1
  while programs * count < PROGRAMS_PER_SM * SM_COUNT and length // (2 * count) >= MIN_SEGMENT:
    count *= 2
  return count


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    w_min: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """WKV-7 by the segmented kernels when `segments` > 1 and w is in the chunked kernels' range, the sequential kernels
  out of range, and the "pallas_chunked" backend when `segments` is 1; shapes are validated by the caller.

  Arguments and results as `ltm_jax.ops.wkv7.wkv7` (`w_min` as there: a bound within the range skips the run-time
  check)."""
  count = segments(*r.shape, r.dtype)
  if count == 1:
    return pallas_chunked.wkv7(r, w, k, v, a, b, state, w_min=w_min)
  return pallas_chunked.in_range_or_sequential(functools.partial(segmented.wkv7, segments=count),
                                               r, w, k, v, a, b, state, w_min=w_min)
