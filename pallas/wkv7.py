"""Fused Pallas kernels for the RWKV-7 WKV recurrence (forward and backward) and their custom_vjp.

Per (batch, head), with S the [N, N] float32 state (row i = value index, column j = key index):

  sa = S a_t;   S <- S·diag(e^{w_t}) + sa b_t^T + v_t k_t^T;   y_t = S r_t

Rows of S never interact (row i needs only sa_i, its own dot product with a), so a program may own a block of BV rows.

Forward: grid (B, H, N / BV). Each program keeps its [BV, N] block of S in registers and walks the sequence one token
at a time (load r, w, k, a, b [N] and v [BV]; three rank-1 updates and two row reductions; store y [BV]). Every
`chunk` tokens it stores the block to a checkpoint buffer [B, H, T / chunk, N, N] float32, the only residual the
backward needs besides the inputs. Bytes per token and head: 6 inputs read + y written, plus 4·N² / chunk of
checkpoint (N = 64, chunk = 16: 1 KiB per token-head of checkpoints against 896 B of bf16 inputs and output).

Backward: grid (B, H, N / BV), chunks in reverse. The adjoint of the step above, with dS the gradient of S after t:

  dS += dy_t r_t^T;          dr_t = S_t^T dy_t
  dv_t = dS k_t;             dk_t = dS^T v_t
  dsa = dS b_t;              db_t = dS^T sa;       dw_t = e^{w_t} ⊙ colsum(dS ⊙ S_{t-1});   da_t = S_{t-1}^T dsa
  dS <- dS·diag(e^{w_t}) + dsa a_t^T                                   (the gradient of S_{t-1})

It needs S_{t-1} at every step in reverse. Inverting the step (dividing by e^w, as the official RWKV-7 CUDA kernel
does) loses everything once decays are strong, so instead each S_{t-1} is recomputed forwards from its chunk's
checkpoint: chunk·(chunk - 1)/2 extra forward steps per chunk, exact for any w <= 0. The key-side gradients
(dr, dw, dk, da, db) sum over value rows, so with N / BV > 1 blocks each program writes float32 partial sums that
XLA adds up afterwards; dv and the incoming state's gradient are block-local.

The value-block sizes and chunk length below are not tuned by timing. On one H100 (bfloat16, (B, T, C, N) =
(8, 4096, 4096, 64)) these kernels took 10.7 ms forward and 75.6 ms forward+backward, the tensor-core chunked kernels
of pallas/wkv7_chunked.py 2.4 ms and 12.3 ms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ltm_pallas import backend


def _step(s, r_t, w_t, k_t, v_t, a_t, b_t):
  """One token on a [BV, N] block of S: returns (sa [BV], the block after the token). Vectors are [N], v_t [BV]."""
  sa = jnp.sum(s * a_t[None, :], axis=1)
  s_new = s * jnp.exp(w_t)[None, :] + sa[:, None] * b_t[None, :] + v_t[:, None] * k_t[None, :]
  return sa, s_new


def _load_token(refs, t, v_ref):
  """Token t of r, w, k, a, b ([N], float32) and of the block's values ([BV])."""
  r, w, k, a, b = (ref[t].astype(jnp.float32) for ref in refs)
  return r, w, k, v_ref[t].astype(jnp.float32), a, b


def _forward_kernel(r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, y_ref, *state_refs, chunk):
  """Outputs y and, with checkpoints, the state at every chunk start (what the backward replays from); then the final
  state. Without them (the primal, also run as the forward pass under remat) nothing is written but y and the state."""
  ckpt_ref, s_out_ref = state_refs if len(state_refs) == 2 else (None, state_refs[0])
  num_chunks = r_ref.shape[0] // chunk
  keys = (r_ref, w_ref, k_ref, a_ref, b_ref)

  def token(t, s):
    r, w, k, v, a, b = _load_token(keys, t, v_ref)
    _, s = _step(s, r, w, k, v, a, b)
    y_ref[t] = jnp.sum(s * r[None, :], axis=1).astype(y_ref.dtype)
    return s

  def one_chunk(c, s):
    if ckpt_ref is not None:
      ckpt_ref[c] = s
    start = c * chunk
    return jax.lax.fori_loop(start, start + chunk, token, s)

  s_out_ref[...] = jax.lax.fori_loop(0, num_chunks, one_chunk, s0_ref[...].astype(jnp.float32))


def _backward_kernel(
    r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, ckpt_ref, dy_ref, ds_out_ref,
    dr_ref, dw_ref, dk_ref, dv_ref, da_ref, db_ref, ds0_ref, *, chunk):
  num_chunks = r_ref.shape[0] // chunk
  keys = (r_ref, w_ref, k_ref, a_ref, b_ref)

  def replay(t, s):
    r, w, k, v, a, b = _load_token(keys, t, v_ref)
    return _step(s, r, w, k, v, a, b)[1]

  def token(c, i, ds):
    start = c * chunk
    t = start + chunk - 1 - i
    s_prev = jax.lax.fori_loop(start, t, replay, ckpt_ref[c])  # S_{t-1}, from the chunk's checkpoint.
    r, w, k, v, a, b = _load_token(keys, t, v_ref)
    sa, s = _step(s_prev, r, w, k, v, a, b)
    dy = dy_ref[t].astype(jnp.float32)
    ds = ds + dy[:, None] * r[None, :]
    dsa = jnp.sum(ds * b[None, :], axis=1)
    decay = jnp.exp(w)
    dr_ref[t] = jnp.sum(s * dy[:, None], axis=0)
    dv_ref[t] = jnp.sum(ds * k[None, :], axis=1).astype(dv_ref.dtype)
    dk_ref[t] = jnp.sum(ds * v[:, None], axis=0)
    db_ref[t] = jnp.sum(ds * sa[:, None], axis=0)
    dw_ref[t] = decay * jnp.sum(ds * s_prev, axis=0)
    da_ref[t] = jnp.sum(s_prev * dsa[:, None], axis=0)
    return ds * decay[None, :] + dsa[:, None] * a[None, :]

  def one_chunk(i, ds):  # Chunks last to first, tokens within each last to first.
    return jax.lax.fori_loop(0, chunk, functools.partial(token, num_chunks - 1 - i), ds)

  ds0_ref[...] = jax.lax.fori_loop(0, num_chunks, one_chunk, ds_out_ref[...].astype(jnp.float32))


def _specs(length, size, block, num_chunks):
  """BlockSpecs over grid (B, H, N / BV): whole [T, N] sequences of one (batch, head), the block's [T, BV] values,
  the block's [BV, N] state rows and its [T / chunk, BV, N] checkpoints."""
  seq = pl.BlockSpec((None, length, None, size), lambda b, h, j: (b, 0, h, 0))
  seq_block = pl.BlockSpec((None, length, None, block), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, block, size), lambda b, h, j: (b, h, j, 0))
  ckpt = pl.BlockSpec((None, None, num_chunks, block, size), lambda b, h, j: (b, h, 0, j, 0))
  return seq, seq_block, state, ckpt


# Value rows per program when not given. Forward: rows are independent, so smaller blocks only add programs (B·H·N/32
# of them, enough to fill a GPU at B·H = 512) and re-read the shared key vectors from cache. Backward: more than one
# block per head makes float32 partial sums of five gradients, so blocks stay as large as registers allow.
# Not tuned by timing.
FORWARD_BLOCK, BACKWARD_BLOCK = 32, 64


def _num_warps(block: int, size: int) -> int:
  """Enough threads that each [BV, N] float32 block takes at most 16 registers per thread."""
  return max(4, min(16, block * size // (32 * 16)))


def _value_block(size: int, block: int) -> int:
  block = min(block, size)
  if size % block:
    raise ValueError(f"wkv7 pallas: value_block {block} must divide N = {size}")
  return block


def _forward(r, w, k, v, a, b, state, *, chunk, block, interpret, checkpoints=True):
  """(y, checkpoints [B, H, T / chunk, N, N] float32 or None when not asked for, final state)."""
  batch, length, heads, size = r.shape
  num_chunks = length // chunk
  seq, seq_block, state_spec, ckpt_spec = _specs(length, size, block, num_chunks)
  ckpt_shape = jax.ShapeDtypeStruct((batch, heads, num_chunks, size, size), jnp.float32)
  outputs = backend.call(
      functools.partial(_forward_kernel, chunk=chunk),
      out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),) + ((ckpt_shape,) if checkpoints else ())
      + (jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),),
      grid=(batch, heads, size // block),
      in_specs=[seq, seq, seq, seq_block, seq, seq, state_spec],
      out_specs=[seq_block] + ([ckpt_spec] if checkpoints else []) + [state_spec],
      num_warps=_num_warps(block, size),
      interpret=interpret,
      name="wkv7_forward" if checkpoints else "wkv7_forward_primal",
  )(r, w, k, v, a, b, state)
  return (outputs[0], outputs[1], outputs[2]) if checkpoints else (outputs[0], None, outputs[1])


def _backward(r, w, k, v, a, b, ckpt, dy, ds_out, *, chunk, block, interpret):
  batch, length, heads, size = r.shape
  num_chunks = length // chunk
  blocks = size // block
  seq, seq_block, state_spec, ckpt_spec = _specs(length, size, block, num_chunks)
  partial = pl.BlockSpec((None, None, length, None, size), lambda b, h, j: (j, b, 0, h, 0))
  partial_shape = jax.ShapeDtypeStruct((blocks, batch, length, heads, size), jnp.float32)
  dr, dw, dk, dv, da, db, ds0 = backend.call(
      functools.partial(_backward_kernel, chunk=chunk),
      out_shape=(
          partial_shape, partial_shape, partial_shape,
          jax.ShapeDtypeStruct(v.shape, jnp.float32),
          partial_shape, partial_shape,
          jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),
      ),
      grid=(batch, heads, blocks),
      in_specs=[seq, seq, seq, seq_block, seq, seq, ckpt_spec, seq_block, state_spec],
      out_specs=[partial, partial, partial, seq_block, partial, partial, state_spec],
      num_warps=_num_warps(block, size),
      interpret=interpret,
      name="wkv7_backward",
  )(r, w, k, v, a, b, ckpt, dy, ds_out)
  dr, dw, dk, da, db = (x.sum(axis=0) for x in (dr, dw, dk, da, db))
  return dr, dw, dk, dv, da, db, ds0


# Both WKV-7 backends that use Pallas name themselves: impl='pallas_chunked' runs the sequential kernels too.
_SECOND_ORDER = ("wkv7: impl='pallas' and impl='pallas_chunked' (the Pallas WKV-7 kernels) have no second "
                 "derivative; impl='scan' and impl='chunked' are differentiable to any order")


@functools.lru_cache(maxsize=None)
def _fused(chunk: int, forward_block: int, backward_block: int, interpret: bool | None, optimize_remat: bool):
  """The custom_vjp function for one static configuration (inputs' T must be a multiple of `chunk`)."""

  @jax.custom_vjp
  def run(r, w, k, v, a, b, state):
    y, _, final = _forward(r, w, k, v, a, b, state, chunk=chunk, block=forward_block, interpret=interpret,
                           checkpoints=False)
    return y, final

  def run_fwd(r, w, k, v, a, b, state):
    r, w, k, v, a, b, state = backend.first_order_only(_SECOND_ORDER, r, w, k, v, a, b, state)
    y, ckpt, final = _forward(r, w, k, v, a, b, state, chunk=chunk, block=forward_block, interpret=interpret)
    return (y, final), (r, w, k, v, a, b, ckpt)

  def run_bwd(residuals, cotangents):
    residuals, cotangents = backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
    *inputs, ckpt = residuals
    dy, ds_out = cotangents
    grads = _backward(*inputs, ckpt, dy, ds_out.astype(jnp.float32), chunk=chunk, block=backward_block,
                      interpret=interpret)
    *dinputs, ds0 = grads
    return (*(g.astype(x.dtype) for g, x in zip(dinputs, inputs)), ds0)  # The state is always float32 here.

  # Under jax.checkpoint the forward pass then runs the primal (no checkpoints written) and only the recomputation in
  # the backward pass runs run_fwd (jax#21303: otherwise both write them).
  run.defvjp(run_fwd, run_bwd, optimize_remat=optimize_remat)
  return run


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    chunk: int = 16,
    forward_block: int = FORWARD_BLOCK,
    backward_block: int = BACKWARD_BLOCK,
    interpret: bool | None = None,
    optimize_remat: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Fused WKV-7, differentiable in every argument.

  Args:
    r, w, k, v, a, b: [B, T, H, N], any float dtype, any T; N a power of two (Triton blocks), w <= 0.
    state: [B, H, N, N] float32, the state before the first token.
    chunk: tokens between forward checkpoints (the backward replays up to chunk - 1 tokens per step).
    forward_block, backward_block: value rows per program (BV, a power of two; min(BV, N) must divide N).
    interpret: force the Pallas interpreter (None: interpret unless on a GPU).
    optimize_remat: under jax.checkpoint, run the checkpoint-free primal forward and write checkpoints only in the
      backward pass's recomputation. False writes them in both passes (jax#21303), which jax needs inside a
      shard_map under remat and nested scans, where its dead-code elimination of the optimised form fails.

  Returns:
    y [B, T, H, N] in v's dtype, and the final state [B, H, N, N] float32.
  """
  batch, length, heads, size = r.shape
  forward_block, backward_block = _value_block(size, forward_block), _value_block(size, backward_block)
  pad = -length % chunk
  if pad:  # Zero tokens are identity steps (e^0 = 1, no rank-1 terms) and read out y = 0; sliced off below.
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    r, w, k, v, a, b = (widen(x) for x in (r, w, k, v, a, b))
  y, final = _fused(chunk, forward_block, backward_block, interpret, optimize_remat)(r, w, k, v, a, b, state.astype(jnp.float32))
  return y[:, :length], final
