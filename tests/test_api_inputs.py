"""The Python API refuses bad input at its boundary, with one-line ValueErrors: token ids outside the vocabulary,
empty sequences, a state made for another batch size, and sampling settings the sampler cannot use."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from conftest import ROOT, micro_config
import ltm_jax
from ltm_jax import api
from ltm_jax import model as model_lib
from ltm_jax.config import Config, ConfigError, LatentConfig, ModelConfig
from ltm_jax.inference import inputs

VOCAB = 259  # micro_config's (the byte tokenizer's) vocabulary; the embedding is padded to 384 rows.


@pytest.fixture(scope="module")
def lm():
  return api.build(micro_config())


@pytest.fixture(scope="module")
def latent_lm():
  cfg = micro_config()
  return api.build(dataclasses.replace(cfg, latent=LatentConfig(enabled=True, n_per_layer=2, inner_steps=1)))


def _one_line(excinfo) -> str:
  message = str(excinfo.value)
  assert "\n" not in message, message
  return message


def test_padded_vocabulary_is_larger_than_the_vocabulary(lm):
  assert lm.config.model.vocab_size == VOCAB and lm.config.model.padded_vocab_size == 384


@pytest.mark.parametrize("bad", [-1, VOCAB, 384, 2**31 - 1, 2**40])
def test_ids_outside_the_vocabulary_are_refused_by_every_entry_point(lm, latent_lm, bad):
  tokens = np.full((2, 8), 65, np.int64)
  tokens[0, 5] = bad
  message = re.escape(f"token id {bad} at [0, 5] is outside the vocabulary [0, {VOCAB})")
  key = jax.random.key(0)
  calls = {
      "forward": lambda: lm.forward(tokens),
      "forward of a list": lambda: lm.forward(tokens.tolist()),
      "step": lambda: lm.step(lm.init_state(2), tokens),
      "generate_tokens": lambda: lm.generate_tokens(tokens, 4, key=key),
      "generate_tokens, ragged": lambda: lm.generate_tokens([tokens[0], tokens[1, :3]], 4, key=key),
      "stream_tokens": lambda: lm.stream_tokens(tokens, 4, key=key),  # Refused by the call, before iterating.
      "fit_latents": lambda: latent_lm.fit_latents(tokens),
      "forward, latents": lambda: latent_lm.forward(tokens, "prior"),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match=message) as excinfo:
      call()
    assert _one_line(excinfo), name
  with pytest.raises(ValueError, match=re.escape(f"token id {bad} at [5] is outside")):
    lm.forward(tokens[0])  # A single sequence: the index within it.
  with pytest.raises(ValueError, match=re.escape(f"stop token id {bad} at [1] is outside")):
    lm.generate_tokens(tokens[1:], 4, key=key, stop_tokens=(3, bad))


def test_ids_at_both_ends_of_the_vocabulary_are_read(lm):
  logits = lm.forward(np.array([[0, 1, VOCAB - 1]], np.uint16))
  assert logits.shape == (1, 3, VOCAB) and bool(np.isfinite(logits).all())


def test_non_integer_ids_are_refused(lm):
  with pytest.raises(ValueError, match="token ids must be integers, got dtype float64"):
    lm.forward(np.array([[1.0, 2.5]]))
  with pytest.raises(ValueError, match="token ids must be integers, got dtype bool"):
    lm.step(lm.init_state(1), np.array([[True]]))


@pytest.mark.parametrize("tokens", [[], np.zeros((1, 0), np.int32), np.zeros((0, 4), np.int32), [[[1]]]])
def test_empty_or_misshapen_sequences_are_refused(lm, tokens):
  with pytest.raises(ValueError, match=r"forward needs token ids \[B, T\] or \[T\] with B >= 1 and T >= 1") as e:
    lm.forward(tokens)
  _one_line(e)


def test_other_empty_inputs_are_refused(lm, latent_lm):
  with pytest.raises(ValueError, match=r"step needs token ids \[B, T\] with B >= 1 and T >= 1, got shape \(1, 0\)"):
    lm.step(lm.init_state(1), np.zeros((1, 0), np.int32))
  with pytest.raises(ValueError, match=r"step needs token ids \[B, T\] with"):
    lm.step(lm.init_state(1), [65])
  with pytest.raises(ValueError, match=r"prompt must be token ids \[B, T\] with B >= 1 and T >= 1"):
    lm.generate_tokens(np.zeros((1, 0), np.int32), 4, key=jax.random.key(0))
  with pytest.raises(ValueError, match="every prompt needs at least one token"):
    lm.generate_tokens([[65], []], 4, key=jax.random.key(0))
  with pytest.raises(ValueError, match=r"fit_latents needs token ids \[B, T\] with B >= 1 and T >= 2, got shape"):
    latent_lm.fit_latents(np.zeros((2, 1), np.int32))
  with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
    lm.init_state(0)


def test_a_state_for_another_batch_size_is_refused(lm):
  with pytest.raises(ValueError, match=r"tokens for batch size 3 with a state made for batch size 2") as e:
    lm.step(lm.init_state(2), np.full((3, 1), 65, np.int32))
  _one_line(e)


@pytest.mark.parametrize("pattern, scan", [("RA", False), ("RA", True), ("A", True), ("W", True)])
def test_the_batch_size_of_every_state_layout_is_found(pattern, scan):
  cfg = micro_config(layer_pattern=pattern, scan_layers=scan, rwkv7_head_size=16, n_layers=4).model
  assert inputs.state_batch(cfg, model_lib.init_state(cfg, 3, capacity=8)) == 3


@pytest.mark.parametrize("options, message", [
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature="0.5"), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\] or None, got 0.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\] or None, got nan"),
    (dict(top_k=0), "top_k must be an integer >= 1, got 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 1, got 2.5"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=3.0), "max_new_tokens must be an integer >= 1, got 3.0"),
    (dict(chunk=0), "chunk must be an integer >= 1, got 0"),
])
def test_sampling_settings_are_refused_by_every_generation_method(lm, options, message):
  options = {"max_new_tokens": 4, **options}
  prompt, key = np.full((1, 3), 65, np.int32), jax.random.key(0)
  calls = [lambda: lm.stream("ab", **options), lambda: lm.stream_tokens(prompt, key=key, **options)]
  if "chunk" not in options:  # Only the streaming methods take a chunk.
    calls += [lambda: lm.generate("ab", **options), lambda: lm.generate_tokens(prompt, key=key, **options)]
  for call in calls:
    with pytest.raises(ValueError, match=message) as e:
      call()
    _one_line(e)


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**63, 1.5, True])
def test_seeds_jax_cannot_take_are_refused(lm, latent_lm, seed):
  message = re.escape(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
  for call in (lambda: lm.generate("ab", 4, seed=seed), lambda: lm.stream("ab", 4, seed=seed),
               lambda: latent_lm.prior_latents(1, seed=seed)):
    with pytest.raises(ValueError, match=message):
      call()


def test_generate_and_stream_take_token_ids_as_they_take_text(lm):
  """Token ids [T] are one prompt (a string back), a list of sequences or a [B, T] array several (a list back): the
  same continuations as the text that encodes to them."""
  greedy = dict(max_new_tokens=3, temperature=0.0, stop_at_eos=False)
  assert lm.generate([72, 101], **greedy) == lm.generate(np.array([72, 101]), **greedy) == lm.generate("He", **greedy)
  assert lm.generate([[72, 101], [65]], **greedy) == lm.generate(["He", "A"], **greedy)
  assert lm.generate(np.array([[72, 101], [65, 66]]), **greedy) == lm.generate(["He", "AB"], **greedy)
  assert "".join(lm.stream((72, 101), chunk=3, **greedy)) == lm.generate("He", **greedy)  # One program.


@pytest.mark.parametrize("prompt, described", [(None, "None"), ([], "an empty list"), (["a", 1], "a list of int, str"),
                                               (5, "int"), (b"He", "bytes"), ([[1.5]], "a list of list")])
def test_a_prompt_of_another_type_is_refused_naming_the_accepted_ones(lm, prompt, described):
  for call in (lambda: lm.generate(prompt, 3), lambda: lm.stream(prompt, 3)):
    with pytest.raises(ValueError, match=re.escape(f"takes {inputs.PROMPT_TYPES}; got {described}")) as e:
      call()
    _one_line(e)
  with pytest.raises(ValueError, match=re.escape("stream takes one prompt (a string or token ids [T]), got 2 prompts")):
    lm.stream(["a", "b"], 3)


def test_text_where_token_ids_are_taken_is_refused_in_one_line(lm, latent_lm):
  calls = {"forward": lambda x: lm.forward(x), "step": lambda x: lm.step(lm.init_state(1), x),
           "fit_latents": lambda x: latent_lm.fit_latents(x),
           "prompt": lambda x: lm.generate_tokens(x, 3, key=jax.random.key(0))}
  for name, call in calls.items():
    with pytest.raises(ValueError, match=f"{name} takes token ids .* got str; lm.encode\\(text\\) gives") as e:
      call("Hello")
    _one_line(e)
    with pytest.raises(ValueError, match=f"{name} takes token ids .* got None$"):
      call(None)


def test_configs_and_overrides_the_api_cannot_take_are_refused_on_one_line():
  """build() validates the config it is given; an override string (not a list of them) is refused, not read a
  character at a time."""
  with pytest.raises(ConfigError, match=r"^model.d_model=30 is not divisible by model.n_heads=4$"):
    api.build(Config(model=ModelConfig(d_model=30, n_heads=4)))
  with pytest.raises(ConfigError, match=r"^overrides must be a list of key=value strings, got the string "
                                        r"'model.d_model=64 model.n_layers=1'; pass \['model.d_model=64', "):
    ltm_jax.load_config(ROOT / "configs" / "tiny.py", "model.d_model=64 model.n_layers=1")
