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

  @nn.compact
  def __call__(self, x, state=None, valid=None):
    del valid  # Token-wise: padding cannot leak.
    d = x.shape[-1]
    gate = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "gate")(x)
    up = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "up")(x)
    return dense(d, ("mlp", "embed"), self.out_std, self.dtype, "down")(nn.silu(gate) * up), None
