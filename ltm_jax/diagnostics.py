"""Diagnostics read from a forward pass: the Titans memory layers' statistics (`memory_statistics`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.config import LatentConfig, ModelConfig
from ltm_jax.quantize import dequantize_params

MEMORY_MIXERS = ("titans_mal", "titans_mag")


@functools.partial(jax.jit, static_argnames=("cfg", "latent"))
def _intermediates(cfg: ModelConfig, latent: LatentConfig | None, params, tokens, latents):
  params = dequantize_params(params, jnp.dtype(cfg.dtype))
  _, variables = model_lib.LM(cfg, latent).apply({"params": params}, tokens, latents=latents,
                                                  mutable=["intermediates"])
  return variables["intermediates"]


def memory_statistics(cfg: ModelConfig, latent: LatentConfig | None, params, tokens, latents=None
                      ) -> dict[str, dict[str, np.ndarray]]:
  """For every Titans layer ("block_<i>"), from one pass over tokens [B, T] from empty states:
  `surprise`, `momentum_decay`, `learning_rate`, `retention` [B, T, H] per token and head (see
  `ltm_jax.layers.titans.NeuralMemory`), and `weight_norm`, `momentum_norm` [B, H] after the last token.
  Scanned models are read through their per-layer parameters. Raises ValueError without Titans layers."""
  if not set(MEMORY_MIXERS) & set(cfg.mixers):
    raise ValueError(f"model.layer_pattern={cfg.layer_pattern!r} has no Titans memory layer (M or G)")
  if cfg.scan_layers:
    params = model_lib.unscan_params(cfg, params)
    cfg = dataclasses.replace(cfg, scan_layers=False)
  found = _intermediates(cfg, model_lib.uses_latents(latent), params, jnp.asarray(tokens), latents)
  return {block: {name: np.asarray(value[0]) for name, value in layer["mixer"]["memory"].items()}
          for block, layer in found.items() if cfg.mixers[int(block.split("_")[1])] in MEMORY_MIXERS}


def memory_summary(cfg: ModelConfig, latent: LatentConfig | None, params, tokens) -> dict[str, float]:
  """`memory_statistics` as scalars for training logs: memory_<block>_<statistic>, each averaged over rows, tokens
  and heads. Latent models read z = 0, the prior's mean."""
  latent = model_lib.uses_latents(latent)
  latents = None if latent is None else jnp.zeros(model_lib.latent_shape(cfg, latent, tokens.shape[0]), jnp.float32)
  stats = memory_statistics(cfg, latent, params, tokens, latents)
  return {f"memory_{block}_{name}": float(np.mean(value)) for block, layer in stats.items()
          for name, value in layer.items()}
