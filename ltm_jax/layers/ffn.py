"""SwiGLU feed-forward block (stateless)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.layers.common import dense
from ltm_jax.ops.quant_matmul import weights as quant_weights


class SwiGLU(nn.Module):
  """y = W_out(silu(W_gate x) * W_up x); x, y: [B, T, d_model]. Takes and returns `state` (always None) and takes
  `valid` so every sub-layer has the same signature as the stateful RWKV channel-mix.

  W_gate and W_up are separate parameters ("gate", "up": [d_model, hidden] each) multiplied as one [d_model, 2,
  hidden] product where both are plain arrays: the gradient of silu(gate) * up then leaves one elementwise pass that
  reads dh, gate and up once and writes both gradients (XLA gives the two products' form two passes, re-reading dh
  and gate), and x meets the weights in one matmul each way instead of two. Kernels stored quantised, and FP8
  projections, take the two products (each through its `Dense`)."""
  hidden: int
  std: float
  out_std: float
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, state=None, valid=None):
    del valid  # Token-wise: padding cannot leak.
    d = x.shape[-1]
    gate = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "gate", fp8=self.fp8)
    up = dense(self.hidden, ("embed", "mlp"), self.std, self.dtype, "up", fp8=self.fp8)
    kernels = self._plain_kernels()
    if kernels is None:
      h = nn.silu(gate(x)) * up(x)
    else:
      weights = jnp.stack(kernels, axis=1).astype(self.dtype)  # [d_model, 2, hidden]
      gate_up = jnp.einsum("...d,dkh->...kh", x.astype(self.dtype), weights)
      h = nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
    return dense(d, ("mlp", "embed"), self.out_std, self.dtype, "down", fp8=self.fp8)(h), None

  def _plain_kernels(self):
    """(W_gate, W_up) when both exist as plain arrays and the projections are not FP8, else None (while
    initialising, the two `Dense` calls create them)."""
    if self.fp8 or self.is_initializing():
      return None
    params = self.variables.get("params", {})
    kernels = tuple(nn.meta.unbox(params.get(name, {}).get("kernel")) for name in ("gate", "up"))
    if any(k is None or quant_weights.is_quantized(k) for k in kernels):
      return None
    return kernels
