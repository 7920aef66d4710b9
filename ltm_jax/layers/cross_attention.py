"""Cross-attention from the tokens to one layer's latent thought vectors z_l (no mask: every token sees every z)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax import ops
from ltm_jax.layers.common import dense
from ltm_jax.layers.rope import apply_rope


def latent_positions(n: int, span: int) -> jax.Array:
  """[n] int32: n latent vectors spread evenly over positions [0, span), each at the middle of its share."""
  return ((2 * jnp.arange(n, dtype=jnp.int32) + 1) * span) // (2 * n)


class CrossAttention(nn.Module):
  """x [B, T, d_model] (queries), z [B, n, d_model] (keys and values) -> [B, T, d_model].

  Because no token position enters the keys, position t's output depends on x_t and z only, so causality in x is
  whatever the self-attention and mixers give. With `rope_span`, queries at `positions` [B, T] and z at evenly spaced
  positions over [0, rope_span) carry RoPE, so a token can attend to the latents "near" it.
  """
  n_heads: int
  head_dim: int
  std: float
  out_std: float
  rope_span: int | None = None
  rope_theta: float = 10_000.0
  impl: str = "auto"
  dtype: str = "float32"
  fp8: bool = False  # Its projections multiply in FP8 (ltm_jax.ops.fp8); the model sets it from model.fp8.

  @nn.compact
  def __call__(self, x, z, positions=None):
    batch, _, d_model = x.shape
    heads = (self.n_heads, self.head_dim)
    q = dense(heads, ("embed", "heads", "head_dim"), self.std, self.dtype, "q", fp8=self.fp8)(x)
    k = dense(heads, ("embed", "heads", "head_dim"), self.std, self.dtype, "k", fp8=self.fp8)(z.astype(x.dtype))
    v = dense(heads, ("embed", "heads", "head_dim"), self.std, self.dtype, "v", fp8=self.fp8)(z.astype(x.dtype))
    if self.rope_span is not None:
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
      z_positions = jnp.broadcast_to(latent_positions(z.shape[1], self.rope_span), z.shape[:2])
      q = apply_rope(q, positions, self.rope_theta)
      k = apply_rope(k, z_positions, self.rope_theta)
    y = ops.attention(q, k, v, causal=False, impl=self.impl)
    return dense(d_model, ("heads", "head_dim", "embed"), self.out_std, self.dtype, "out", in_axis=(-2, -1),
                 fp8=self.fp8)(y)
