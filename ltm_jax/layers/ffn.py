"""SwiGLU feed-forward block (stateless)."""

from __future__ import annotations

import flax.linen as nn

from ltm_jax.layers.common import dense


class SwiGLU(nn.Module):
  """y = W_out(silu(W_gate x) * W_up x); x, y: [B, T, d_model]. Takes and returns `state` (always None) and takes
  `valid` so every sub-layer has the same signature as the stateful RWKV channel-mix."""
  hidden: int
  std: float
  out_std: float
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state=None, valid=None):
    del valid  # Token-wise: padding cannot leak.
    d = x.shape[-1]
    gate = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "gate", fp8=self.fp8)(x)
    up = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "up", fp8=self.fp8)(x)
    return dense(d, ("mlp", "embed"), self.out_std, self.dtype, "down", fp8=self.fp8)(nn.silu(gate) * up), None
