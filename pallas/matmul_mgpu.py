"""A matmul with a fused elementwise epilogue as a Pallas Mosaic GPU kernel for Hopper (sm_90+).

For a [M, K] and b [K, G, N] (bfloat16, G groups of weight columns) the kernel accumulates acc_g = a @ b[:, g, :] in
float32 and hands the accumulator tiles, with tiles of extra [M, E_i, N] inputs at the same position, to a
caller-given elementwise function whose results are stored as outputs [M, O_j, N]. XLA fuses neither a "diamond"
epilogue (relu(z)^2 next to z, silu(gate) * up) nor one reading other arrays into its GEMMs; here the epilogue costs
no memory pass beyond reading the extras and writing the outputs once.

Layout. Grid (M / BM, N / BN), each program owning one [BM, BN] output tile (its n index varies fastest, so
programs running together share a's rows and b stays in L2). K runs in K / BK steps through a ring of `stages`
shared-memory slots: each step's a tile [BM, BK] and G b tiles [BK, BN] come in by TMA into the next free slot while
earlier steps' wgmmas run; a step's G wgmmas (bfloat16 operands from shared memory, float32 accumulators in
registers) stay in flight until the next step's are issued (`delay_release=1`), when the older step's slot is
refilled. The extras' tiles are requested by TMA before the K loop, so they arrive during it. Two forms (`form`):
  "pipelined":         one warpgroup (128 threads) a program issues the loads and the wgmmas (`plgpu.emit_pipeline`)
                       and runs the epilogue on its [BM, BN] tile.
  "warp_specialized":  three warpgroups (384 threads, `plgpu.emit_pipeline_warp_specialized`): a producer that only
                       issues the TMA loads, a slot ahead of the consumers by barriers, its registers lowered to 40 a
                       thread; two consumers (registers raised to 232) each owning half the rows, [BM / 2, BN], with
                       their own wgmmas (on their half of the a slot and the shared b slots), extras and epilogue. While
                       one consumer waits on its wgmmas the other issues its own, and neither spends issue slots on
                       the operand loads. The tiles are the pipelined form's: a [2 x 128, BN] tile would hold twice
                       the extras' and outputs' tiles in shared memory and leave at most 2 slots at the models'
                       shapes.

Epilogue. The accumulators are read into registers once; the epilogue runs on [64, 64] pieces of them (the wgmma
instruction height by one 128-byte swizzle column), with the extras' pieces read from shared memory beside them, so
few float32 values are live beyond the accumulators themselves. Each piece's results go to the outputs' tiles in
shared memory, cast to their dtypes, and the whole tiles leave by TMA. The epilogue must be elementwise: it sees
pieces, not whole tiles.

Tiles (`tiles`). BM = 128, BK = 64 (128 bytes of bfloat16: one swizzle span, the K step of one TMA box). BN = 128 for
one group (the [128, 128] float32 accumulator: 128 registers a thread), 64 for two (two [128, 64] accumulators,
again 128); where the extras' and outputs' tiles leave fewer than 3 pipeline slots at BN = 128 within Hopper's
shared memory, BN = 64. Stages: as many as fit, at most 4.

Registers, spills and shared memory of both forms at the models' shapes, compiled for sm_90a without a GPU, are
checked by tests/ops/test_matmul_mgpu.py (`make test-long`) and listed in docs/kernels.md. Nothing here has run on a
GPU: neither form's speed is measured.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend

BLOCK_M = 128  # Rows of an output tile: two wgmma instruction heights.
BLOCK_K = 64  # K per pipeline step: 128 bytes of bfloat16, one swizzle span.
PIECE = 64  # The epilogue's pieces are [PIECE, PIECE].
MAX_STAGES = 4
FORMS = ("pipelined", "warp_specialized")
CONSUMERS = 2  # form "warp_specialized": consumer warpgroups, each owning BM / 2 rows of the output tile.
# form "warp_specialized": the producer's registers a thread after `plgpu.set_max_registers` (it only issues TMA); the
# consumers get (512 - 40) / 2 rounded down to a multiple of 8 = 232 (emit_pipeline_warp_specialized's split).
PRODUCER_REGISTERS = 40
GROUPS = (1, 2)
OPERANDS = jnp.bfloat16
EXTRA_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Shared memory a block may take on Hopper (227 KiB), less a margin for the barriers, alignment and Mosaic GPU's own
# scratch.
SMEM_BUDGET = 232448 - 8192


def _block_n(groups: int) -> int:
  """BN by default: the G accumulators [BM, BN] float32 take 128 registers a thread together."""
  return 128 if groups == 1 else 64


def supported(m: int, k: int, n: int, groups: int, form: str = "pipelined") -> bool:
  """Whether the default tiles divide [M, K] @ [K, G, N]: M a multiple of 128, K of 64 and at least 128 (two K steps:
  a step's wgmmas stay in flight until the next step's are issued), N of 128 (G = 1) or 64 (G = 2). Both forms use
  the same tiles."""
  return form in FORMS and groups in GROUPS and m > 0 and n > 0 and m % BLOCK_M == 0 and k >= 2 * BLOCK_K and \
      k % BLOCK_K == 0 and n % _block_n(groups) == 0


def tiles(groups: int, extras: Sequence[tuple[int, object]], outs: Sequence[tuple[int, object]]) -> tuple[int, int]:
  """(BN, stages) for G groups, extras and outputs given as (tiles, dtype) pairs: the default BN where it leaves at
  least 3 pipeline slots in shared memory beside the extras' and outputs' tiles, else 64; as many slots as fit, at most
  MAX_STAGES (`matmul_epilogue` refuses fewer than 2)."""
  def fit(bn):
    fixed = sum(count * BLOCK_M * bn * jnp.dtype(dtype).itemsize for count, dtype in (*extras, *outs))
    step = (BLOCK_M * BLOCK_K + groups * BLOCK_K * bn) * jnp.dtype(OPERANDS).itemsize
    return min(MAX_STAGES, (SMEM_BUDGET - fixed) // step)

  bn = _block_n(groups)
  if fit(bn) < 3 and bn > PIECE:
    bn = PIECE
  return bn, fit(bn)


def _smem(shape, dtype):
  """A shared-memory buffer in the layout wgmma and TMA use: (8, 128-byte) tiles, 128-byte swizzle."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.SMEM(shape, dtype, transforms=_transforms(dtype))


def _transforms(dtype):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def _split_refs(refs, num_extras, num_outs):
  """(extras, outputs, extras' tiles, outputs' tiles, barrier) from a kernel's refs after a and b."""
  extra_refs, out_refs = refs[:num_extras], refs[num_extras:num_extras + num_outs]
  extra_s = refs[num_extras + num_outs:2 * num_extras + num_outs]
  out_s = refs[2 * num_extras + num_outs:2 * num_extras + 2 * num_outs]
  return extra_refs, out_refs, extra_s, out_s, refs[-1] if num_extras else None


def _load_extras(extra_refs, extra_s, extra_counts, rows, columns, barrier):
  """Requests the extras' tiles [E_i, rows, BN] by TMA; they arrive on `barrier` while the K loop runs."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  for ref, tile, count in zip(extra_refs, extra_s, extra_counts):
    for e in range(count):
      plgpu.copy_gmem_to_smem(ref.at[rows, columns(e)], tile.at[e], barrier)


def _finish(values, extra_s, out_s, out_refs, rows, columns, barrier, *, epilogue, extra_counts, out_counts):
  """The epilogue on [PIECE, PIECE] pieces of the accumulator values [R, BN] (float32, one per group) and the extras'
  tiles [E_i, R, BN] in shared memory (once `barrier` says they arrived); the results go, cast, to the outputs' tiles
  [O_j, R, BN] in shared memory and leave by TMA for `rows` and `columns(o)` of the outputs."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  if extra_counts:
    plgpu.barrier_wait(barrier)
  height, width = values[0].shape
  layout = plgpu.Layout.WGMMA
  for i in range(height // PIECE):
    for j in range(width // PIECE):
      piece = (slice(i * PIECE, (i + 1) * PIECE), slice(j * PIECE, (j + 1) * PIECE))
      at = (pl.ds(i * PIECE, PIECE), pl.ds(j * PIECE, PIECE))
      accs = tuple(v[piece] for v in values)
      extras = tuple(tuple(plgpu.load(tile.at[e].at[at], layout=layout) for e in range(count))
                     for tile, count in zip(extra_s, extra_counts))
      results = _checked(epilogue(accs, *extras), out_counts)
      for tile, result in zip(out_s, results):
        for o, x in enumerate(result):
          tile.at[o][at] = x.astype(tile.dtype)
  plgpu.commit_smem()
  for ref, tile, count in zip(out_refs, out_s, out_counts):
    for o in range(count):
      plgpu.copy_smem_to_gmem(tile.at[o], ref.at[rows, columns(o)])
  plgpu.wait_smem_to_gmem(0)


def _operand_specs(m_index, n_index, groups, block_n, n_blocks, delay_release):
  """Block specs of a's [BM, BK] tile and the G b tiles [BK, BN] at K step k."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  specs = [plgpu.BlockSpec((BLOCK_M, BLOCK_K), lambda k: (m_index, k), transforms=_transforms(OPERANDS),
                           delay_release=delay_release)]
  for g in range(groups):
    specs.append(plgpu.BlockSpec((BLOCK_K, block_n), lambda k, g=g: (k, g * n_blocks + n_index),
                                 transforms=_transforms(OPERANDS), delay_release=delay_release))
  return specs


def _columns(n_index, n_blocks, block_n, group):
  """Group `group`'s columns of output tile n_index in a [., G * N] view (N = n_blocks * block_n)."""
  return pl.ds((group * n_blocks + n_index) * block_n, block_n)


def _kernel(a_ref, b_ref, *refs, epilogue, groups, extra_counts, out_counts, block_n, stages, width):
  """form "pipelined", one program: the [BM, BN] output tile at (m, n), one warpgroup. refs: the extras [M, E_i * N],
  the outputs [M, O_j * N] (both 2-D views, group e's columns at e * N), then the shared-memory tiles [E_i, BM, BN] of
  each extra and [O_j, BM, BN] of each output and the extras' barrier (when there are extras). a_ref [M, K],
  b_ref [K, G * N]; width: N."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  extra_refs, out_refs, extra_s, out_s, barrier = _split_refs(refs, len(extra_counts), len(out_counts))
  m_index, n_index = jax.lax.axis_index("m"), jax.lax.axis_index("n")
  rows = pl.ds(m_index * BLOCK_M, BLOCK_M)
  n_blocks = width // block_n
  columns = functools.partial(_columns, n_index, n_blocks, block_n)

  _load_extras(extra_refs, extra_s, extra_counts, rows, columns, barrier)

  def run(*accs):
    def step(_, a_s, *b_s):
      for acc, b in zip(accs, b_s):
        plgpu.wgmma(acc, a_s, b)
      plgpu.wgmma_wait(groups)  # The previous step's wgmmas are done: its slot may be refilled.

    steps = a_ref.shape[1] // BLOCK_K
    plgpu.emit_pipeline(step, grid=(steps,), in_specs=_operand_specs(m_index, n_index, groups, block_n, n_blocks, 1),
                        max_concurrent_steps=min(stages, steps))(a_ref, *([b_ref] * groups))
    plgpu.wgmma_wait(0)
    return tuple(acc[...] for acc in accs)

  values = pl.run_scoped(run, *(plgpu.ACC((BLOCK_M, block_n), jnp.float32) for _ in range(groups)))
  _finish(values, extra_s, out_s, out_refs, rows, columns, barrier, epilogue=epilogue, extra_counts=extra_counts,
          out_counts=out_counts)


def _kernel_ws(a_ref, b_ref, *refs, epilogue, groups, extra_counts, out_counts, block_n, stages, width):
  """form "warp_specialized", one program: the [BM, BN] output tile at (m, n), three warpgroups. The last ("wg" 2)
  only issues the TMA loads of a's and b's tiles into the ring of `stages` slots; consumers 0 and 1 each own half the
  rows, [BM / 2, BN], and run the wgmmas, the extras' loads and the epilogue of their half. refs as `_kernel`'s, but
  the extras' and outputs' tiles are [2, E_i or O_j, BM / 2, BN] (one half per consumer) and the extras' barriers two
  (one per consumer)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  extra_refs, out_refs, extra_s, out_s, barrier = _split_refs(refs, len(extra_counts), len(out_counts))
  m_index, n_index, wg = jax.lax.axis_index("m"), jax.lax.axis_index("n"), jax.lax.axis_index("wg")
  half = BLOCK_M // CONSUMERS
  n_blocks = width // block_n
  columns = functools.partial(_columns, n_index, n_blocks, block_n)

  def step(_, a_s, *b_s_and_carry):
    *b_s, carry = b_s_and_carry  # carry: this consumer's accumulators.
    a_half = a_s.at[pl.ds(wg * half, half)]
    for acc, b in zip(carry, b_s):
      plgpu.wgmma(acc, a_half, b)
    # The previous step's wgmmas are done: the pipeline (delay_release=1) tells the producer its slot is free.
    plgpu.wgmma_wait(groups)
    return carry

  def consumer(pipeline):
    """Runs in the consumers only: extras requested, the K loop, then the epilogue of this consumer's half."""
    rows = pl.ds(m_index * BLOCK_M + wg * half, half)
    mine = lambda tiles: [t.at[wg] for t in tiles]
    extra_barrier = barrier.at[wg] if extra_counts else None
    _load_extras(extra_refs, mine(extra_s), extra_counts, rows, columns, extra_barrier)

    def run(*accs):
      pipeline(accs)
      plgpu.wgmma_wait(0)
      return tuple(acc[...] for acc in accs)

    values = pl.run_scoped(run, *(plgpu.ACC((half, block_n), jnp.float32) for _ in range(groups)))
    _finish(values, mine(extra_s), mine(out_s), out_refs, rows, columns, extra_barrier, epilogue=epilogue,
            extra_counts=extra_counts, out_counts=out_counts)

  steps = a_ref.shape[1] // BLOCK_K
  plgpu.emit_pipeline_warp_specialized(
      step, grid=(steps,), memory_registers=PRODUCER_REGISTERS, wg_axis="wg", num_compute_wgs=CONSUMERS,
      in_specs=_operand_specs(m_index, n_index, groups, block_n, n_blocks, 1),
      max_concurrent_steps=min(stages, steps), compute_context=consumer)(a_ref, *([b_ref] * groups))


def _checked(results, out_counts):
  """The epilogue's results as a tuple of tuples, checked against the outputs' group counts."""
  if not isinstance(results, (tuple, list)) or len(results) != len(out_counts) or any(
      not isinstance(r, (tuple, list)) or len(r) != c for r, c in zip(results, out_counts)):
    raise ValueError(f"matmul_epilogue: the epilogue must return {len(out_counts)} tuples of {list(out_counts)} "
                     f"tiles (one per output), got {jax.tree.structure(results)}")
  return results


def _build(m, k, n, groups, extras, outs, epilogue, form, interpreted: bool):
  """The kernel for a [M, K], b [K, G * N], extras [(E_i, dtype)] and outputs [(O_j, dtype)] in `form`: interpreted
  on the CPU (Mosaic GPU interpret mode) or compiled."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  block_n, stages = tiles(groups, extras, outs)
  # The extras' and outputs' tiles, [count, BM, BN]; split in halves, one per consumer, in the warp-specialised form.
  shape = (lambda count: (count, BLOCK_M, block_n)) if form == "pipelined" else (
      lambda count: (CONSUMERS, count, BLOCK_M // CONSUMERS, block_n))
  scratch = [_smem(shape(count), dtype) for count, dtype in (*extras, *outs)]
  if extras:
    scratch.append(plgpu.Barrier(num_arrivals=sum(count for count, _ in extras),
                                 num_barriers=1 if form == "pipelined" else CONSUMERS))
  out_type = tuple(jax.ShapeDtypeStruct((m, count * n), dtype) for count, dtype in outs)
  threads = {} if form == "pipelined" else dict(num_threads=CONSUMERS + 1, thread_name="wg")
  body = functools.partial(_kernel if form == "pipelined" else _kernel_ws, epilogue=epilogue, groups=groups,
                           extra_counts=tuple(c for c, _ in extras), out_counts=tuple(c for c, _ in outs),
                           block_n=block_n, stages=stages, width=n)
  params = dict(interpret=plgpu.InterpretGPUParams()) if interpreted else dict(compiler_params=plgpu.CompilerParams())
  # The last grid axis is CUDA's x, the fastest: n.
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(m // BLOCK_M, n // block_n),
                      grid_names=("m", "n"), **threads, **params)


def matmul_epilogue(a: jax.Array, b: jax.Array, extras: Sequence[jax.Array] = (), *,
                    epilogue: Callable[..., tuple], out_dtypes: Sequence[tuple[object, int]],
                    interpret: bool | None = None, form: str = "pipelined") -> tuple[jax.Array, ...]:
  """Outputs [M, O_j, N] of `epilogue` applied to acc_g = a @ b[:, g, :] (float32) and the extras.

  a: [M, K] bfloat16; b: [K, G, N] bfloat16 (G = 1 or 2); extras: arrays [M, E_i, N], bfloat16 or float32.
  epilogue(accs, *extras) -> outputs: accs a tuple of G float32 tiles, each extra a tuple of its E_i tiles (in its
    dtype), all of one shape and at the same position; returns one tuple per output of O_j tiles (any float dtype).
    It must be elementwise (the kernel calls it on [64, 64] pieces of each output tile).
  out_dtypes: one (dtype, O_j) pair per output, dtype bfloat16, float16 or float32.
  interpret: None for `backend.mosaic_gpu_call`'s default (compiled where the default backend is a GPU, interpreted
    elsewhere).
  form: "pipelined" (one warpgroup a tile) or "warp_specialized" (a TMA producer and two wgmma consumers a tile); the
    same tiles, results and rounding.
  Shapes: `supported(M, K, N, G)`; anything else raises ValueError.
  """
  if form not in FORMS:
    raise ValueError(f"matmul_epilogue: form must be one of {FORMS}, got {form!r}")
  extras = tuple(extras)
  if a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[0]:
    raise ValueError(f"matmul_epilogue: a must be [M, K] and b [K, G, N], got {a.shape} and {b.shape}")
  (m, k), (_, groups, n) = a.shape, b.shape
  if a.dtype != OPERANDS or b.dtype != OPERANDS:
    raise ValueError(f"matmul_epilogue: a and b must be bfloat16, got {a.dtype} and {b.dtype}")
  if not supported(m, k, n, groups):
    raise ValueError(f"matmul_epilogue: shape M {m}, K {k}, N {n}, G {groups} not supported: G in {GROUPS}, M a "
                     f"multiple of {BLOCK_M}, K of {BLOCK_K} and >= {2 * BLOCK_K}, N of "
                     f"{_block_n(groups) if groups in GROUPS else 128}")
  for x in extras:
    if x.ndim != 3 or x.shape[0] != m or x.shape[2] != n or x.dtype not in EXTRA_DTYPES:
      raise ValueError(f"matmul_epilogue: extras must be [M, E, N] = [{m}, E, {n}] bfloat16 or float32, got "
                       f"{x.shape} {x.dtype}")
  outs = tuple((int(count), jnp.dtype(dtype)) for dtype, count in out_dtypes)
  if not outs or any(count < 1 or dtype not in OUT_DTYPES for count, dtype in outs):
    raise ValueError(f"matmul_epilogue: out_dtypes must be (dtype, groups >= 1) pairs, dtype bfloat16, float16 or "
                     f"float32, got {tuple(out_dtypes)}")
  extra_spec = tuple((x.shape[1], x.dtype) for x in extras)
  if tiles(groups, extra_spec, outs)[1] < 2:
    raise ValueError(f"matmul_epilogue: the extras' and outputs' tiles {extra_spec + outs} leave no room for the "
                     "pipeline in shared memory")
  run = backend.mosaic_gpu_call(functools.partial(_build, m, k, n, groups, extra_spec, outs, epilogue, form), interpret)
  with jax.named_scope("matmul_epilogue"):  # Names the kernel in the compiled program (benchmarks/step_budget.py).
    results = run(a, b.reshape(k, groups * n), *(x.reshape(m, -1) for x in extras))
  return tuple(r.reshape(m, count, n) for r, (count, _) in zip(results, outs))
