"""The chunked WKV-7 kernels parallel over time: a sequence cut into segments that run side by side.

One composition serves two kernel sets (`Kernels`): the chunked Triton kernels (`wkv7_chunked`, `chunked_kernels`,
`wkv7`) and the Mosaic GPU ones (`wkv7_mgpu`, `mgpu_kernels`, run by `run_segments`). Either runs one program per
(batch row, head, block of value rows), each walking the whole sequence. With few rows and heads (B·H·N/BV programs
below the GPU's SM count) most of the GPU idles while a few programs walk long sequences. Here the sequence of T tokens is cut into S segments of T/S tokens, folded into the
batch ([B, T, H, N] -> [B·S, T/S, H, N], a reshape), and the state entering each segment is found first.

Per (batch row, head), the state after a segment is affine in the state before it, value rows never interacting:

  S_end = S_start A_s + E_s,   A_s = ∏_t (diag(e^{w_t}) + a_t b_t^T)   ([N, N] per segment)

Forward:
  1. `end_states` from the given state for segment 0 and from zeros for the others (E_s; segment 0's is the state
     entering segment 1), and the transitions A_s (`end_states` without values, from the identity): no y, so a
     fraction of the chunked forward's products (see `benchmarks/wkv7.py`'s `_segmented_flops`).
  2. A scan over the segments (float32 [N, N] products): S_1 = E_0, S_{s+1} = S_s A_s + E_s.
  3. The chunked forward on every segment at once from its entering state: y, the chunk states the backward reads
     and the final state (segment S-1's).

Backward, with the same affine structure in reverse (the gradient of a segment's entering state is
dS_start = dS_end A_s^T + G_s, G_s its value from dS_end = 0, which depends only on dy and the key-side inputs):
  1. `state_gradients` with dS_end = 0 for segments 0..S-2 (G_s) and the final state's cotangent for segment S-1 (the
     gradient of the state entering it, that is leaving segment S-2).
  2. A reverse scan: dS_end[S-2] = G_{S-1}, dS_end[s-1] = dS_end[s] A_s^T + G_s.
  3. The chunked backward on every segment at once from its dS_end and the chunk states of forward step 3: the
     gradients of r, w, k, v, a, b (whole: the dS chain carries every later segment's dependence), and segment 0's
     entering state gradient, that of the given state.

The transitions A_s are the only residual beyond the chunked kernels' own (B·S·H·N² float32). Same range as the
chunked kernels (w >= min_log_decay(chunk)); the caller checks it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ltm_pallas import backend
from ltm_pallas import wkv7_chunked as chunked
from ltm_pallas import wkv7_mgpu as mgpu

_SECOND_ORDER = ("wkv7: impl='pallas_segmented' (the Pallas WKV-7 kernels) has no second derivative; impl='scan' "
                 "and impl='chunked' are differentiable to any order")


def _fold(x: jax.Array, segments: int) -> jax.Array:
  """[B, T, ...] -> [B·S, T/S, ...]: segment s of row b becomes row b·S + s."""
  return x.reshape(x.shape[0] * segments, x.shape[1] // segments, *x.shape[2:])


def _unfold(x: jax.Array, segments: int) -> jax.Array:
  """[B·S, T/S, ...] -> [B, T, ...], the inverse of `_fold`."""
  return x.reshape(x.shape[0] // segments, x.shape[1] * segments, *x.shape[2:])


def _by_segment(x: jax.Array, segments: int) -> jax.Array:
  """[B·S, ...] -> [S, B, ...]: per-segment states, segment first (the scans' axis)."""
  return jnp.swapaxes(x.reshape(x.shape[0] // segments, segments, *x.shape[1:]), 0, 1)


def _by_row(x: jax.Array) -> jax.Array:
  """[S, B, ...] -> [B·S, ...], the inverse of `_by_segment`."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _matmul(x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.matmul(x, y, precision=lax.Precision.HIGHEST)


def incoming_states(state: jax.Array, ends: jax.Array, transitions: jax.Array) -> jax.Array:
  """The states entering the segments [S, B, H, N, N]: `state`, then S_1 = E_0 and S_{s+1} = S_s A_s + E_s.

  ends: [S, B, H, N, N], E_0 the state after segment 0 from `state`, E_s (s >= 1) after segment s from zeros;
  transitions: [S, B, H, N, N], A_s (A_0 and A_{S-1} unused)."""

  def step(s, x):
    transition, end = x
    s = _matmul(s, transition) + end
    return s, s

  _, later = lax.scan(step, ends[0], (transitions[1:-1], ends[1:-1]))
  return jnp.concatenate([state[None], ends[:1], later], axis=0)


def outgoing_gradients(ds_final: jax.Array, starts: jax.Array, transitions: jax.Array) -> jax.Array:
  """The gradients of the states leaving the segments [S, B, H, N, N]: dS_end[S-1] = ds_final, dS_end[S-2] = G_{S-1},
  dS_end[s-1] = dS_end[s] A_s^T + G_s.

  starts: [S, B, H, N, N], G_{S-1} the gradient of the state entering segment S-1 given ds_final, G_s (s < S-1) that
  of segment s given zero; transitions: [S, B, H, N, N], A_s (A_0 and A_{S-1} unused)."""

  def step(g, x):
    transition, start = x
    g = _matmul(g, jnp.swapaxes(transition, -1, -2)) + start
    return g, g

  _, earlier = lax.scan(step, starts[-1], (transitions[1:-1], starts[1:-1]), reverse=True)
  return jnp.concatenate([earlier, starts[-1:], ds_final[None]], axis=0)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """The kernels a segmented run composes, each on the folded inputs [B·S, T/S, H, N] (T/S a multiple of `chunk`):

    end_states(w, k, v, a, b, state) -> the state after each row [B·S, H, N, N] from `state` before it; with k and v
      None, the rows' transitions applied to `state`;
    state_gradients(r, w, a, b, dy, ds, checkpoints) -> the gradient of the state before each row, given ds after
      it and the forward's checkpoints;
    forward(r, w, k, v, a, b, state, checkpoints) -> (y, the checkpoints (the backward's residuals) or None, the
      final states);
    backward(r, w, k, v, a, b, checkpoints, dy, ds) -> the gradients of r, w, k, v, a, b and the entering state.

  One instance per static configuration (`chunked_kernels`, `mgpu_kernels`): `_fused` caches on it."""
  chunk: int
  end_states: Callable
  state_gradients: Callable
  forward: Callable
  backward: Callable
  second_order: str = _SECOND_ORDER


@functools.lru_cache(maxsize=None)
def chunked_kernels(chunk: int, forward_block: int, backward_block: int, backward_loop: bool, forward_warps: int,
                    backward_warps: int, operands: str, interpret: bool | None) -> Kernels:
  """The chunked Triton kernels (`wkv7_chunked`) in one static configuration; the state-only passes take the
  forward's block and warps."""
  operands = jnp.dtype(operands)
  settings = dict(chunk=chunk, block=forward_block, warps=forward_warps, operands=operands, interpret=interpret)

  def forward(r, w, k, v, a, b, state, checkpoints):
    return chunked.forward(r, w, k, v, a, b, state, checkpoints=checkpoints, **settings)

  def state_gradients(r, w, a, b, dy, ds, checkpoints):
    del checkpoints  # These kernels make their decays and pair matrices from r, w, a, b themselves.
    return chunked.state_gradients(r, w, a, b, dy, ds, **settings)

  backward = functools.partial(chunked.backward, chunk=chunk, block=backward_block, loop=backward_loop,
                               warps=backward_warps, operands=operands, interpret=interpret)
  return Kernels(chunk, functools.partial(chunked.end_states, **settings), state_gradients, forward, backward)


_MGPU_SECOND_ORDER = ("wkv7: impl='pallas_mgpu' (a Mosaic GPU kernel) has no second derivative; impl='scan' and "
                      "impl='chunked' are differentiable to any order")


@functools.lru_cache(maxsize=None)
def mgpu_kernels(interpret: bool | None) -> Kernels:
  """The Mosaic GPU kernels (`wkv7_mgpu`: chunks of 64, each kernel's default load form), interpreted off GPU or
  not (`interpret`: None, unless compiling for a GPU)."""

  def forward(r, w, k, v, a, b, state, checkpoints):
    out = mgpu.forward(r, w, k, v, a, b, state, checkpoints=checkpoints, interpret=interpret)
    return out[0], out[2] if checkpoints else None, out[1]

  def state_gradients(r, w, a, b, dy, ds, residuals):
    del r, w, a, b  # The forward's residuals hold the decayed operands and log-decays.
    return mgpu.state_gradients(residuals, dy, ds, interpret=interpret)

  return Kernels(mgpu.CHUNK, functools.partial(mgpu.end_states, interpret=interpret), state_gradients, forward,
                 functools.partial(mgpu.backward, interpret=interpret), _MGPU_SECOND_ORDER)


@functools.lru_cache(maxsize=None)
def _fused(segments: int, kernels: Kernels, optimize_remat: bool):
  """The custom_vjp function for one static configuration (inputs' T a multiple of segments · kernels.chunk)."""

  def entering(r, w, k, v, a, b, state):
    """Folded inputs, the folded states entering the segments [B·S, H, N, N] and the transitions [S, B, H, N, N]."""
    del r
    w, k, v, a, b = (_fold(x, segments) for x in (w, k, v, a, b))
    batch, heads, size = state.shape[0], state.shape[1], state.shape[-1]
    starts = jnp.zeros((batch, segments, heads, size, size), jnp.float32).at[:, 0].set(state)
    ends = kernels.end_states(w, k, v, a, b, starts.reshape(-1, heads, size, size))
    identity = jnp.broadcast_to(jnp.eye(size, dtype=jnp.float32), (batch * segments, heads, size, size))
    transitions = _by_segment(kernels.end_states(w, None, None, a, b, identity), segments)
    return _by_row(incoming_states(state, _by_segment(ends, segments), transitions)), transitions

  def segmented_forward(r, w, k, v, a, b, state, checkpoints):
    starts, transitions = entering(r, w, k, v, a, b, state)
    folded = tuple(_fold(x, segments) for x in (r, w, k, v, a, b))
    y, ckpt, finals = kernels.forward(*folded, starts, checkpoints)
    return _unfold(y, segments), _by_segment(finals, segments)[-1], ckpt, transitions

  @jax.custom_vjp
  def run(r, w, k, v, a, b, state):
    y, final, _, _ = segmented_forward(r, w, k, v, a, b, state, checkpoints=False)
    return y, final

  def run_fwd(r, w, k, v, a, b, state):
    r, w, k, v, a, b, state = backend.first_order_only(kernels.second_order, r, w, k, v, a, b, state)
    y, final, ckpt, transitions = segmented_forward(r, w, k, v, a, b, state, checkpoints=True)
    return (y, final), (r, w, k, v, a, b, ckpt, transitions)

  def run_bwd(residuals, cotangents):
    residuals, cotangents = backend.first_order_only(kernels.second_order, residuals, cotangents)
    *inputs, ckpt, transitions = residuals
    dy, ds_final = cotangents
    dy, ds_final = _fold(dy.astype(inputs[3].dtype), segments), ds_final.astype(jnp.float32)
    r, w, k, v, a, b = (_fold(x, segments) for x in inputs)
    batch, heads, size = ds_final.shape[0], ds_final.shape[1], ds_final.shape[-1]
    ends = jnp.zeros((batch, segments, heads, size, size), jnp.float32).at[:, -1].set(ds_final)
    starts = kernels.state_gradients(r, w, a, b, dy, ends.reshape(-1, heads, size, size), ckpt)
    ds_out = outgoing_gradients(ds_final, _by_segment(starts, segments), transitions)
    *grads, ds0 = kernels.backward(r, w, k, v, a, b, ckpt, dy, _by_row(ds_out))
    return (*(_unfold(g, segments) for g in grads), _by_segment(ds0, segments)[0])

  run.defvjp(run_fwd, run_bwd, optimize_remat=optimize_remat)
  return run


def run_segments(kernels: Kernels, segments: int, r, w, k, v, a, b, state, *, optimize_remat: bool = True):
  """(y [B, T, H, N] in v's dtype, the final state [B, H, N, N] float32) by `kernels` over `segments` >= 2 segments
  of the sequence run side by side; inputs of any T, padded with identity tokens to a multiple of
  segments · kernels.chunk. Differentiable once in every argument."""
  if isinstance(segments, bool) or not isinstance(segments, int) or segments < 2:
    raise ValueError(f"wkv7_segmented: segments must be an int >= 2, got {segments!r}")
  length = r.shape[1]
  r, w, k, v, a, b = chunked.pad_tokens(segments * kernels.chunk, r, w, k, v, a, b)
  y, final = _fused(segments, kernels, optimize_remat)(r, w, k, v, a, b, state.astype(jnp.float32))
  return y[:, :length], final


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    segments: int,
    chunk: int | None = None,
    forward_block: int | None = None,
    backward_block: int | None = None,
    backward_loop: bool | None = None,
    forward_warps: int | None = None,
    backward_warps: int | None = None,
    operands=None,
    interpret: bool | None = None,
    optimize_remat: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Chunked WKV-7 over `segments` segments of the sequence run side by side; differentiable in every argument, exact
  for w >= min_log_decay(chunk) (`wkv7_chunked.in_range`).

  Args:
    r, w, k, v, a, b: [B, T, H, N], any float dtype, any T (padded with identity tokens to a multiple of
      segments · chunk).
    state: [B, H, N, N] float32, the state before the first token.
    segments: S >= 2, the number of segments (each T/S tokens after padding).
    chunk, forward_block, backward_block, backward_loop, forward_warps, backward_warps, operands, interpret,
      optimize_remat: as `wkv7_chunked.wkv7`; the state-only passes take the forward's block and warps.

  Returns:
    y [B, T, H, N] in v's dtype, and the final state [B, H, N, N] float32.
  """
  size = r.shape[-1]
  operands = chunked.operand_dtype(r.dtype) if operands is None else jnp.dtype(operands)
  chosen = chunked.launch_settings(size, operands, chunk=chunk, forward_block=forward_block,
                                   backward_block=backward_block, backward_loop=backward_loop,
                                   forward_warps=forward_warps, backward_warps=backward_warps)
  kernels = chunked_kernels(chosen["chunk"], chosen["forward_block"], chosen["backward_block"],
                            bool(chosen["backward_loop"]), chosen["forward_warps"], chosen["backward_warps"],
                            operands.name, interpret)
  return run_segments(kernels, segments, r, w, k, v, a, b, state, optimize_remat=optimize_remat)
