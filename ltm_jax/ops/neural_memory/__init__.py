"""The neural memory op (Titans): a small MLP per head whose weights are the state, trained at test time.

For every batch row and head, with M_t the memory's weights and S_t its momentum (one [d_in, d_out] matrix per
memory layer, see `mlp.py`), each token t with an update mask mu_t applies

  g_t = d/dW ||M_c(k_t) - v_t||^2                      (the surprise: the associative loss's gradient)
  S_t = eta_t S_{t-1} - theta_t g_t                    (momentum)
  M_t = (1 - alpha_t) M_{t-1} + mu_t S_t               (forgetting, then the step)
  y_t = M_t(q_t)                                       (retrieval: read, no update)

where M_c are the weights entering t's chunk of `chunk` tokens (Titans' parallel form: every gradient inside a
chunk is taken at its starting weights; chunk 1 is exact online gradient descent, M_c = M_{t-1}). A masked token
(mu_t = 0) leaves both M and S as they were. eta, theta, alpha are per token and head; the op accepts any values
(the Titans layer passes sigmoid gates in (0, 1)). Accumulation is float32 (float64 for float64 inputs) whatever the
input dtype.

Backends, equal for every chunk size: "scan" (per token, the reference) and "chunked" (each chunk's updates and
reads as matrix products, one sequential step per chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.neural_memory import chunked, mlp, scan

# The first entry is the reference.
AVAILABLE = ("scan", "chunked")
_BACKENDS = {"scan": scan.neural_memory, "chunked": chunked.neural_memory}
# Fastest per platform at training-like shapes, forward+backward under jit (`python benchmarks/neural_memory.py`,
# benchmarks/results/neural-memory-cpu.json). cpu: chunked, 2.7-13x faster than scan forward+backward at
# (B, T, H, N) = (8, 256, 4, 32) and (4, 512, 8, 64), depth 1 and 2 (the scan's per-token autodiff dominates).
# gpu: chunked, whose work is matrix products (chosen for that, not by a GPU timing). One-token decoding steps take
# the scan.
AUTO = {"cpu": "chunked", "gpu": "chunked"}


class MemoryState(NamedTuple):
  """Per batch row and head, one [B, H, d_in, d_out] array per memory layer: the weights, their momentum, and the
  anchor (the weights the current chunk started with, where its gradients are taken); phase [B] int32: how many
  tokens of the current chunk are done (0: the next token starts a chunk, and the anchor equals the weights)."""
  weights: tuple[jax.Array, ...]
  momentum: tuple[jax.Array, ...]
  anchor: tuple[jax.Array, ...]
  phase: jax.Array


def initial_state(weights: Sequence[jax.Array], batch: int) -> MemoryState:
  """The state before any token: the memory's initial weights (per layer [H, d_in, d_out], e.g. learned) for every
  row, float32, zero momentum, phase 0."""
  weights = tuple(jnp.broadcast_to(jnp.asarray(w, jnp.float32), (batch,) + w.shape) for w in weights)
  return MemoryState(weights, tuple(jnp.zeros_like(w) for w in weights), weights, jnp.zeros((batch,), jnp.int32))


def apply_memory(weights: Sequence[jax.Array], x: jax.Array) -> jax.Array:
  """M(x) for per-row, per-head weights (layers [B, H, d_in, d_out]) and x [B, T, H, d_0] -> [B, T, H, d_L]."""
  return jnp.swapaxes(mlp.apply(tuple(weights), jnp.swapaxes(x, 1, 2)), 1, 2)


def _check(q, k, v, gates, state, mask):
  if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
    raise ValueError(f"neural_memory: q, k, v must all be [B, T, H, N]; got {q.shape}, {k.shape}, {v.shape}")
  if any(g.shape != q.shape[:3] for g in gates):
    raise ValueError(f"neural_memory: eta, theta, alpha must be [B, T, H] = {q.shape[:3]}; "
                     f"got {', '.join(str(g.shape) for g in gates)}")
  if mask is not None and mask.shape != q.shape[:2]:
    raise ValueError(f"neural_memory: mask must be [B, T] = {q.shape[:2]}; got {mask.shape}")
  if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v, *gates)):
    raise ValueError("neural_memory: q, k, v, eta, theta, alpha must be floating point")
  batch, _, heads, size = q.shape
  if not state.weights or not len(state.weights) == len(state.momentum) == len(state.anchor):
    raise ValueError(f"neural_memory: the state needs one weight, momentum and anchor per memory layer; got "
                     f"{len(state.weights)}, {len(state.momentum)} and {len(state.anchor)}")
  dims = [size] + [w.shape[-1] for w in state.weights]
  shapes = [(batch, heads, d_in, d_out) for d_in, d_out in zip(dims, dims[1:])]
  got = [[x.shape for x in xs] for xs in (state.weights, state.momentum, state.anchor)]
  if dims[-1] != size or any(g != shapes for g in got):
    raise ValueError(f"neural_memory: state weights, momentum and anchor must chain [B, H, d_in, d_out] from N={size} "
                     f"back to N; got {got}")
  if state.phase.shape != (batch,):
    raise ValueError(f"neural_memory: state phase must be [B] = ({batch},); got {state.phase.shape}")


def neural_memory(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    eta: jax.Array,
    theta: jax.Array,
    alpha: jax.Array,
    state: MemoryState,
    *,
    mask: jax.Array | None = None,
    chunk: int = 16,
    impl: str = "auto",
) -> tuple[jax.Array, MemoryState]:
  """Runs the neural memory over a sequence, starting from `state`.

  Args:
    q, k, v: [B, T, H, N] queries, keys and values (the Titans layer l2-normalises q and k).
    eta: [B, T, H] momentum decay. theta: [B, T, H] learning rate. alpha: [B, T, H] forgetting rate.
    state: the memory before the first token (`initial_state`); its layers chain N -> ... -> N, so the memory's
      depth is len(state.weights).
    mask: [B, T] bool, False where a token must leave the state untouched (e.g. left padding), or None. Chunks
      count a row's unmasked tokens only.
    chunk: tokens per chunk: gradients inside a chunk are taken at its starting weights (part of the model, not of
      the backend; 1 is exact online gradient descent). Chunks run on across calls through the state's phase.
    impl: "auto", "scan" or "chunked".

  Returns:
    y [B, T, H, N] in v's dtype (zero at masked tokens), and the state after the last token: feeding it back
    continues the sequence, so two segments run one after the other equal their concatenation.

  Raises:
    ValueError: on mismatched shapes, non-float inputs, chunk < 1, or an unknown impl.
  """
  run = backend.select("neural_memory", impl, _BACKENDS, AUTO, length=q.shape[1] if q.ndim > 1 else None)
  chunk = backend.static_int("neural_memory", "chunk", chunk, low=1)
  state = MemoryState(*(tuple(x) for x in state[:3]), jnp.asarray(state[3]))
  _check(q, k, v, (eta, theta, alpha), state, mask)
  dtype = jnp.result_type(jnp.float32, *(x.dtype for x in (q, k, v, eta, theta, alpha, *state.weights)))
  cast = lambda xs: tuple(x.astype(dtype) for x in xs)
  inputs = cast((q, k, v, eta, theta, alpha))
  state = MemoryState(cast(state.weights), cast(state.momentum), cast(state.anchor), state.phase.astype(jnp.int32))
  if q.shape[1] == 0:
    return jnp.zeros(v.shape, v.dtype), state
  update = jnp.ones(q.shape[:2], bool) if mask is None else mask.astype(bool)

  def run_op(q, k, v, eta, theta, alpha, update, state):
    y, *state = run(q, k, v, eta, theta, alpha, update, *state, chunk=chunk)
    return jnp.where(update[..., None, None], y, 0), MemoryState(*state)

  # Rows and heads are independent, so both can be split over the mesh (heads like the attention layers' heads).
  layers = len(state.weights)
  bthn, bth, bh = ("batch", None, "heads", None), ("batch", None, "heads"), ("batch", "heads", None, None)
  state_axes = MemoryState((bh,) * layers, (bh,) * layers, (bh,) * layers, ("batch",))
  y, state = sharding.per_shard(run_op, inputs + (update, state), in_axes=(bthn,) * 3 + (bth,) * 3 + (("batch", None),
                                                                                                    state_axes),
                                out_axes=(bthn, state_axes), sizes={"batch": q.shape[0], "heads": q.shape[2]})
  return y.astype(v.dtype), state
