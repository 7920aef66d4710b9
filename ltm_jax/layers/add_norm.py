"""The residual add and the norm after it as one flax module (`ltm_jax.ops.add_norm`), for a block between one
sub-layer and the next. Its parameters are those of the norm module it stands in for
(`ltm_jax.layers.common.norm`: `scale`, and `bias` for layernorm, float32, logical axis "norm"), so a checkpoint
reads the same either way."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.ops.add_norm import add_norm


class AddNorm(nn.Module):
  """(x + d, norm(x + d)): x [B, T, C] the residual stream, d [B, T, C] a sub-layer's output; the norm's output in
  `dtype`, the sum in x's dtype."""
  kind: str  # "layernorm" or "rmsnorm" (model.norm).
  eps: float
  dtype: Any
  impl: str = "auto"
  token_shifted: bool = False  # The norm's output feeds a token shift (the op's "auto" weighs it).

  @nn.compact
  def __call__(self, x, d):
    channels = (x.shape[-1],)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), channels, jnp.float32)
    bias = None
    if self.kind == "layernorm":
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), channels, jnp.float32)
    return add_norm(x, d, scale, bias, kind=self.kind, eps=self.eps, dtype=self.dtype, impl=self.impl,
                    token_shifted=self.token_shifted)
