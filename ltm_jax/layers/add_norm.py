"""The residual add and the norm after it as one flax module (`ltm_jax.ops.add_norm`), for a block between one
sub-layer and the next. Its parameters are those of the norm module it stands in for
(`ltm_jax.layers.common.norm`: `scale`, and `bias` for layernorm, float32, logical axis "norm"), so a checkpoint
reads the same either way. `NormParameters` makes the same parameters for a sub-layer that applies its norm itself."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ltm_jax.ops.add_norm import add_norm


def norm_parameters(module: nn.Module, kind: str, channels: int):
  """(scale, bias) [C] float32 as params of `module` (within its compact call), named and initialised as those of
  `ltm_jax.layers.common.norm`'s module; bias None for rmsnorm."""
  scale = module.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (channels,),
                       jnp.float32)
  if kind != "layernorm":
    return scale, None
  return scale, module.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (channels,),
                             jnp.float32)


class NormParameters(nn.Module):
  """The parameters of a norm that a sub-layer applies itself: `norm_parameters` of C = the call's `channels`."""
  kind: str  # "layernorm" or "rmsnorm" (model.norm).

  @nn.compact
  def __call__(self, channels: int):
    return norm_parameters(self, self.kind, channels)


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
    scale, bias = norm_parameters(self, self.kind, x.shape[-1])
    return add_norm(x, d, scale, bias, kind=self.kind, eps=self.eps, dtype=self.dtype, impl=self.impl,
                    token_shifted=self.token_shifted)
