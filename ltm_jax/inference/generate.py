"""Sampling from the LM: one jitted prefill + `lax.scan` decode over the model's per-layer state."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax import model as model_lib
from ltm_jax.ops import sample_logits


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k", "stop_token"))
def generate_tokens(model: nn.Module, params, prompt, key, *, max_new_tokens: int, temperature=1.0,
                    top_k: int | None = None, top_p=None, stop_token: int | None = None, latents=None):
  """Continues prompt [B, T] int32 by max_new_tokens tokens -> [B, max_new_tokens] int32.

  temperature 0 is greedy. After `stop_token` is produced a row keeps emitting `stop_token`, so everything from the
  first stop token on can be cut by the caller. Full-attention layers need T + max_new_tokens <= model.max_seq_len.
  `latents` [B, n_layers, n_per_layer, d_model] condition every token (required by latent models, else None).
  """
  batch, length = prompt.shape
  state = model_lib.init_state(model.cfg, batch)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompt.shape)
  logits, state = model.apply({"params": params}, prompt, state, latents, positions)

  def decode(carry, xs):
    last_logits, state, done = carry
    step_key, position = xs
    token = sample_logits(step_key, last_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if stop_token is not None:
      token = jnp.where(done, stop_token, token)
      done = done | (token == stop_token)
    positions = jnp.full((batch, 1), position, jnp.int32)
    logits, state = model.apply({"params": params}, token[:, None], state, latents, positions)
    return (logits[:, -1], state, done), token

  done = jnp.zeros((batch,), bool)
  xs = (jax.random.split(key, max_new_tokens), length + jnp.arange(max_new_tokens, dtype=jnp.int32))
  _, tokens = jax.lax.scan(decode, (logits[:, -1], state, done), xs)
  return tokens.T
