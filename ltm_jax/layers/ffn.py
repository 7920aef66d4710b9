"""SwiGLU feed-forward block (stateless)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.layers.common import dense, plain_kernels
from ltm_jax.ops.ffn import ffn


class SwiGLU(nn.Module):
  """y = W_out(silu(W_gate x) * W_up x); x, y: [B, T, d_model]. Takes and returns `state` (always None) and takes
  `valid` so every sub-layer has the same signature as the stateful RWKV channel-mix.

  W_gate, W_up and W_out are separate parameters ("gate", "up": [d_model, hidden] each; "down"). Where all are plain
  arrays the block is one `ltm_jax.ops.ffn` op (backend `impl`) with gate and up stacked as [d_model, 2, hidden]: the
  gradient of silu(gate) * up then leaves one elementwise pass that reads dh, gate and up once and writes both
  gradients (XLA gives the two products' form two passes, re-reading dh and gate), and x meets the weights in one
  matmul each way instead of two. Kernels stored quantised, and FP8 projections, take the two products (each through
  its `Dense`)."""
  hidden: int
  std: float
  out_std: float
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.
  impl: str = "auto"  # The ltm_jax.ops.ffn backend.

  @nn.compact
  def __call__(self, x, state=None, valid=None):
    del valid  # Token-wise: padding cannot leak.
    d = x.shape[-1]
    kernels = plain_kernels(self, ("gate", "up", "down"), self.fp8)
    if kernels is not None:
      gate, up, down = (k.astype(self.dtype) for k in kernels)
      return ffn(x.astype(self.dtype), jnp.stack([gate, up], axis=1), down, activation="swiglu", impl=self.impl), None
    gate = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "gate", fp8=self.fp8)
    up = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "up", fp8=self.fp8)
    h = nn.silu(gate(x)) * up(x)
    return dense(d, ("mlp", "embed"), self.out_std, self.dtype, "down", fp8=self.fp8)(h), None
