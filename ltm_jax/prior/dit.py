"""A diffusion transformer (DiT, Peebles & Xie, 2023) over latent thoughts: one token per latent slot.

z [B, layers, n_per_layer, d_latent] (one entry per latent-reading layer) becomes layers * n_per_layer tokens of
`width`, each tagged with a learned embedding of its layer and of its slot within the layer, so attention between slots sees which decoder layer each
vector feeds. The diffusion time conditions every block through adaLN-Zero: a zero-initialised linear map of the
time embedding gives each block's shift, scale and residual gate, so every block starts as the identity and the
untrained network predicts eps = 0. The output is the predicted noise, shaped like z.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.config import PriorConfig


def timestep_embedding(t: jax.Array, dim: int, max_period: float = 10_000.0) -> jax.Array:
  """Sinusoidal features [B, dim] of t [B] in [0, 1], scaled by 1000 so the fastest frequencies resolve 1e-3."""
  half = dim // 2
  freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
  angles = 1000.0 * t[:, None].astype(jnp.float32) * freqs[None]
  return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
  return x * (1.0 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
  width: int
  n_heads: int
  mlp_ratio: int

  @nn.compact
  def __call__(self, x: jax.Array, c: jax.Array) -> jax.Array:
    """x [B, N, width] tokens, c [B, width] the conditioning (time) embedding."""
    modulation = nn.Dense(6 * self.width, kernel_init=nn.initializers.zeros, name="adaln")(nn.silu(c))
    shift_attn, scale_attn, gate_attn, shift_mlp, scale_mlp, gate_mlp = jnp.split(modulation, 6, axis=-1)
    norm = lambda name: nn.LayerNorm(epsilon=1e-6, use_bias=False, use_scale=False, name=name)
    h = _modulate(norm("norm_attn")(x), shift_attn, scale_attn)
    h = nn.MultiHeadDotProductAttention(self.n_heads, name="attn")(h, h)
    x = x + gate_attn[:, None] * h
    h = _modulate(norm("norm_mlp")(x), shift_mlp, scale_mlp)
    h = nn.Dense(self.mlp_ratio * self.width, name="mlp_in")(h)
    h = nn.Dense(self.width, name="mlp_out")(nn.gelu(h, approximate=True))
    return x + gate_mlp[:, None] * h


class DiT(nn.Module):
  """eps_theta(x_t, t): x [B, n_layers, n_per_layer, d_latent], t [B] -> [B, n_layers, n_per_layer, d_latent]."""
  cfg: PriorConfig

  @nn.compact
  def __call__(self, x: jax.Array, t: jax.Array) -> jax.Array:
    batch, n_layers, n_per_layer, d_latent = x.shape
    width = self.cfg.width
    h = nn.Dense(width, name="embed")(x.reshape(batch, n_layers * n_per_layer, d_latent))
    init = nn.initializers.normal(0.02)
    layer_embedding = self.param("layer_embedding", init, (n_layers, 1, width))
    slot_embedding = self.param("slot_embedding", init, (1, n_per_layer, width))
    h = h + (layer_embedding + slot_embedding).reshape(1, n_layers * n_per_layer, width)
    c = nn.Dense(width, name="time_in")(timestep_embedding(t, width))
    c = nn.Dense(width, name="time_out")(nn.silu(c))
    for i in range(self.cfg.depth):
      h = DiTBlock(width, self.cfg.n_heads, self.cfg.mlp_ratio, name=f"block_{i}")(h, c)
    shift, scale = jnp.split(nn.Dense(2 * width, kernel_init=nn.initializers.zeros, name="final_adaln")(nn.silu(c)),
                             2, axis=-1)
    h = _modulate(nn.LayerNorm(epsilon=1e-6, use_bias=False, use_scale=False, name="final_norm")(h), shift, scale)
    out = nn.Dense(d_latent, kernel_init=nn.initializers.zeros, name="out")(h)
    return out.reshape(x.shape)
