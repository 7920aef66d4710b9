"""Cross-attention from the tokens to one layer's latent thought vectors z_l (no mask: every token sees every z), or
to one of two sets of latents chosen per position (`SplitLatents`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from typing import NamedTuple

from ltm_jax import ops
from ltm_jax.layers.common import dense
from ltm_jax.layers.rope import apply_rope


class SplitLatents(NamedTuple):
  """Latents that change along the sequence: position t of row b reads `before` where is_before[b, t], else `after`.
  `before` and `after` are shaped alike: [B, n, d_model] for one layer, [B, layers, n, d_model] for a model."""
  before: jax.Array
  after: jax.Array
  is_before: jax.Array  # [B, T] bool

  @property
  def shape(self) -> tuple[int, ...]:
    return self.after.shape

  def layer(self, index: int) -> SplitLatents:
    """One layer's latents of a model's [B, layers, n, d_model] pair."""
    return SplitLatents(self.before[:, index], self.after[:, index], self.is_before)


def latent_positions(n: int, span: int) -> jax.Array:
  """[n] int32: n latent vectors spread evenly over positions [0, span), each at the middle of its share."""
  return ((2 * jnp.arange(n, dtype=jnp.int32) + 1) * span) // (2 * n)


class CrossAttention(nn.Module):
  """x [B, T, d_model] (queries), z [B, n, d_model] (keys and values) -> [B, T, d_model]; z may be a `SplitLatents`
  pair instead, each position reading its own (the attention runs against both, the output projection once).

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
    k_proj = dense(heads, ("embed", "heads", "head_dim"), self.std, self.dtype, "k", fp8=self.fp8)
    v_proj = dense(heads, ("embed", "heads", "head_dim"), self.std, self.dtype, "v", fp8=self.fp8)
    if self.rope_span is not None:
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
      q = apply_rope(q, positions, self.rope_theta)

    def attend(latents):
      k, v = k_proj(latents.astype(x.dtype)), v_proj(latents.astype(x.dtype))
      if self.rope_span is not None:
        z_positions = jnp.broadcast_to(latent_positions(latents.shape[1], self.rope_span), latents.shape[:2])
        k = apply_rope(k, z_positions, self.rope_theta)
      return ops.attention(q, k, v, causal=False, impl=self.impl)

    if isinstance(z, SplitLatents):
      y = jnp.where(z.is_before[:, :, None, None], attend(z.before), attend(z.after))
    else:
      y = attend(z)
    return dense(d_model, ("heads", "head_dim", "embed"), self.out_std, self.dtype, "out", in_axis=(-2, -1),
                 fp8=self.fp8)(y)
