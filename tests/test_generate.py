"""Generation through the state API against naive full-sequence recomputation, and the sampling options."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import api


@pytest.fixture(scope="module", params=["RA", "A", "R"])
def lm(request):
  cfg = micro_config(layer_pattern=request.param, window=6 if request.param == "A" else None)
  model = api.build(cfg, seed=1)
  # Random init gives near-uniform logits; spread them so greedy choices are not decided by rounding.
  model.params["head"]["kernel"] = model.params["head"]["kernel"] * 200.0
  return model


def test_greedy_decoding_equals_full_recomputation(lm):
  prompt = np.array([[72, 101, 108, 108, 111, 32, 119]], np.int32)
  tokens = lm.generate_tokens(prompt, 12, key=jax.random.key(0), temperature=0.0, stop_at_eos=False)
  # Naive: rerun the whole sequence for every new token. The sequence sits in a buffer of its final length (one
  # compiled forward pass); the positions not yet generated hold zeros, which the causal model's logit at the last
  # generated position never reads.
  sequence = np.zeros((1, prompt.shape[1] + 12), np.int32)
  sequence[:, :prompt.shape[1]] = prompt
  for end in range(prompt.shape[1], sequence.shape[1]):
    logits = lm.forward(sequence)
    sequence[:, end] = np.asarray(jnp.argmax(logits[:, end - 1], -1))
  np.testing.assert_array_equal(tokens, sequence[:, prompt.shape[1]:])


def test_sampling_is_reproducible_and_top_k_one_is_greedy(lm):
  prompt = np.array([[65, 66, 67]], np.int32)
  a = lm.generate_tokens(prompt, 10, key=jax.random.key(3), temperature=1.0, top_p=0.9)
  b = lm.generate_tokens(prompt, 10, key=jax.random.key(3), temperature=1.0, top_p=0.9)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (1, 10) and a.dtype == np.int32
  hot = [lm.generate_tokens(prompt, 10, key=jax.random.key(seed), temperature=20.0, stop_at_eos=False)
         for seed in (4, 5)]
  assert not np.array_equal(*hot)  # The key matters: a sampler ignoring it would repeat itself.
  greedy = lm.generate_tokens(prompt, 10, key=jax.random.key(5), temperature=0.0, stop_at_eos=False)
  top1 = lm.generate_tokens(prompt, 10, key=jax.random.key(6), temperature=1.0, top_k=1, stop_at_eos=False)
  np.testing.assert_array_equal(greedy, top1)


def test_text_generation_and_prompt_limits(lm):
  text = lm.generate("def f(x):", max_new_tokens=8, temperature=0.7, top_k=20, seed=1)
  assert isinstance(text, str)
  assert len(lm.generate(["a", "bc"], max_new_tokens=4)) == 2
  if "attention" in lm.config.model.mixers and lm.config.model.window is None:
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
      lm.generate_tokens(np.zeros((1, 100), np.int32) + 65, 29, key=jax.random.key(0))


def test_step_refuses_to_overflow_the_attention_cache():
  lm = api.build(micro_config(layer_pattern="RA"))  # Full attention: the context is bounded by max_seq_len.
  m = lm.config.model
  state = lm.init_state(1)
  _, state = lm.step(state, np.full((1, m.max_seq_len - 2), 65, np.int32))
  with pytest.raises(ValueError, match="beyond the attention cache's capacity of 128"):
    lm.step(state, np.full((1, 3), 65, np.int32))


def test_a_model_whose_attention_kernel_takes_no_positions_prefills_ragged_prompts_and_decodes():
  """A model configured with attention_impl="pallas" (a kernel without explicit positions) runs its calls over a
  cache by "auto": the tokens of the same model configured with xla, for ragged prompts and segment by segment."""
  def build(impl):
    cfg = micro_config(layer_pattern="A")
    lm = api.build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl)), seed=1)
    lm.params["head"]["kernel"] = lm.params["head"]["kernel"] * 200.0
    return lm
  xla, pallas = build("xla"), build("pallas")
  prompts = [[72, 101, 108, 108], [111], [32, 119, 111]]
  expected = xla.generate_tokens(prompts, 5, key=jax.random.key(0), temperature=0.0, stop_at_eos=False)
  got = pallas.generate_tokens(prompts, 5, key=jax.random.key(0), temperature=0.0, stop_at_eos=False)
  np.testing.assert_array_equal(got, expected)
  tokens = np.array([prompts[0] + [5, 6]], np.int32)
  first, state = pallas.step(pallas.init_state(1), tokens[:, :4])
  second, _ = pallas.step(state, tokens[:, 4:])
  np.testing.assert_allclose(np.concatenate([first, second], 1), xla.forward(tokens), atol=2e-4, rtol=1e-5)


def test_step_api_continues_forward(lm):
  tokens = jax.random.randint(jax.random.key(9), (2, 10), 0, 259)
  state = lm.init_state(2)
  first, state = lm.step(state, tokens[:, :6])
  second, _ = lm.step(state, tokens[:, 6:])
  np.testing.assert_allclose(np.concatenate([first, second], 1), lm.forward(tokens), atol=2e-4, rtol=1e-5)


def test_ragged_text_prompts_batch_like_each_alone(lm):
  prompts = ["def f(x):", "a", "The list type"]
  batch = lm.generate(prompts, max_new_tokens=6, temperature=0.0, stop_at_eos=False)
  assert batch == [lm.generate(p, max_new_tokens=6, temperature=0.0, stop_at_eos=False) for p in prompts]


def test_streamed_text_joins_to_the_generated_text(lm):
  pieces = list(lm.stream("Hello", 11, chunk=4, temperature=1.0, top_p=0.9, seed=2))
  assert len(pieces) >= 2  # Really streamed: more than one piece came out.
  assert "".join(pieces) == lm.generate("Hello", 11, temperature=1.0, top_p=0.9, seed=2)


def test_stop_strings_end_each_rows_text_and_the_decoding(lm, monkeypatch):
  """Each row's text ends before the first of the stop strings (not included), streamed or not; once every row has
  stopped, no further chunk is decoded."""
  prompts = ["def f(x):", "a"]
  full = lm.generate(prompts, 16, temperature=0.0, stop_at_eos=False)
  stops = [full[0][5:7], full[1][3:5]]
  cut = [text[:min(i for i in (text.find(s) for s in stops) if i >= 0)] for text in full]
  decoded = []
  decode = api.generation.decode
  monkeypatch.setattr(api.generation, "decode", lambda *a, **k: decoded.append(k["steps"]) or decode(*a, **k))
  assert lm.generate(prompts, 48, temperature=0.0, stop_at_eos=False, stop=stops) == cut
  assert decoded == [16]  # Chunks of 16 tokens: both rows stopped in the first of three.
  assert "".join(lm.stream(prompts[0], 16, chunk=8, temperature=0.0, stop_at_eos=False, stop=stops)) == cut[0]
  assert lm.generate(prompts[0], 16, temperature=0.0, stop_at_eos=False, stop="\x00never") == full[0]
  with pytest.raises(ValueError, match="stop must be a non-empty string or a list of them, got"):
    lm.generate(prompts, 4, stop=[""])
