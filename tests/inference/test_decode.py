"""Prefill + on-device decode against the full forward pass, for every mixer, a hybrid and a latent model.

The reference is the model's parallel forward over each finished sequence alone (no cache, no padding, no state):
every logit the decoder used must match it, for every row of a ragged batch. Tolerance: float32 logits within
1e-4 absolute (they are O(1)-O(10)); measured differences are ~1e-6.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import classic_latent, micro_config
from ltm_jax import api
from ltm_jax import model as model_lib
from ltm_jax.inference import decode, left_pad, prefill

ATOL = 1e-4
PROMPTS = ([72, 101, 108, 108, 111], [65, 66], [33, 34, 35, 36, 37, 38, 39])  # Ragged: 5, 2 and 7 tokens.
NEW = 6  # Decoded tokens; with the 7-token prompt, 13 positions: past the 4-token window.

VARIANTS = {
    "attention": dict(layer_pattern="A"),
    "attention_window_gqa": dict(layer_pattern="A", window=4, n_kv_heads=2),
    "rwkv4": dict(layer_pattern="R"),
    "rwkv7": dict(layer_pattern="W", rwkv7_head_size=16),
    "hybrid": dict(layer_pattern="RWA", n_layers=3, rwkv7_head_size=16, window=4),
    # Ragged prompts start their chunks apart; a deep (2-layer) memory.
    "titans": dict(layer_pattern="MG", window=4, memory_chunk=3, memory_depth=2),
    "latent_scanned": dict(layer_pattern="RA", n_layers=4, scan_layers=True),  # States stacked per unit block.
}


def _model(variant: str) -> api.LanguageModel:
  cfg = micro_config(**VARIANTS[variant])
  if variant == "latent_scanned":
    cfg = dataclasses.replace(cfg, latent=classic_latent(n_per_layer=2, rope=True, rope_span=16))
  lm = api.build(cfg, seed=1)
  # Random init gives near-uniform logits; spread them so greedy choices are not decided by rounding.
  head = "head" if "head" in lm.params else "embed"
  lm.params[head] = jax.tree.map(lambda w: w * 100.0, lm.params[head])
  return lm


@functools.cache
def _decode(variant: str):
  """Greedy decoding of the ragged PROMPTS, one token per `decode` call, keeping every logit the decoder used."""
  lm = _model(variant)
  tokens, lengths = left_pad(PROMPTS, pad_id=7)
  latents = lm.prior_latents(len(PROMPTS), seed=3) if lm.has_latents else None
  model = model_lib.LM(lm.config.model, lm.config.latent, cache_capacity=tokens.shape[1] + NEW)
  d = prefill(model, lm.params, tokens, lengths, latents)
  logits, generated = [np.asarray(d.logits)], []
  for _ in range(NEW):
    token, d = decode(model, lm.params, d, jax.random.key(0), steps=1, temperature=0.0, latents=latents)
    generated.append(np.asarray(token[:, 0]))
    logits.append(np.asarray(d.logits))
  return lm, latents, np.stack(generated, 1), np.stack(logits, 1), d


@pytest.fixture(scope="module", params=list(VARIANTS))
def decoded(request):
  return _decode(request.param)


def test_prefill_and_decode_equal_the_forward_pass_of_each_prompt_alone(decoded):
  lm, latents, generated, logits, _ = decoded
  # Each finished sequence alone, from position 0, in a buffer of the longest one's length (one compiled forward
  # pass): the zeros after its end come later than every logit read, which a causal model never lets them change.
  width = max(len(p) for p in PROMPTS) + NEW
  for row, prompt in enumerate(PROMPTS):
    sequence = np.zeros((1, width), np.int32)
    sequence[0, :len(prompt) + NEW] = np.concatenate([prompt, generated[row]])
    z = None if latents is None else latents[row:row + 1]
    reference = np.asarray(lm.forward(sequence, z))[0, len(prompt) - 1:len(prompt) + NEW]  # Chose each new token.
    np.testing.assert_allclose(logits[row], reference, atol=ATOL, rtol=0, err_msg=f"row {row}")
    np.testing.assert_array_equal(generated[row], reference[:-1].argmax(-1))


def test_one_loop_equals_token_by_token_loops(decoded):
  lm, latents, generated, _, _ = decoded
  tokens, lengths = left_pad(PROMPTS, pad_id=7)
  model = model_lib.LM(lm.config.model, lm.config.latent, cache_capacity=tokens.shape[1] + NEW)
  d = prefill(model, lm.params, tokens, lengths, latents)
  at_once, d = decode(model, lm.params, d, jax.random.key(0), steps=NEW, temperature=0.0, latents=latents)
  np.testing.assert_array_equal(at_once, generated)
  assert int(d.generated) == NEW
  np.testing.assert_array_equal(d.positions, [len(p) + NEW for p in PROMPTS])


def test_window_cache_is_a_ring_of_exactly_window_entries():
  lm, _, _, _, d = _decode("attention_window_gqa")
  window = lm.config.model.window
  cache = d.state[0].mixer
  assert cache.k.shape[1] == window  # Bounded whatever the generation length.
  for row, prompt in enumerate(PROMPTS):  # It holds the last `window` positions fed, each in slot p % window.
    last = len(prompt) + NEW - 1
    held = np.asarray(cache.positions[row])
    np.testing.assert_array_equal(np.sort(held), np.arange(last - window + 1, last + 1))
    np.testing.assert_array_equal(held % window, np.arange(window))


def test_stop_tokens_end_rows_and_the_loop():
  lm = _model("rwkv4")
  tokens, lengths = left_pad(PROMPTS)
  d = prefill(lm.model, lm.params, tokens, lengths)
  free, _ = decode(lm.model, lm.params, d, jax.random.key(0), steps=NEW, temperature=0.0)
  free = np.asarray(free)
  stop = int(free[0, 2])  # Row 0 reaches it at step 2 (or earlier); the other rows may never.
  d = prefill(lm.model, lm.params, tokens, lengths)
  stopped, d = decode(lm.model, lm.params, d, jax.random.key(0), steps=NEW, temperature=0.0, stop_tokens=(stop,))
  stopped = np.asarray(stopped)
  for row in range(len(PROMPTS)):
    hits = np.flatnonzero(free[row] == stop)
    end = hits[0] + 1 if hits.size else NEW
    np.testing.assert_array_equal(stopped[row, :end], free[row, :end])  # Unchanged up to its stop token...
    assert np.all(stopped[row, end:] == stop)  # ...which it then repeats.
  # Every row stopped at once: the loop ends after one token, not after NEW.
  d = prefill(lm.model, lm.params, tokens, lengths)
  first = tuple(int(t) for t in np.unique(free[:, 0]))
  stopped, d = decode(lm.model, lm.params, d, jax.random.key(0), steps=NEW, temperature=0.0, stop_tokens=first)
  assert int(d.generated) == 1
  np.testing.assert_array_equal(np.asarray(stopped), np.repeat(free[:, :1], NEW, axis=1))


def test_int8_weights_stay_close_and_greedy_mostly_agrees():
  lm = _model("hybrid")
  int8 = lm.quantize("int8")
  assert int8.param_bytes < 0.5 * lm.param_bytes
  tokens = jax.random.randint(jax.random.key(5), (2, 24), 0, 256)
  exact, approx = lm.forward(tokens), int8.forward(tokens)
  # Per-channel int8 keeps each weight within 0.4% of its channel's largest: logits move by ~1% of their spread.
  spread = float(jnp.std(exact))
  assert float(jnp.max(jnp.abs(approx - exact))) < 0.05 * spread
  prompt = [list(p) for p in PROMPTS]
  a = lm.generate_tokens(prompt, 12, key=jax.random.key(0), temperature=0.0, stop_at_eos=False)
  b = int8.generate_tokens(prompt, 12, key=jax.random.key(0), temperature=0.0, stop_at_eos=False)
  assert np.mean(a == b) >= 0.75, (a, b)
  np.testing.assert_array_equal(a[:, :3], b[:, :3])  # Diverging, if at all, only after a few tokens.
