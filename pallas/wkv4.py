"""Pallas kernels for the RWKV-4 WKV recurrence: a fused forward, a fused backward, and a `jax.custom_vjp` tying them.

Per batch row and channel, from the state (a_0, b_0) = (num_0·e^{max_0}, den_0·e^{max_0}):

  y_t = (a_{t-1} + e^{u+k_t}·v_t) / (b_{t-1} + e^{u+k_t}),   a_t = e^w·a_{t-1} + e^{k_t}·v_t,   b_t: v = 1.

The state is carried as (num, den) on a log-scale mx = anchor + n·w (anchor: the key or incoming max that last set
the scale; n: whole decay steps since), so every exponential sees a non-positive argument and the scale does not
drift by one rounding per token. Arithmetic is float32 whatever the dtype of k and v.

Kernels (grid over batch rows and blocks of `block_c` channels; time is split into chunks of `chunk` tokens):
  forward:   one pass over T per program, reads k, v; writes y and the state at every chunk boundary
             (num, den, anchor, n: four [B, T/chunk + 1, C] arrays, the last row the final state). Compiled, the
             tokens of a chunk are unrolled over [block_c] rows loaded before the chunk runs, and the next chunk's
             2·chunk rows are loaded before the current chunk is computed: each thread (one channel) has a chunk of
             loads in flight instead of waiting one memory latency per token (2.6x faster on an H100). Interpreted,
             a fori_loop loads each token's rows (`unroll`).
  forward primal: the same pass writing y and the final state only (four [B, C] arrays). It is the custom_vjp's
             primal: inference, and the forward pass under jax.checkpoint, where the backward's recomputation runs
             the checkpointing forward (`optimize_remat`; jax#21303: otherwise both would write checkpoints).
  backward:  one reverse pass over the chunks per program. Inside a chunk it recomputes the forward states from the
             chunk's checkpoint (kept in a [chunk, block_c] register tile), then walks the chunk backwards carrying
             the adjoint of (a, b) on the same log-scale. It reads k, v, dy and writes dk, dv; y is recomputed in
             float32 rather than read. dw, du are per-(batch, channel) partial sums reduced outside.
  time-parallel (`parallel=True`, for small B·C): the forward becomes chunk summaries (each chunk from an empty
             state, grid over chunks too), a short `lax.scan` over chunks giving every chunk's incoming state, and
             a second pass producing y (the incoming states it reads are the backward's checkpoints, so the
             primal runs the same kernels); the backward likewise computes each chunk's adjoint contribution, scans
             them in reverse, and recomputes dk, dv per chunk.

Bytes per element of [B, T, C] (s = itemsize of k, v): forward reads k, v and writes y, 3s, plus 16/chunk for the
checkpoints (the primal: none); backward reads k, v, dy and writes dk, dv, 5s, plus 16/chunk. bfloat16, chunk 16: 7
and 11 bytes.

Lowering: through `ltm_pallas.backend.call`, i.e. Triton on GPU (jax 0.10.2 and 0.11.x; the Triton backend is deprecated
from 0.11; `pallas/backend.py` chooses the lowering, and without it the op's XLA backends run) and `interpret=True` on CPU.
Triton constraints honoured here: every loaded or stored value is a power-of-two [block_c] row or [chunk, block_c]
tile, loops are `lax.fori_loop` (or Python loops over fixed rows in the unrolled forward), and the backward selects
rows of its register tiles by a one-hot mask (Triton cannot index a register tensor dynamically).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend

# An empty state's log-scale: e^{EMPTY_MAX - x} is exactly 0 and no inf - inf can make a NaN.
EMPTY_MAX = -1e38
CHUNK = 16
BLOCK_C = 64
NUM_WARPS = 2


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


# ----------------------------------------------------------------------------------------------------------------
# One token, forward and backward, on [block_c] float32 rows.


def _token_output(u, k, v, num, den, mx):
  """y_t and the pieces the backward reuses, from the state (num, den) on log-scale mx before the token."""
  uk = u + k
  p = jnp.maximum(mx, uk)
  e_state, e_tok = jnp.exp(mx - p), jnp.exp(uk - p)
  # 0 only for a token of weight 0 on an empty state (left padding): y = 0 there, and its gradients finite.
  den_hat = e_state * den + e_tok
  den_hat = jnp.where(den_hat > 0, den_hat, 1.0)
  y = (e_state * num + e_tok * v) / den_hat
  return y, e_state, e_tok, den_hat


def _token_state(w, k, v, num, den, anchor, n):
  """The state after the token; `decayed` is the log-scale of the old state one step on."""
  decayed = anchor + (n + 1).astype(jnp.float32) * w
  keep = decayed >= k
  mx = jnp.where(keep, decayed, k)
  e_state, e_tok = jnp.exp(decayed - mx), jnp.exp(k - mx)
  num, den = e_state * num + e_tok * v, e_state * den + e_tok
  return num, den, jnp.where(keep, anchor, k), jnp.where(keep, n + 1, 0)


def _scale(anchor, n, w):
  return anchor + n.astype(jnp.float32) * w


# ----------------------------------------------------------------------------------------------------------------
# Forward.


def _load_chunk(k_ref, v_ref, row0, chunk):
  """Rows [row0, row0 + chunk) of k and v as float32 [block_c] rows: (k rows, v rows), `chunk` of each.

  The 2·chunk loads are independent of the recurrence and issued together, so a thread has them all in flight at once
  instead of waiting one memory latency per token.
  """
  k = tuple(k_ref[row0 + i, :].astype(jnp.float32) for i in range(chunk))
  v = tuple(v_ref[row0 + i, :].astype(jnp.float32) for i in range(chunk))
  return k, v


def _run_chunk_forward(c, carry, w, u, k_ref, v_ref, y_ref, *, chunk, length, row0, rows=None):
  """Runs tokens [c·chunk, (c+1)·chunk) from `carry` = (num, den, anchor, n); tokens past `length` leave it as is.

  The refs hold the chunk from row `row0` on (0 for a chunk-sized block, c·chunk for the whole sequence); y goes to
  y_ref when it is not None. With `rows`, the chunk's k, v rows from `_load_chunk`, the tokens are unrolled (the
  compiled form); without, a fori_loop loads each token's rows as it runs (the interpreted form: a trace `chunk`
  times smaller).
  """

  def token(i, carry):
    num, den, anchor, n = carry
    if rows is None:
      k, v = (ref[row0 + i, :].astype(jnp.float32) for ref in (k_ref, v_ref))
    else:
      k, v = rows[0][i], rows[1][i]
    if y_ref is not None:
      y, *_ = _token_output(u, k, v, num, den, _scale(anchor, n, w))
      y_ref[row0 + i, :] = y.astype(y_ref.dtype)
    new = _token_state(w, k, v, num, den, anchor, n)
    if length % chunk == 0:  # No chunk holds a padding token.
      return new
    return tuple(jnp.where(c * chunk + i < length, a, b) for a, b in zip(new, carry))

  if rows is None:
    return jax.lax.fori_loop(0, chunk, token, carry)
  for i in range(chunk):
    carry = token(i, carry)
  return carry


def _forward_kernel(w_ref, u_ref, k_ref, v_ref, num0_ref, den0_ref, max0_ref, *refs, chunk, length, n_chunks,
                    checkpoints, unroll):
  """Grid (B, C/block_c): the whole sequence of one batch row and channel block.

  Writes y and the state (num, den, anchor, n): with `checkpoints`, into [T/chunk + 1, block_c] refs at every chunk
  boundary, the last row the final state; without, the final state only, into [block_c] refs. With `unroll`, the
  k, v rows of the next chunk are loaded before the current chunk is computed (the last chunk reloads itself), so
  their memory latency overlaps a chunk of arithmetic.
  """
  y_ref, num_ref, den_ref, anchor_ref, n_ref = refs[-5:]  # Leading refs, if any, are poisoned aliases of these.
  w, u = w_ref[...], u_ref[...]

  def chunk_body(c, carry):
    state, rows = carry
    if checkpoints:
      num_ref[c, :], den_ref[c, :], anchor_ref[c, :], n_ref[c, :] = state
    ahead = _load_chunk(k_ref, v_ref, jnp.minimum(c + 1, n_chunks - 1) * chunk, chunk) if unroll else None
    state = _run_chunk_forward(c, state, w, u, k_ref, v_ref, y_ref, chunk=chunk, length=length, row0=c * chunk,
                               rows=rows)
    return state, ahead

  init = (num0_ref[...], den0_ref[...], max0_ref[...], jnp.zeros(w.shape, jnp.int32))
  first = _load_chunk(k_ref, v_ref, 0, chunk) if unroll else None
  final, _ = jax.lax.fori_loop(0, n_chunks, chunk_body, (init, first))
  if checkpoints:
    num_ref[n_chunks, :], den_ref[n_chunks, :], anchor_ref[n_chunks, :], n_ref[n_chunks, :] = final
  else:
    num_ref[...], den_ref[...], anchor_ref[...], n_ref[...] = final


def _chunk_summary_kernel(w_ref, k_ref, v_ref, *refs, chunk, length, unroll):
  """Grid (B, C/block_c, n_chunks): one chunk from an empty state, its state at the chunk's end."""
  num_ref, den_ref, anchor_ref, n_ref = refs[-4:]
  c = pl.program_id(2)
  w = w_ref[...]
  empty = (jnp.zeros(w.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32),
           jnp.full(w.shape, EMPTY_MAX, jnp.float32), jnp.zeros(w.shape, jnp.int32))
  rows = _load_chunk(k_ref, v_ref, 0, chunk) if unroll else None
  final = _run_chunk_forward(c, empty, w, None, k_ref, v_ref, None, chunk=chunk, length=length, row0=0, rows=rows)
  num_ref[...], den_ref[...], anchor_ref[...], n_ref[...] = final


def _chunk_output_kernel(w_ref, u_ref, k_ref, v_ref, num_ref, den_ref, anchor_ref, n_ref, *refs, chunk, length,
                         unroll):
  """Grid (B, C/block_c, n_chunks): y of one chunk from its incoming state."""
  y_ref = refs[-1]
  c = pl.program_id(2)
  carry = (num_ref[...], den_ref[...], anchor_ref[...], n_ref[...])
  rows = _load_chunk(k_ref, v_ref, 0, chunk) if unroll else None
  _run_chunk_forward(c, carry, w_ref[...], u_ref[...], k_ref, v_ref, y_ref, chunk=chunk, length=length, row0=0,
                     rows=rows)


# ----------------------------------------------------------------------------------------------------------------
# Backward.


def _one_hot_rows(chunk, width):
  return jax.lax.broadcasted_iota(jnp.int32, (chunk, width), 0)


def _run_chunk_backward(c, state, adjoint, w, u, k_ref, v_ref, dy_ref, dk_ref, dv_ref, *, chunk, length, row0):
  """Backpropagates through tokens [c·chunk, (c+1)·chunk) given the state before them.

  `adjoint` = (ga, gb, gm, dw, du): ga, gb are the adjoints of (a, b) after the chunk times e^{mx} (their own
  log-scale, so they neither overflow nor underflow), gm the adjoint of the final state's max still flowing back
  through decay steps, and dw, du running sums. Returns the same five before the chunk; dk_ref, dv_ref get the rows
  (when not None).
  """
  width = w.shape[0]
  rows = _one_hot_rows(chunk, width)
  zero_tile = jnp.zeros((chunk, width), jnp.float32)

  # Replay the chunk forwards, keeping the state before every token (num, den, log-scale) and the decayed
  # log-scale (whose comparison with k decided the re-anchoring) in register tiles.
  def replay(i, carry):
    (num, den, anchor, n), tiles = carry
    t, row = c * chunk + i, row0 + i
    k = k_ref[row, :].astype(jnp.float32)
    v = v_ref[row, :].astype(jnp.float32)
    decayed = anchor + (n + 1).astype(jnp.float32) * w
    row = (num, den, _scale(anchor, n, w), decayed)
    tiles = tuple(jnp.where(rows == i, r[None, :], tile) for r, tile in zip(row, tiles))
    new = _token_state(w, k, v, num, den, anchor, n)
    new = tuple(jnp.where(t < length, a, b) for a, b in zip(new, (num, den, anchor, n)))
    return new, tiles

  _, tiles = jax.lax.fori_loop(0, chunk, replay, (state, (zero_tile,) * 4))

  def token(j, adjoint):
    ga, gb, gm, dw, du = adjoint
    i = chunk - 1 - j
    t, row = c * chunk + i, row0 + i
    num, den, mx, decayed = (jnp.sum(jnp.where(rows == i, tile, 0.0), axis=0) for tile in tiles)
    k = k_ref[row, :].astype(jnp.float32)
    v = v_ref[row, :].astype(jnp.float32)
    dy = dy_ref[row, :].astype(jnp.float32)
    y, e_state, e_tok, den_hat = _token_output(u, k, v, num, den, mx)
    keep = decayed >= k
    mx_after = jnp.where(keep, decayed, k)
    decay, e_key = jnp.exp(decayed - mx_after), jnp.exp(k - mx_after)
    q = dy / den_hat  # dy_t / (b_{t-1} + e^{u+k_t}), times e^p.
    q_tok = q * e_tok
    dy_du = q_tok * (v - y)
    dk = dy_du + e_key * (ga * v + gb) + jnp.where(keep, 0.0, gm)
    dv = q_tok + ga * e_key
    if dk_ref is not None:
      dk_ref[row, :] = dk.astype(dk_ref.dtype)
      dv_ref[row, :] = dv.astype(dv_ref.dtype)
    new = (
        ga * decay + q * e_state,
        gb * decay - q * y * e_state,
        jnp.where(keep, gm, 0.0),
        dw + decay * (ga * num + gb * den) + jnp.where(keep, gm, 0.0),
        du + dy_du,
    )
    return tuple(jnp.where(t < length, a, b) for a, b in zip(new, adjoint))

  return jax.lax.fori_loop(0, chunk, token, adjoint)


def _backward_kernel(w_ref, u_ref, k_ref, v_ref, dy_ref, num_ref, den_ref, anchor_ref, n_ref, gnum_ref, gden_ref,
                     gmax_ref, num0_ref, den0_ref, *refs, chunk, length, n_chunks):
  """Grid (B, C/block_c): the whole sequence backwards, chunk by chunk from the forward's checkpoints."""
  dk_ref, dv_ref, dw_ref, du_ref, dnum0_ref, dden0_ref, dmax0_ref = refs[-7:]
  w, u = w_ref[...], u_ref[...]
  gnum, gden = gnum_ref[...], gden_ref[...]
  # The final (num, den, max) = (a·e^{-M}, b·e^{-M}, M): a and b get gnum·e^{-M}, gden·e^{-M}, and what is left of
  # M's cotangent flows back along the path that set M.
  gm = gmax_ref[...] - gnum * num_ref[n_chunks, :] - gden * den_ref[n_chunks, :]
  zeros = jnp.zeros(w.shape, jnp.float32)

  def chunk_body(j, adjoint):
    c = n_chunks - 1 - j
    state = (num_ref[c, :], den_ref[c, :], anchor_ref[c, :], n_ref[c, :])
    return _run_chunk_backward(c, state, adjoint, w, u, k_ref, v_ref, dy_ref, dk_ref, dv_ref, chunk=chunk,
                               length=length, row0=c * chunk)

  ga, gb, gm, dw, du = jax.lax.fori_loop(0, n_chunks, chunk_body, (gnum, gden, gm, zeros, zeros))
  dw_ref[...], du_ref[...] = dw, du
  dnum0_ref[...], dden0_ref[...] = ga, gb
  dmax0_ref[...] = ga * num0_ref[...] + gb * den0_ref[...] + gm


def _chunk_adjoint_kernel(w_ref, u_ref, k_ref, v_ref, dy_ref, num_ref, den_ref, anchor_ref, n_ref, *refs, chunk,
                          length):
  """Grid (B, C/block_c, n_chunks): the adjoint before one chunk with none after it (the backward's chunk summary).

  The adjoint before a chunk is linear in the one after it, so with zero after it this is the chunk's own part; a
  unit gm coming in tells whether the max path crosses the chunk (1) or ends in it (0).
  """
  ga_ref, gb_ref, crosses_ref = refs[-3:]
  c = pl.program_id(2)
  w, u = w_ref[...], u_ref[...]
  state = (num_ref[...], den_ref[...], anchor_ref[...], n_ref[...])
  zeros = jnp.zeros(w.shape, jnp.float32)
  adjoint = (zeros, zeros, jnp.ones(w.shape, jnp.float32), zeros, zeros)
  ga, gb, gm, _, _ = _run_chunk_backward(c, state, adjoint, w, u, k_ref, v_ref, dy_ref, None, None, chunk=chunk,
                                         length=length, row0=0)
  ga_ref[...], gb_ref[...], crosses_ref[...] = ga, gb, gm


def _chunk_grads_kernel(w_ref, u_ref, k_ref, v_ref, dy_ref, num_ref, den_ref, anchor_ref, n_ref, ga_ref, gb_ref,
                        gm_ref, *refs, chunk, length):
  """Grid (B, C/block_c, n_chunks): dk, dv of one chunk and its dw, du sums, given the adjoint after it."""
  dk_ref, dv_ref, dw_ref, du_ref = refs[-4:]
  c = pl.program_id(2)
  w, u = w_ref[...], u_ref[...]
  state = (num_ref[...], den_ref[...], anchor_ref[...], n_ref[...])
  zeros = jnp.zeros(w.shape, jnp.float32)
  adjoint = (ga_ref[...], gb_ref[...], gm_ref[...], zeros, zeros)
  _, _, _, dw, du = _run_chunk_backward(c, state, adjoint, w, u, k_ref, v_ref, dy_ref, dk_ref, dv_ref, chunk=chunk,
                                        length=length, row0=0)
  dw_ref[...], du_ref[...] = dw, du


# ----------------------------------------------------------------------------------------------------------------
# pallas_call builders. Arrays arrive padded: T to a multiple of `chunk`, C to a multiple of `block_c`.

# Below this many batch-row channels the (B, C/block_c) grid leaves most of a GPU idle and the time-parallel path is
# taken: 16384 = 8 rows x 2048 channels = 256 programs of 64 channels, about two per SM of an H100/H200. A design
# choice, not tuned by timing.
PARALLEL_BELOW = 16384


def _poisoned(out_shape):
  """Buffers that alias the outputs, filled with NaN (floats) or the most negative int: what is never written stays."""
  fill = lambda s: jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else jnp.iinfo(s.dtype).min,
                            s.dtype)
  return [fill(s) for s in out_shape]


def _forms(kernel, unroll):
  """(kernel, compiled_kernel) for `_call` of a forward kernel: the rolled form where it is interpreted and the unrolled
  one where it is compiled, unless `unroll` fixes one form for both."""
  if unroll is None:
    return functools.partial(kernel, unroll=False), functools.partial(kernel, unroll=True)
  return functools.partial(kernel, unroll=unroll), None


def _call(kernel, args, in_specs, out_shape, out_specs, grid, *, poison, interpret, name, compiled_kernel=None):
  """backend.call, optionally with every output aliased to a poisoned input (the kernel sees those refs first)."""
  kwargs = {}
  if poison:
    extra = _poisoned(out_shape)
    kwargs["input_output_aliases"] = {len(args) + i: i for i in range(len(extra))}
    args = [*args, *extra]
    in_specs = [*in_specs, *out_specs]
  return backend.call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                      num_warps=NUM_WARPS, num_stages=2, interpret=interpret, name=name,
                      compiled_kernel=compiled_kernel, **kwargs)(*args)


class _Specs:
  """BlockSpecs over a (B, C/block_c) grid, or (B, C/block_c, n_chunks) with `per_chunk`."""

  def __init__(self, t, block_c, chunk, per_chunk):
    sq = pl.squeezed
    if per_chunk:
      self.vec = pl.BlockSpec((block_c,), lambda b, c, j: (c,))
      self.row = pl.BlockSpec((sq, block_c), lambda b, c, j: (b, c))
      self.seq = pl.BlockSpec((sq, chunk, block_c), lambda b, c, j: (b, j, c))
      self.chunk_row = pl.BlockSpec((sq, sq, block_c), lambda b, c, j: (b, j, c))
    else:
      self.vec = pl.BlockSpec((block_c,), lambda b, c: (c,))
      self.row = pl.BlockSpec((sq, block_c), lambda b, c: (b, c))
      self.seq = pl.BlockSpec((sq, t, block_c), lambda b, c: (b, 0, c))
      self.chunk_rows = lambda rows: pl.BlockSpec((sq, rows, block_c), lambda b, c: (b, 0, c))


def _forward_sequential(w, u, k, v, state, *, length, chunk, block_c, checkpoints=True, poison=False,
                        interpret=None, unroll=None):
  """y [B, T, C] and the state (num, den, anchor, n): with `checkpoints`, the checkpoints, each [B, T/chunk + 1, C],
  the last row the final state; without, the final state only, each [B, C]."""
  batch, t, channels = k.shape
  n_chunks = t // chunk
  specs = _Specs(t, block_c, chunk, per_chunk=False)
  rows, spec = ((batch, n_chunks + 1, channels), specs.chunk_rows(n_chunks + 1)) if checkpoints else (
      (batch, channels), specs.row)
  state_out = jax.ShapeDtypeStruct(rows, jnp.float32)
  out_shape = [jax.ShapeDtypeStruct(k.shape, v.dtype)] + [state_out] * 3 + [state_out.update(dtype=jnp.int32)]
  kernel, compiled = _forms(functools.partial(_forward_kernel, chunk=chunk, length=length, n_chunks=n_chunks,
                                              checkpoints=checkpoints), unroll)
  y, *states = _call(kernel, [w, u, k, v, *state], [specs.vec, specs.vec, specs.seq, specs.seq] + [specs.row] * 3,
                     out_shape, [specs.seq] + [spec] * 4, (batch, channels // block_c), poison=poison,
                     interpret=interpret, name="wkv4_forward" if checkpoints else "wkv4_forward_primal",
                     compiled_kernel=compiled)
  return y, tuple(states)


def _combine_chunks(w, summaries, state, counts):
  """Every chunk's incoming state from the chunk summaries: a `lax.scan` over chunks on [B, C] rows.

  `summaries` are the per-chunk (num, den, anchor, n) from an empty state, each [B, n_chunks, C]; counts [n_chunks]
  the valid tokens per chunk. Returns the checkpoints [B, n_chunks + 1, C], the first row the incoming state.
  """

  def step(carry, xs):
    num, den, anchor, n = carry
    s_num, s_den, s_anchor, s_n, count = xs
    n_on = n + count
    decayed, local = _scale(anchor, n_on, w), _scale(s_anchor, s_n, w)
    keep = decayed >= local
    mx = jnp.where(keep, decayed, local)
    e_old, e_new = jnp.exp(decayed - mx), jnp.exp(local - mx)
    new = (e_old * num + e_new * s_num, e_old * den + e_new * s_den, jnp.where(keep, anchor, s_anchor),
           jnp.where(keep, n_on, s_n))
    return new, new

  num0, den0, max0 = state
  init = (num0, den0, max0, jnp.zeros(num0.shape, jnp.int32))
  xs = tuple(jnp.moveaxis(s, 1, 0) for s in summaries) + (counts,)
  _, after = jax.lax.scan(step, init, xs)
  return tuple(jnp.concatenate([i[:, None], jnp.moveaxis(a, 0, 1)], axis=1) for i, a in zip(init, after))


def _chunk_counts(t, length, chunk):
  return jnp.clip(length - chunk * jnp.arange(t // chunk, dtype=jnp.int32), 0, chunk)


def _forward_parallel(w, u, k, v, state, *, length, chunk, block_c, poison=False, interpret=None, unroll=None):
  """As `_forward_sequential`, parallel over chunks too: summaries, a scan over chunks, then y per chunk."""
  batch, t, channels = k.shape
  n_chunks = t // chunk
  grid = (batch, channels // block_c, n_chunks)
  specs = _Specs(t, block_c, chunk, per_chunk=True)
  summary = jax.ShapeDtypeStruct((batch, n_chunks, channels), jnp.float32)
  kernel, compiled = _forms(functools.partial(_chunk_summary_kernel, chunk=chunk, length=length), unroll)
  summaries = _call(
      kernel, [w, k, v], [specs.vec, specs.seq, specs.seq], [summary] * 3 + [summary.update(dtype=jnp.int32)],
      [specs.chunk_row] * 4, grid, poison=poison, interpret=interpret, name="wkv4_chunk_summary",
      compiled_kernel=compiled)
  ckpts = _combine_chunks(w, summaries, state, _chunk_counts(t, length, chunk))
  kernel, compiled = _forms(functools.partial(_chunk_output_kernel, chunk=chunk, length=length), unroll)
  y = _call(
      kernel, [w, u, k, v, *ckpts], [specs.vec, specs.vec, specs.seq, specs.seq] + [specs.chunk_row] * 4,
      [jax.ShapeDtypeStruct(k.shape, v.dtype)], [specs.seq], grid, poison=poison, interpret=interpret,
      name="wkv4_chunk_output", compiled_kernel=compiled)[0]
  return y, ckpts


def _backward_sequential(w, u, k, v, dy, ckpts, state, g_final, *, length, chunk, block_c, poison=False,
                         interpret=None):
  """(dk, dv, dw [B, C], du [B, C], (dnum0, dden0, dmax0)); dw and du still to be summed over B."""
  batch, t, channels = k.shape
  n_chunks = t // chunk
  specs = _Specs(t, block_c, chunk, per_chunk=False)
  row = jax.ShapeDtypeStruct((batch, channels), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)] + [row] * 5
  kernel = functools.partial(_backward_kernel, chunk=chunk, length=length, n_chunks=n_chunks)
  num0, den0, _ = state
  dk, dv, dw, du, *dstate = _call(
      kernel, [w, u, k, v, dy, *ckpts, *g_final, num0, den0],
      [specs.vec] * 2 + [specs.seq] * 3 + [specs.chunk_rows(n_chunks + 1)] * 4 + [specs.row] * 5,
      out_shape, [specs.seq] * 2 + [specs.row] * 5, (batch, channels // block_c), poison=poison,
      interpret=interpret, name="wkv4_backward")
  return dk, dv, dw, du, tuple(dstate)


def _backward_parallel(w, u, k, v, dy, ckpts, state, g_final, *, length, chunk, block_c, poison=False,
                       interpret=None):
  """As `_backward_sequential`, parallel over chunks: chunk adjoints, a reverse scan over chunks, then dk, dv."""
  batch, t, channels = k.shape
  n_chunks = t // chunk
  grid = (batch, channels // block_c, n_chunks)
  specs = _Specs(t, block_c, chunk, per_chunk=True)
  before = tuple(c[:, :-1] for c in ckpts)  # The state before every chunk.
  summary = jax.ShapeDtypeStruct((batch, n_chunks, channels), jnp.float32)
  in_specs = [specs.vec] * 2 + [specs.seq] * 3 + [specs.chunk_row] * 4
  own_ga, own_gb, crosses = _call(
      functools.partial(_chunk_adjoint_kernel, chunk=chunk, length=length), [w, u, k, v, dy, *before], in_specs,
      [summary] * 3, [specs.chunk_row] * 3, grid, poison=poison, interpret=interpret, name="wkv4_chunk_adjoint")

  # The adjoint after every chunk, from the last chunk backwards. Across chunk c, (ga, gb) decay by the product of
  # its per-token decays, which telescopes to e^{mx_before + count·w - mx_after}.
  scale = _scale(ckpts[2], ckpts[3], w)  # [B, n_chunks + 1, C]
  counts = _chunk_counts(t, length, chunk).astype(jnp.float32)
  decay = jnp.exp(scale[:, :-1] + counts[None, :, None] * w - scale[:, 1:])
  g_num, g_den, g_max = g_final
  gm_final = g_max - g_num * ckpts[0][:, -1] - g_den * ckpts[1][:, -1]

  def step(after, xs):
    ga, gb, gm = after
    d, o_ga, o_gb, cross = xs
    return (ga * d + o_ga, gb * d + o_gb, gm * cross), after

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (decay, own_ga, own_gb, crosses))
  (ga0, gb0, gm0), after = jax.lax.scan(step, (g_num, g_den, gm_final), xs, reverse=True)
  after = tuple(jnp.moveaxis(a, 0, 1) for a in after)

  seq_out = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  dk, dv, dw, du = _call(
      functools.partial(_chunk_grads_kernel, chunk=chunk, length=length), [w, u, k, v, dy, *before, *after],
      in_specs + [specs.chunk_row] * 3, seq_out + [summary] * 2, [specs.seq] * 2 + [specs.chunk_row] * 2, grid,
      poison=poison, interpret=interpret, name="wkv4_chunk_grads")
  num0, den0, _ = state
  dstate = (ga0, gb0, ga0 * num0 + gb0 * den0 + gm0)
  return dk, dv, dw.sum(axis=1), du.sum(axis=1), dstate


# ----------------------------------------------------------------------------------------------------------------
# Padding and the custom_vjp.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static sizes (hashable: a custom_vjp static argument): padded T and C, channel block, time-parallel or not."""
  length: int
  channels: int
  chunk: int
  block_c: int
  t: int
  c: int
  parallel: bool
  unroll: bool | None

  @classmethod
  def make(cls, batch, length, channels, chunk, block_c, parallel, unroll=None):
    if chunk < 1 or chunk & (chunk - 1) or block_c < 1 or block_c & (block_c - 1):
      raise ValueError(f"wkv4: chunk and block_c must be powers of two; got {chunk}, {block_c}")
    block_c = min(block_c, _next_pow2(channels))
    t = _round_up(length, chunk)
    if parallel is None:
      parallel = batch * channels < PARALLEL_BELOW and t // chunk >= 4
    return cls(length, channels, chunk, block_c, t, _round_up(channels, block_c), bool(parallel), unroll)

  def kwargs(self):
    return {"length": self.length, "chunk": self.chunk, "block_c": self.block_c}

  def pad_seq(self, x):
    return jnp.pad(x, ((0, 0), (0, self.t - x.shape[1]), (0, self.c - x.shape[2])))

  def pad_channels(self, x, value):
    """Padded channels get finite values (w = -1, den = 1) so that nothing there turns into a NaN."""
    pad = [(0, 0)] * (x.ndim - 1) + [(0, self.c - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=value)

  def pad_params(self, w, u, state):
    num0, den0, max0 = (s.astype(jnp.float32) for s in state)
    return (self.pad_channels(w.astype(jnp.float32), -1.0), self.pad_channels(u.astype(jnp.float32), 0.0),
            (self.pad_channels(num0, 0.0), self.pad_channels(den0, 1.0), self.pad_channels(max0, 0.0)))


def _forward(w, u, k, v, state, layout, interpret, checkpoints=True):
  """(y, final state (num, den, max), checkpoints for the backward or None when not asked for).

  Without `checkpoints` the sequential path runs the primal kernel, which writes the final state alone. The
  time-parallel path computes every chunk's incoming state either way (the second pass reads them) and returns them
  only when asked for.
  """
  w_p, u_p, state_p = layout.pad_params(w, u, state)
  k_p, v_p = layout.pad_seq(k), layout.pad_seq(v)
  if layout.parallel:
    y, ckpts = _forward_parallel(w_p, u_p, k_p, v_p, state_p, interpret=interpret, unroll=layout.unroll,
                                 **layout.kwargs())
    last = tuple(x[:, -1] for x in ckpts)
  elif checkpoints:
    y, ckpts = _forward_sequential(w_p, u_p, k_p, v_p, state_p, interpret=interpret, unroll=layout.unroll,
                                   **layout.kwargs())
    last = tuple(x[:, -1] for x in ckpts)
  else:
    y, last = _forward_sequential(w_p, u_p, k_p, v_p, state_p, checkpoints=False, interpret=interpret,
                                  unroll=layout.unroll, **layout.kwargs())
  c = layout.channels
  num, den, anchor, n = last
  final = (num[:, :c], den[:, :c], _scale(anchor, n, w_p)[:, :c])
  return y[:, :layout.length, :c], final, ckpts if checkpoints else None


_SECOND_ORDER = ("wkv4: impl='pallas' (the Pallas WKV-4 kernels) has no second derivative; impl='scan' and "
                 "impl='associative' are differentiable to any order")


@functools.lru_cache(maxsize=None)
def _differentiable(layout: "_Layout", interpret, optimize_remat: bool):
  """The kernels as one differentiable function of (w, u, k, v, state) for this layout."""

  @jax.custom_vjp
  def run(w, u, k, v, state):
    y, final, _ = _forward(w, u, k, v, state, layout, interpret, checkpoints=False)
    return y, final

  def run_fwd(w, u, k, v, state):
    w, u, k, v, state = backend.first_order_only(_SECOND_ORDER, w, u, k, v, state)
    y, final, ckpts = _forward(w, u, k, v, state, layout, interpret)
    return (y, final), (w, u, k, v, state, ckpts)

  def run_bwd(residuals, cotangents):
    residuals, cotangents = backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
    return _wkv4_bwd(layout, interpret, residuals, cotangents)

  # Under jax.checkpoint the forward pass then runs the primal (no checkpoints written) and only the recomputation in
  # the backward pass runs run_fwd (jax#21303: otherwise both write them).
  run.defvjp(run_fwd, run_bwd, optimize_remat=optimize_remat)
  return run


def _wkv4_bwd(layout, interpret, residuals, cotangents):
  w, u, k, v, state, ckpts = residuals
  dy, g_final = cotangents
  w_p, u_p, state_p = layout.pad_params(w, u, state)
  g_final = tuple(layout.pad_channels(g.astype(jnp.float32), 0.0) for g in g_final)
  run = _backward_parallel if layout.parallel else _backward_sequential
  dk, dv, dw, du, dstate = run(w_p, u_p, layout.pad_seq(k), layout.pad_seq(v), layout.pad_seq(dy.astype(v.dtype)),
                               ckpts, state_p, g_final, interpret=interpret, **layout.kwargs())
  c, t = layout.channels, layout.length
  dstate = tuple(d[:, :c].astype(s.dtype) for d, s in zip(dstate, state))
  return (dw.sum(axis=0)[:c].astype(w.dtype), du.sum(axis=0)[:c].astype(u.dtype), dk[:, :t, :c], dv[:, :t, :c],
          dstate)



def wkv4(
    w: jax.Array,
    u: jax.Array,
    k: jax.Array,
    v: jax.Array,
    state: tuple[jax.Array, jax.Array, jax.Array],
    *,
    chunk: int = CHUNK,
    block_c: int = BLOCK_C,
    parallel: bool | None = None,
    interpret: bool | None = None,
    unroll: bool | None = None,
    optimize_remat: bool = True,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
  """WKV-4 by the Pallas kernels, differentiable by the fused backward kernel.

  Args:
    w, u: [C] log-decay (negative) and current-token bonus.
    k, v: [B, T, C] keys and values, float32, bfloat16 or float16; any T >= 1 and C (padded inside).
    state: (num, den, max), each [B, C] float32: a = num·e^max, b = den·e^max before the first token.
    chunk: tokens per checkpoint (a power of two): the compiled forward unrolls a chunk's tokens and loads the next
      chunk's k, v rows ahead (2·chunk registers a thread), the backward keeps a [chunk, block_c] tile per state
      variable.
    block_c: channels per program (a power of two; clipped to C rounded up to one).
    parallel: parallelise over T as well; None decides by B·C (see PARALLEL_BELOW).
    interpret: None lets `ltm_pallas.backend` choose (interpret unless on GPU).
    unroll: the forward's form. None: unrolled with loads ahead where compiled, a fori_loop over tokens where
      interpreted (the same arithmetic; the unrolled trace is `chunk` times larger, which only slows the
      interpreter). True or False fixes one form for both (True lets the interpreter check the compiled form).
    optimize_remat: under jax.checkpoint, run the checkpoint-free primal forward and write checkpoints only in the
      backward pass's recomputation. False writes them in both passes (jax#21303), which jax needs inside a
      shard_map under remat and nested scans, where its dead-code elimination of the optimised form fails.

  Returns:
    y [B, T, C] in v's dtype and the state after the last token, (num, den, max) each [B, C] float32.
  """
  batch, length, channels = k.shape
  layout = _Layout.make(batch, length, channels, chunk, block_c, parallel, unroll)
  return _differentiable(layout, interpret, optimize_remat)(w, u, k, v, tuple(state))
