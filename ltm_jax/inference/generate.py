"""Generation: one jitted prefill of a batch of ragged prompts, then a decode loop that runs on device.

  decoding = prefill(model, params, tokens, lengths)        # prompts left-padded to [B, T]; every layer's state
  tokens, decoding = decode(model, params, decoding, key, steps=N, ...)   # [B, N] new tokens, one lax.while_loop

`decode` can be called again on the Decoding it returns, which is how tokens are streamed: the i-th token of a call
sequence is always drawn with `fold_in(key, i)`, so decoding in chunks gives exactly the tokens of one call. The
loop stops early once every row has produced a stop token; a finished row repeats its stop token.

`params` may hold quantised weights (`ltm_jax.quantize`), so the integer values are what lives in device
memory between calls. Kernels of a kind the platform reads as stored (`kernels_read_quantized`: int8 and int4 on
GPU, none on CPU, where it was measured to be slower) are multiplied as they are inside every step, so the loop
reads their integer bytes; the others are dequantised inside the jitted computation ahead of the loop, which then
runs at the float model's speed on a transient float copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.inference.quantize import dequantize_params, kernels_read_quantized
from ltm_jax.layers.attention import token_positions
from ltm_jax.ops import sample_logits


class Decoding(NamedTuple):
  """Where a batch of generations stands between `decode` calls.

  state: the model's per-layer state (caches, recurrent states) after every token fed so far.
  logits: [B, V] float32, the logits of each row's next token.
  positions: [B] int32, the position of each row's next token.
  last_token: [B] int32, each row's latest token (a finished row keeps repeating its stop token).
  done: [B] bool, rows that have produced a stop token.
  generated: [] int32, tokens sampled so far per row (the index of the next sampling key).
  """
  state: Any
  logits: jax.Array
  positions: jax.Array
  last_token: jax.Array
  done: jax.Array
  generated: jax.Array


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Ragged prompts -> (tokens [B, T] int32 right-aligned, lengths [B] int32), T the longest prompt. Padding goes
  first so that every row's last prompt token, and so its next-token logits and final state, sit at T - 1."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  if lengths.size == 0 or lengths.min() < 1:
    raise ValueError("every prompt needs at least one token (start an empty prompt with the bos token)")
  tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
  for row, (prompt, n) in enumerate(zip(prompts, lengths)):
    tokens[row, tokens.shape[1] - n:] = np.asarray(prompt, np.int32)
  return tokens, lengths


def prompt_mask(lengths: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
  """(valid [B, T] bool, positions [B, T] int32) of left-padded prompts of `lengths` [B]: a row's tokens sit at
  positions 0..n-1; padding is invalid and at position 0."""
  valid = jnp.arange(length, dtype=jnp.int32)[None] >= (length - lengths)[:, None]
  return valid, token_positions(jnp.zeros(lengths.shape, jnp.int32), valid, length)


def model_params(model: nn.Module, params, kernels_as_stored: tuple[str, ...] | None = None):
  """Params that may hold quantised weights, as the model reads them (inside jit): quantised kernels of the kinds in
  `kernels_as_stored` (None: the platform's `kernels_read_quantized`) stay quantised, the rest is dequantised to the
  compute dtype."""
  keep = kernels_read_quantized() if kernels_as_stored is None else kernels_as_stored
  return dequantize_params(params, jnp.dtype(model.cfg.dtype), keep)


def run_model(model: nn.Module, params, *args, kernels_as_stored: tuple[str, ...] | None = None):
  """`model.apply` on params that may hold quantised weights (`model_params`; inside jit)."""
  return model.apply({"params": model_params(model, params, kernels_as_stored)}, *args)


@functools.partial(jax.jit, static_argnames=("model", "kernels_as_stored"))
def prefill(model: nn.Module, params, tokens: jax.Array, lengths: jax.Array, latents=None, *,
            kernels_as_stored: tuple[str, ...] | None = None) -> Decoding:
  """Runs left-padded prompts tokens [B, T] (row b's last lengths[b] tokens are its prompt) through the model's
  parallel path, from empty states. `model.cache_capacity` sizes full-attention caches, which must cover prompt and
  generation. `latents` [B, latent layers, n_per_layer, d_model] for latent models, else None. `kernels_as_stored`: see
  `model_params`."""
  batch, length = tokens.shape
  valid, positions = prompt_mask(lengths, length)
  logits, state = run_model(model, params, tokens, None, latents, positions, valid, True,
                            kernels_as_stored=kernels_as_stored)
  return Decoding(state, logits[:, -1], lengths.astype(jnp.int32), tokens[:, -1], jnp.zeros((batch,), bool),
                  jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("model", "steps", "top_k", "stop_tokens", "kernels_as_stored"),
                   donate_argnames=("decoding",))
def decode(model: nn.Module, params, decoding: Decoding, key: jax.Array, *, steps: int, temperature=1.0,
           top_k: int | None = None, top_p=None, stop_tokens: tuple[int, ...] = (), latents=None,
           kernels_as_stored: tuple[str, ...] | None = None) -> tuple[jax.Array, Decoding]:
  """Samples up to `steps` tokens per row -> (tokens [B, steps] int32, the Decoding after them).

  Each step samples from `decoding.logits` (temperature 0 is greedy; top_k, top_p as in `ops.sample_logits`) and
  feeds the token back through the recurrent states and caches. `decoding` is donated: its buffers are reused.
  `kernels_as_stored`: see `model_params`.
  """
  stops = jnp.asarray(stop_tokens, jnp.int32)
  # Dequantised once, ahead of the token loop, rather than left for XLA to hoist out of it.
  params = model_params(model, params, kernels_as_stored)

  def draw(d: Decoding) -> tuple[Decoding, jax.Array]:
    token = sample_logits(jax.random.fold_in(key, d.generated), d.logits, temperature=temperature, top_k=top_k,
                          top_p=top_p)
    token = jnp.where(d.done, d.last_token, token)
    done = (d.done | jnp.isin(token, stops)) if stop_tokens else d.done
    return feed(model, params, d, token, done, latents, 1), token

  # Stopped early: every row is finished, so the rest is its stop token repeated.
  tokens, _, decoding = token_loop(draw, decoding, steps, lambda d: d)
  return tokens, decoding


def feed(model: nn.Module, params, decoding: Decoding, token: jax.Array, done: jax.Array, latents,
         drawn) -> Decoding:
  """`decoding` after running one token per row, token [B] int32, through the model (params as it reads them,
  `model_params`): `done` [B] marks the rows finished after it, `drawn` (a count, or [B]) is added to
  `generated`."""
  logits, state = model.apply({"params": params}, token[:, None], decoding.state, latents,
                              decoding.positions[:, None])
  return Decoding(state, logits[:, -1], decoding.positions + 1, token, done, decoding.generated + drawn)


Carry = TypeVar("Carry")


def token_loop(draw: Callable[[Carry], tuple[Carry, jax.Array]], carry: Carry, steps: int,
               decoding_of: Callable[[Carry], Decoding], limit: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, Carry]:
  """Calls `draw(carry) -> (carry, token [B] int32)` up to `steps` times in one lax.while_loop, stopping once every
  row of `decoding_of(carry)` is done -> (tokens [B, steps] int32, calls made [] int32, carry). The columns past the
  calls made hold each row's last token. `limit` (a traced int32 scalar; None: `steps`) stops the loop sooner, after
  min(limit, steps) calls, without a program of its own."""
  bound = steps if limit is None else jnp.minimum(limit, steps)

  def unfinished(loop):
    i, c, _ = loop
    return (i < bound) & ~jnp.all(decoding_of(c).done)

  def step(loop):
    i, c, tokens = loop
    c, token = draw(c)
    return i + 1, c, tokens.at[:, i].set(token)

  init = (jnp.zeros((), jnp.int32), carry, jnp.zeros((decoding_of(carry).logits.shape[0], steps), jnp.int32))
  count, carry, tokens = jax.lax.while_loop(unfinished, step, init)
  tokens = jnp.where(jnp.arange(steps) < count, tokens, decoding_of(carry).last_token[:, None])
  return tokens, count, carry
