"""The MM-Rec block's mixer: the MDI recurrence plus attention over a bank of past segments' summaries.

From the (Block's normed) input x, one fused projection makes q, k, v, z; the decay is
gamma = clip(sigmoid(MLP_z(z)) * sigmoid(MLP_k(k)), 1e-6, 1 - 1e-6) (two-layer GELU MLPs of width d_model / 4) and the
gate's input term W_gz z + b; all of them for the whole sequence before the recurrence (`precompute=True`), or
token by token inside it (`precompute=False`, the slow form that precomputation replaces; same function). The `mdi`
op then runs h_t = clip(RMSNorm((1 - g_t) h_{t-1} + g_t z_t + gamma_t h_{t-1}), +-100), g_t = sigmoid(W_gz z_t +
W_gh h_{t-1} + b).

Long-term memory: the sequence is cut into segments of `segment` tokens (counted over a row's real tokens from its
first, across calls). When a segment ends, its summary (the mean of its h_t) is written into a bank of `slots`
entries at the write pointer (the number of segments written, mod `slots`): a ring of the last `slots` segment
summaries. A token reads the bank as it stands when its segment begins (the summaries of the up to `slots` segments
completed before it, never its own), by multi-head attention with query W_qm h_t + q_t / 2 and the summaries as keys
and values; an empty bank reads zero. The mixer returns h_t + W_o read_t + 0.1 v_t; the Block adds it to its input and
applies its FFN, which completes the MM-Rec block (x + h + read + 0.1 v, then the FFN).

The state carries h, the bank, the number of segments written, and the running sum and length of the unfinished
segment, so the block is causal and two calls equal one call over their concatenation (bank writes included).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.layers.common import projection_dot_general
from ltm_jax.ops.mdi import CLIP, EPS, mdi, mdi_step

GAMMA_RANGE = (1e-6, 1 - 1e-6)
V_MIX = 0.1  # The value path's weight in the output.
Q_MIX = 0.5  # The block's q in the memory query.


class MMRecState(NamedTuple):
  """h: [B, D] float32 the recurrent state; bank: [B, slots, D] float32 segment summaries (slot i holds the latest
  segment whose number is i mod slots); written: [B] int32 segments completed; partial: [B, D] float32 the sum of h
  over the unfinished segment's tokens; filled: [B] int32 how many tokens it has."""
  h: jax.Array
  bank: jax.Array
  written: jax.Array
  partial: jax.Array
  filled: jax.Array

  @classmethod
  def empty(cls, batch: int, d_model: int, slots: int):
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    ints = jnp.zeros((batch,), jnp.int32)
    return cls(zeros(batch, d_model), zeros(batch, slots, d_model), ints, zeros(batch, d_model), ints)


def _matmul(a, w, dtype, dot_general=None, contract: int = 1):
  """a [..., K...] @ w [K..., F...] in `dtype`, contracting a's last and w's first `contract` axes, through
  `dot_general` (None: lax.dot_general; the FP8 one under model.fp8)."""
  dims = (((tuple(range(a.ndim - contract, a.ndim))), tuple(range(contract))), ((), ()))
  return (dot_general or jax.lax.dot_general)(a.astype(dtype), w.astype(dtype), dims)


def project(p: dict, x, dtype, dot_general=None):
  """The per-token inputs of the recurrence from x [..., D]: (q, k, v, z, gate_z, gamma), each [..., D]; the same
  function whether x holds a whole sequence or one token. `dot_general` multiplies the projections (None: plain)."""
  mm = lambda a, w: _matmul(a, w, dtype, dot_general)
  q, k, v, z = jnp.split(mm(x, p["qkvz"]), 4, axis=-1)
  mlp = lambda a, name: mm(jax.nn.gelu(mm(a, p[f"{name}_down"]) + p[f"{name}_down_bias"].astype(dtype)),
                           p[f"{name}_up"]).astype(jnp.float32) + p[f"{name}_up_bias"]
  gamma = jnp.clip(jax.nn.sigmoid(mlp(z, "decay_z")) * jax.nn.sigmoid(mlp(k, "decay_k")), *GAMMA_RANGE)
  gate_z = mm(z, p["gate_z"]).astype(jnp.float32) + p["gate_bias"]
  return q, k, v, z, gate_z, gamma


def read_memory(query, hs, valid, state: MMRecState, segment: int):
  """Attention from every token to the bank as it stands when the token's segment begins.

  query [B, T, H, N]; hs [B, T, D = H N] float32; valid [B, T] bool. The bank seen by a token of segment s holds
  segments s - slots .. s - 1: those still in the state's bank, and those completed earlier in this call, whose
  summaries are made here (at most K = (segment - 1 + T) // segment + 1 segments are touched by T tokens).
  Returns (read [B, T, H, N] float32, the state's bank, written, partial and filled after the call)."""
  batch, length, heads, size = query.shape
  slots = state.bank.shape[1]
  touched = (segment - 1 + length) // segment + 1
  real = valid.astype(jnp.int32)
  first = state.written * segment + state.filled  # [B] the position (over real tokens) of the call's first token.
  position = first[:, None] + jnp.cumsum(real, axis=1) - 1
  seg = position // segment  # [B, T] each real token's segment number.
  local = seg - state.written[:, None]  # In [0, touched): the call's segments, the unfinished one first.
  member = (local[..., None] == jnp.arange(touched)) & valid[..., None]  # [B, T, K]
  sums = jnp.einsum("btk,btd->bkd", member.astype(hs.dtype), hs).at[:, 0].add(state.partial.astype(hs.dtype))
  end = first + jnp.sum(real, axis=1)
  written, filled = end // segment, end % segment
  partial = jnp.take_along_axis(sums, (written - state.written)[:, None, None], axis=1)[:, 0]

  # Candidates: the bank's slots (slot i holds segment written - 1 - ((written - 1 - i) mod slots) when that is
  # >= 0), then the call's segments state.written + k.
  i = jnp.arange(slots)
  old = state.written[:, None] - 1 - (state.written[:, None] - 1 - i) % slots  # [B, slots]
  new = state.written[:, None] + jnp.arange(touched)  # [B, K]
  numbers = jnp.concatenate([jnp.where(old >= 0, old, -slots - 1), new], axis=1)  # [B, slots + K]
  entries = jnp.concatenate([state.bank.astype(hs.dtype), sums / segment], axis=1)  # [B, slots + K, D]
  visible = (numbers[:, None] < seg[..., None]) & (numbers[:, None] >= seg[..., None] - slots)  # [B, T, slots + K]
  keys = entries.reshape(batch, -1, heads, size)
  scores = jnp.einsum("bthn,bjhn->bhtj", query.astype(hs.dtype), keys) * size ** -0.5
  # A finite fill keeps the softmax defined when nothing is visible; the product with `visible` then reads zero.
  scores = jnp.where(visible[:, None], scores, -1e30)
  weights = jax.nn.softmax(scores, axis=-1) * visible[:, None]
  read = jnp.einsum("bhtj,bjhn->bthn", weights, keys)

  latest = written[:, None] - 1 - (written[:, None] - 1 - i) % slots  # [B, slots] each slot's segment after the call.
  fresh = latest >= state.written[:, None]
  taken = jnp.take_along_axis(sums / segment, jnp.clip(latest - state.written[:, None], 0, touched - 1)[..., None],
                              axis=1)
  bank = jnp.where(fresh[..., None], taken, state.bank.astype(hs.dtype))
  return read, (bank.astype(jnp.float32), written.astype(jnp.int32), partial.astype(jnp.float32),
                filled.astype(jnp.int32))


def _param(module: nn.Module, name: str, init, shape, axes):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape)


class MMRec(nn.Module):
  """x [B, T, d_model] -> (y [B, T, d_model], MMRecState). `valid` [B, T] bool (None: all valid) marks left padding,
  which changes no state. `remat`: which parts recompute their insides in the backward pass ("recurrence": the MDI
  op; "memory": the memory attention; "recurrence_memory": both)."""
  n_heads: int
  slots: int = 16
  segment: int = 16
  precompute: bool = True
  remat: str = "none"
  std: float = 0.02
  out_std: float = 0.02
  impl: str = "auto"
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state: MMRecState | None = None, valid=None):
    batch, length, d = x.shape
    heads, size = self.n_heads, d // self.n_heads
    if state is None:
      state = MMRecState.empty(batch, d, self.slots)
    valid = jnp.ones((batch, length), bool) if valid is None else valid.astype(bool)
    normal = lambda std: nn.initializers.normal(std)
    zeros, ones = nn.initializers.zeros, nn.initializers.ones
    p = {"qkvz": _param(self, "qkvz", normal(self.std), (d, 4 * d), ("embed", "mlp")),
         "gate_z": _param(self, "gate_z", normal(self.std), (d, d), ("embed", "embed_out")),
         "gate_bias": _param(self, "gate_bias", zeros, (d,), ("norm",))}
    # The decay starts near sigmoid(-3) * sigmoid(0) ~ 0.024 for every input (zero up-projections), as the original
    # initialises it: a large gamma would compound (1 + gamma)^T before the norm.
    for name, bias in (("decay_z", -3.0), ("decay_k", 0.0)):
      p[f"{name}_down"] = _param(self, f"{name}_down", normal(self.std), (d, d // 4), ("embed", "lora"))
      p[f"{name}_down_bias"] = _param(self, f"{name}_down_bias", zeros, (d // 4,), ("lora",))
      p[f"{name}_up"] = _param(self, f"{name}_up", zeros, (d // 4, d), ("lora", "embed_out"))
      p[f"{name}_up_bias"] = _param(self, f"{name}_up_bias", nn.initializers.constant(bias), (d,), ("norm",))
    w_h = _param(self, "gate_h", normal(self.std), (d, d), ("embed", "embed_out"))
    scale = _param(self, "h_norm", ones, (d,), ("norm",))
    w_qm = _param(self, "bank_query", normal(self.std), (d, heads, size), ("embed", "heads", "head_dim"))
    w_o = _param(self, "bank_out", normal(self.out_std), (heads, size, d), ("heads", "head_dim", "embed"))
    dot_general = projection_dot_general(self.fp8)

    def recurrence(p, w_h, scale, x, valid, h0):
      if self.precompute:
        q, _, v, z, gate_z, gamma = project(p, x, self.dtype, dot_general)
        hs, h = mdi(gate_z, z, gamma, w_h, scale, h0, mask=valid, eps=EPS, clip=CLIP, impl=self.impl)
        return hs, h, q, v

      def body(h, token):
        x_t, valid_t = token
        q, _, v, z, gate_z, gamma = project(p, x_t, self.dtype, dot_general)
        h = mdi_step(gate_z, z, gamma, w_h, scale, h, keep=valid_t, eps=EPS, clip=CLIP)
        return h, (h, q, v)

      carry = h0.astype(jnp.result_type(jnp.float32, h0.dtype, x.dtype, w_h.dtype, scale.dtype))  # mdi_step's.
      h, (hs, q, v) = jax.lax.scan(body, carry, (jnp.moveaxis(x, 1, 0), valid.T))
      hs, q, v = (jnp.moveaxis(a, 0, 1) for a in (hs, q, v))
      return hs, h, q, v

    def memory(w_qm, w_o, hs, q, valid, state):
      query = _matmul(hs, w_qm, self.dtype, dot_general).astype(jnp.float32)
      query = query + Q_MIX * q.astype(jnp.float32).reshape(batch, length, heads, size)
      read, new = read_memory(query, hs, valid, state, self.segment)
      out = _matmul(read, w_o, self.dtype, dot_general, contract=2)
      return out, new

    if self.remat in ("recurrence", "recurrence_memory"):
      recurrence = jax.checkpoint(recurrence)
    if self.remat in ("memory", "recurrence_memory"):
      memory = jax.checkpoint(memory)
    hs, h, q, v = recurrence(p, w_h, scale, x, valid, state.h)
    out, (bank, written, partial, filled) = memory(w_qm, w_o, hs, q, valid, state)
    y = hs.astype(self.dtype) + out.astype(self.dtype) + V_MIX * v.astype(self.dtype)
    return y, MMRecState(h.astype(jnp.float32), bank, written, partial, filled)
