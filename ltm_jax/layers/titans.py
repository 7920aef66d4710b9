"""Titans neural long-term memory (Behrouz et al. 2024) as token mixers.

`NeuralMemory`: q, k, v from linear projections, each through a short causal depthwise convolution and SiLU, q and k
l2-normalised per head; per-token, per-head gates eta (momentum decay), theta (learning rate, up to
(1 - eta) max_lr / chunk) and alpha (forgetting) from sigmoid projections; the memory (an MLP of `depth` layers per head,
trained at test time by the `neural_memory` op) is read at q; the reads are RMS-normalised per head and projected
back to d_model. The convolution comes before the SiLU, as in Mamba-style blocks.

The memory's initial weights are learned (one MLP shared by the heads, copied into every head's state), so a fresh
state holds no weights: `NeuralMemoryState.started` says whether a row has begun, and a row that has not starts from
the learned weights.

Two mixers combine it with sliding-window attention, as the paper's variants do:
  `MemoryAsLayer` (MAL): the memory, then attention over its output, each with its own residual.
  `MemoryAsGate` (MAG): attention and memory read the same input and are mixed per channel by a learned gate.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.layers.attention import Attention, KVCache
from ltm_jax.layers.common import dense, hold_last, norm, token_shift
from ltm_jax.ops.neural_memory import MemoryState, apply_memory, initial_state, neural_memory

NORM_EPS = 1e-6
CONV_WIDTH = 4  # Taps of the short convolution on q, k, v (the current token and three before it).


class NeuralMemoryState(NamedTuple):
  """memory: the op's state, [B, H, ...] per memory layer; conv: [B, conv_width - 1, 3, H, N] float32, the last
  projected q, k, v inputs (newest last) for the causal convolution; started: [B] bool, False until the row's first
  real token."""
  memory: MemoryState
  conv: jax.Array
  started: jax.Array

  @classmethod
  def empty(cls, batch: int, heads: int, head_dim: int, depth: int, expansion: int, conv_width: int = CONV_WIDTH):
    dims = memory_dims(head_dim, depth, expansion)
    weights = tuple(jnp.zeros((heads, i, o), jnp.float32) for i, o in zip(dims, dims[1:]))
    return cls(initial_state(weights, batch), jnp.zeros((batch, conv_width - 1, 3, heads, head_dim), jnp.float32),
               jnp.zeros((batch,), bool))


def memory_dims(head_dim: int, depth: int, expansion: int) -> list[int]:
  """Widths of the memory MLP: head_dim -> expansion * head_dim (depth - 1 times) -> head_dim."""
  return [head_dim] + [expansion * head_dim] * (depth - 1) + [head_dim]


def _causal_conv(x, history, kernel, valid):
  """Depthwise causal convolution over time. x [B, T, ...]; history [B, K-1, ...] (the inputs before x, newest last);
  kernel [K, ...] (tap 0 reads the current input, tap j the j-th real input before it). Left padding (valid False
  before a row's first real token, as `NeuralMemory` takes) is skipped: every tap reads real inputs or the history
  only. A gap after a real token would read the history, not the inputs before the gap. Returns (y [B, T, ...], the
  new history)."""
  width = kernel.shape[0]
  if width == 1:
    return x * kernel[0].astype(x.dtype), history
  flat = lambda a: a.reshape(a.shape[:2] + (-1,))
  shape, x, history = x.shape, flat(x), flat(history).astype(x.dtype)
  y = x * kernel[0].reshape(-1).astype(x.dtype)
  held = hold_last(x, history[:, -1], valid)  # Left padding repeats the history's newest input.
  new_history = [held[:, -1]]
  for tap in range(1, width):
    # Shifting `held` by one gives, at every real token, the real input just before it; holding again over the
    # padding with the next older history entry keeps that true for the following tap.
    previous = history[:, -tap]
    shifted = token_shift(held, previous)
    y = y + shifted * kernel[tap].reshape(-1).astype(x.dtype)
    if tap < width - 1:
      held = hold_last(shifted, history[:, -tap - 1], valid)
      new_history.append(held[:, -1])
  new_history = jnp.stack(new_history[::-1], axis=1)
  return y.reshape(shape), new_history.reshape((shape[0], width - 1) + shape[2:]).astype(jnp.float32)


def _identity_taps(key, shape, dtype=jnp.float32):
  del key
  return jnp.zeros(shape, dtype).at[0].set(1)


class NeuralMemory(nn.Module):
  """x [B, T, d_model] -> (y [B, T, d_model], NeuralMemoryState). `valid` [B, T] bool (None: all valid) marks left
  padding, which leaves the state as it was."""
  n_heads: int
  head_dim: int
  depth: int = 2
  expansion: int = 2
  chunk: int = 16
  max_lr: float = 0.5
  conv_width: int = CONV_WIDTH
  std: float = 0.02
  out_std: float = 0.02
  impl: str = "auto"
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state: NeuralMemoryState | None = None, valid=None):
    batch, length, d_model = x.shape
    heads, size = self.n_heads, self.head_dim
    if state is None:
      state = NeuralMemoryState.empty(batch, heads, size, self.depth, self.expansion, self.conv_width)
    project = lambda name: dense((heads, size), ("embed", "heads", "head_dim"), self.std, self.dtype, name,
                                 fp8=self.fp8)(x)
    qkv = jnp.stack([project("q"), project("k"), project("v")], axis=2)  # [B, T, 3, H, N]
    # Taps start as the identity (all weight on the current input) and learn how much of the past to mix in.
    identity_tap = nn.with_logical_partitioning(_identity_taps, ("conv", "heads", "head_dim"))
    kernel = jnp.stack([self.param(f"conv_{name}", identity_tap, (self.conv_width, heads, size)) for name in "qkv"],
                       axis=1)
    qkv, conv_history = _causal_conv(qkv, state.conv, kernel, valid)
    qkv = jax.nn.silu(qkv).astype(jnp.float32)
    unit = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + NORM_EPS)
    q, k, v = unit(qkv[:, :, 0]), unit(qkv[:, :, 1]), qkv[:, :, 2]

    def gate(name, bias):
      logits = dense(heads, ("embed", "heads"), self.std, self.dtype, name, fp8=self.fp8)(x).astype(jnp.float32)
      offset = self.param(f"{name}_bias", nn.with_logical_partitioning(nn.initializers.constant(bias), ("heads",)),
                          (heads,))
      return jax.nn.sigmoid(logits + offset)

    # Inside a chunk every gradient is taken at the same weights, so C similar tokens add up to C steps at once: the
    # rate is at most max_lr / C per token, which bounds a chunk's summed step by max_lr whatever C. Momentum would
    # multiply a steady gradient's step by 1 / (1 - eta), unbounded as eta -> 1, so theta carries a factor
    # (1 - eta), as an exponential moving average does. Unit keys make a linear memory's step contract along k only
    # while the effective rate stays below 1. Starting points: eta ~0.5, theta ~max_lr / (8 C), ~2% forgotten per
    # token.
    eta, alpha = gate("momentum", 0.0), gate("forget", -4.0)
    theta = (1 - eta) * self.max_lr / self.chunk * gate("lr", -1.0)
    dims = memory_dims(size, self.depth, self.expansion)
    initial = tuple(self.param(f"memory_{i}", nn.with_logical_partitioning(
        nn.initializers.normal(1 / d_in ** 0.5), ("memory_in", "memory_out")), (d_in, d_out))
                    for i, (d_in, d_out) in enumerate(zip(dims, dims[1:])))
    fresh = initial_state([jnp.broadcast_to(w, (heads,) + w.shape) for w in initial], batch)
    started = state.started
    memory = jax.tree.map(lambda old, new: jnp.where(started.reshape((batch,) + (1,) * (old.ndim - 1)), old, new),
                          state.memory, fresh)
    if self.is_mutable_collection("intermediates"):
      self._sow_statistics(memory, k, v, eta, theta, alpha)
    y, memory = neural_memory(q, k, v, eta, theta, alpha, memory, mask=valid, chunk=self.chunk, impl=self.impl)
    if self.is_mutable_collection("intermediates"):
      norm_of = lambda ws: jnp.sqrt(sum(jnp.sum(w * w, axis=(-2, -1)) for w in ws))
      self.sow("intermediates", "weight_norm", norm_of(memory.weights))
      self.sow("intermediates", "momentum_norm", norm_of(memory.momentum))
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + NORM_EPS)
    y = dense(d_model, ("heads", "head_dim", "embed"), self.out_std, self.dtype, "out", in_axis=(-2, -1), fp8=self.fp8)(
        y.astype(self.dtype))
    started = started | (jnp.ones((batch,), bool) if valid is None else jnp.any(valid, axis=1))
    return y, NeuralMemoryState(memory, conv_history, started)

  def _sow_statistics(self, memory: MemoryState, k, v, eta, theta, alpha):
    """Diagnostics, sown only when "intermediates" is mutable: per token and head, the surprise (the associative
    loss ||M(k_t) - v_t||^2 under the memory the call starts with: for one-token steps, the loss whose gradient the
    step takes at chunk 1), the three gates (retention = 1 - alpha, the effective decay of the weights) and, after
    the op, the Frobenius norms of the weights and the momentum per head."""
    self.sow("intermediates", "surprise", jnp.sum((apply_memory(memory.weights, k) - v) ** 2, axis=-1))
    self.sow("intermediates", "momentum_decay", eta)
    self.sow("intermediates", "learning_rate", theta)
    self.sow("intermediates", "retention", 1 - alpha)


class TitansState(NamedTuple):
  memory: NeuralMemoryState
  attention: KVCache


class MemoryAsLayer(nn.Module):
  """MAL: h = memory(x), then h + attention(norm(x + h)): the block adds this to x, so the memory and the attention
  each get a residual. `memory` and `attention` are the sub-modules' settings."""
  memory: dict
  attention: dict
  norm_kind: str = "rmsnorm"
  norm_eps: float = 1e-5
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x, state: TitansState | None = None, valid=None):
    memory_state, cache = (None, None) if state is None else state
    h, memory_state = NeuralMemory(**self.memory, dtype=self.dtype, name="memory")(x, memory_state, valid)
    inner = norm(self.norm_kind, self.norm_eps, self.dtype, "attention_norm")(x + h.astype(x.dtype))
    a, cache = Attention(**self.attention, dtype=self.dtype, name="attention")(inner, cache, valid)
    return h + a, TitansState(memory_state, cache)


class MemoryAsGate(nn.Module):
  """MAG: g * attention(x) + (1 - g) * memory(x), g = sigmoid(W x) per channel."""
  memory: dict
  attention: dict
  std: float = 0.02
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state: TitansState | None = None, valid=None):
    memory_state, cache = (None, None) if state is None else state
    m, memory_state = NeuralMemory(**self.memory, dtype=self.dtype, name="memory")(x, memory_state, valid)
    a, cache = Attention(**self.attention, dtype=self.dtype, name="attention")(x, cache, valid)
    g = jax.nn.sigmoid(dense(x.shape[-1], ("embed", "embed_out"), self.std, self.dtype, "gate", fp8=self.fp8)(x))
    return g * a + (1 - g) * m, TitansState(memory_state, cache)
