"""The MM-Rec mixer (D): its memory bank against a token-by-token float64 walk of the stated policy, precomputed
against per-step projections, segments with a carried state (bank writes included), causality, config errors, and
one model-level check of ragged prefill + decode (scanned layers) and int8 weights. (The MDI op: tests/ops.)"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.config import apply_overrides, validate
from ltm_jax.errors import ConfigError
from ltm_jax.info import model_info
from ltm_jax.inference import decode, left_pad, prefill
from ltm_jax.inference.quantize import dequantize_params, quantize_params
from ltm_jax.layers.mmrec import MMRec, MMRecState, read_memory

SLOTS, SEGMENT, HEADS, SIZE = 2, 3, 2, 3


def _walk(query, hs, valid, state: MMRecState):
  """The policy token by token, in float64: a row's real tokens are numbered from its first (across calls); tokens
  n*S .. n*S + S - 1 form segment n; when a segment's last token is done, the mean of its h is written to slot
  n mod M. A token of segment n reads, by softmax attention per head, the summaries of segments n - M .. n - 1 (zero
  when there are none)."""
  query, hs, bank = (np.asarray(a, np.float64) for a in (query, hs, state.bank))
  written, filled = np.asarray(state.written), np.asarray(state.filled)
  batch, length, heads, size = query.shape
  read = np.zeros(query.shape)
  new_bank, new_written, new_partial, new_filled = bank.copy(), written.copy(), np.zeros(hs[:, 0].shape), filled.copy()
  for b in range(batch):
    summaries = {}  # Segment number -> summary, starting from what the bank holds.
    for i in range(SLOTS):
      numbers = [j for j in range(written[b]) if j % SLOTS == i]
      if numbers:
        summaries[max(numbers)] = bank[b, i]
    count, total = written[b] * SEGMENT + filled[b], np.asarray(state.partial[b], np.float64).copy()
    for t in range(length):
      if not valid[b, t]:
        continue
      segment = count // SEGMENT
      keys = [summaries[j] for j in range(segment - SLOTS, segment) if j in summaries]
      if keys:
        keys = np.stack(keys).reshape(len(keys), heads, size)
        scores = np.einsum("hn,jhn->hj", query[b, t], keys) / np.sqrt(size)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        read[b, t] = np.einsum("hj,jhn->hn", weights / weights.sum(-1, keepdims=True), keys)
      total, count = total + hs[b, t], count + 1
      if count % SEGMENT == 0:
        summaries[segment] = total / SEGMENT
        new_bank[b, segment % SLOTS] = total / SEGMENT
        total = np.zeros_like(total)
    new_written[b], new_filled[b], new_partial[b] = count // SEGMENT, count % SEGMENT, total
  return read, (new_bank, new_written, new_partial, new_filled)


def test_memory_bank_follows_the_ring_policy():
  rng = np.random.default_rng(0)
  batch, length = 3, 10
  valid = np.ones((batch, length), bool)
  valid[1, :3] = False  # Left padding.
  valid[2, :] = False  # All padding: the state must come back unchanged.
  width = HEADS * SIZE
  state = MMRecState(h=jnp.zeros((batch, width)), bank=jnp.asarray(rng.normal(size=(batch, SLOTS, width))),
                     written=jnp.asarray([0, 3, 5], jnp.int32), partial=jnp.asarray(rng.normal(size=(batch, width))),
                     filled=jnp.asarray([0, 2, 1], jnp.int32))
  state = state._replace(partial=state.partial * (state.filled[:, None] > 0))  # An empty segment has no sum.
  query, hs = rng.normal(size=(batch, length, HEADS, SIZE)), rng.normal(size=(batch, length, HEADS * SIZE))
  expected_read, expected_state = _walk(query, hs, valid, state)
  with jax.enable_x64(True):
    state64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64) if a.dtype.kind == "f" else a, state)
    read, new_state = jax.jit(read_memory, static_argnums=4)(jnp.asarray(query), jnp.asarray(hs), jnp.asarray(valid),
                                                             state64, SEGMENT)
  np.testing.assert_allclose(np.where(valid[..., None, None], read, 0), expected_read, atol=1e-6)
  for got, want in zip(new_state, expected_state):
    np.testing.assert_allclose(got, want, atol=1e-6)  # The state is float32 whatever the compute dtype.
  assert np.all(np.asarray(new_state[1]) == [3, 6, 5]) and np.any(expected_read[0] != 0)


def _layer(precompute=True):
  return MMRec(n_heads=HEADS, slots=SLOTS, segment=SEGMENT, precompute=precompute)


@pytest.fixture(scope="module")
def layer_setup():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 14, HEADS * SIZE * 2)), jnp.float32)
  valid = np.ones((2, 14), bool)
  valid[1, :4] = False
  shapes = jax.eval_shape(lambda: nn.meta.unbox(_layer().init(jax.random.key(0), x[:, :4])))
  return _random_like(shapes, 0.3), x, jnp.asarray(valid)


def _random_like(shapes, std, seed=0):
  """Normal(0, std) arrays of the parameters' shapes, vectors (per layer) around 1 like norm scales: every path
  carries signal (the decay MLPs initialise at zero), and no initialiser has to be compiled."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: jnp.asarray((s.ndim - model_lib.is_stacked(path) < 2) + std * rng.normal(size=s.shape),
                                  jnp.float32), shapes)


def test_segments_and_per_step_projections_equal_the_whole_sequence_and_the_layer_is_causal(layer_setup):
  """One call with projections precomputed for the whole sequence is the reference; the same call with projections
  made token by token inside the recurrence, and calls of 5, 1 and 8 tokens carrying the state (cuts inside
  segments and at a boundary, bank writes in every call), must equal it, outputs and final state."""
  params, x, valid = layer_setup

  @jax.jit
  def runs(x):
    whole = _layer().apply(params, x, None, valid)
    per_step = _layer(precompute=False).apply(params, x, None, valid)
    state, ys = None, []
    for a, b in ((0, 5), (5, 6), (6, 14)):
      y, state = _layer().apply(params, x[:, a:b], state, valid[:, a:b])
      ys.append(y)
    return whole, per_step, (jnp.concatenate(ys, axis=1), state)

  (y, state), *others = runs(x)
  assert np.all(np.asarray(state.written) == [4, 3])  # 14 and 10 real tokens: the ring of 2 slots has wrapped.
  mask = valid[..., None]
  for y_other, state_other in others:
    np.testing.assert_allclose(np.where(mask, y_other, 0), np.where(mask, y, 0), atol=2e-5)
    for a, b in zip(state_other, state):
      np.testing.assert_allclose(a, b, atol=2e-5)
  # Causality: changing the tokens from position 7 on leaves every earlier output as it was.
  changed = x.at[:, 7:].set(jax.random.normal(jax.random.key(3), x[:, 7:].shape) * 10)
  (y_changed, _), *_ = runs(changed)
  np.testing.assert_array_equal(y_changed[:, :7], y[:, :7])
  assert not np.allclose(y_changed[:, 7:], y[:, 7:])


@pytest.mark.parametrize("override, message", [
    ("model.mmrec_slots=0", "model.mmrec_slots=0: the memory bank needs at least 1 slot; set model.mmrec_slots >= 1"),
    ("model.mmrec_segment=0", "model.mmrec_segment=0 does not fit train.seq_len=32"),
    ("model.mmrec_segment=33", r"model.mmrec_segment=33 does not fit train.seq_len=32: no segment would reach the "
                               r"memory bank in training; set 1 <= model.mmrec_segment <= 32"),
])
def test_bad_bank_settings_are_one_line_config_errors(override, message):
  with pytest.raises(ConfigError, match=message) as error:
    validate(apply_overrides(micro_config(layer_pattern="DA"), [override]))
  assert "\n" not in str(error.value)
  validate(apply_overrides(micro_config(layer_pattern="RA"), [override]))  # Only D layers read the bank keys.


def test_ragged_prefill_and_decode_equal_the_forward_pass_with_scanned_layers_and_int8():
  prompts, new = ([72, 101, 108, 108, 111], [65, 66]), 4  # Segments of 3: both rows write the bank while decoding.
  cfg = micro_config(layer_pattern="D", scan_layers=True, mmrec_slots=SLOTS, mmrec_segment=SEGMENT).model
  params = _random_like(jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(1))), 0.2, seed=1)
  params["head"] = jax.tree.map(lambda w: w * 10.0, params["head"])  # Decisive greedy choices.
  forward = jax.jit(lambda p, t: model_lib.LM(cfg).apply({"params": p}, t)[0])
  tokens, lengths = left_pad(prompts, pad_id=7)
  model = model_lib.LM(cfg, cache_capacity=tokens.shape[1] + new)
  d = prefill(model, params, tokens, lengths)
  first = np.asarray(d.logits)
  generated, d = decode(model, params, d, jax.random.key(0), steps=new, temperature=0.0)
  references = []
  for row, prompt in enumerate(prompts):
    sequence = np.concatenate([prompt, np.asarray(generated[row])])[None]
    reference = np.asarray(forward(params, sequence))[0]
    np.testing.assert_allclose(first[row], reference[len(prompt) - 1], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(generated[row]), reference[len(prompt) - 1:-1].argmax(-1))
    references.append((sequence, reference))
  # Every D weight matrix has an int8 rule (an unclassifiable leaf would raise) and int8 logits stay close.
  int8 = dequantize_params(quantize_params(params, model_lib.param_axes(cfg)))
  sequence, reference = references[0]
  drift = np.max(np.abs(np.asarray(forward(int8, sequence))[0] - reference))
  assert 0 < drift < 0.05 * np.max(np.abs(reference))


def test_flops_match_a_hand_count():
  cfg = micro_config(layer_pattern="D", mmrec_segment=5, mmrec_slots=3)
  m, d, length = cfg.model, cfg.model.d_model, cfg.train.seq_len
  matmul = m.padded_vocab_size * d  # The LM head.
  # Per layer: q, k, v, z (4 d^2), the gate's W_gz and W_gh, the decay MLPs (2 x (d x d/4 + d/4 x d)), the memory
  # query and output; the SwiGLU.
  matmul += m.n_layers * (9 * d * d + 3 * d * m.ffn_dim("swiglu"))
  visible = sum(min(p // 5, 3) for p in range(length)) / length  # Bank entries a token attends to, on average.
  expected = 2 * matmul + m.n_layers * 4 * d * visible
  assert model_info(cfg)["flops_per_token_forward"] == pytest.approx(expected)


def test_both_projection_forms_run_and_agree_in_float64():
  """The per-token form carries h in the step's compute dtype: float64 here, as the precomputed form does."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (2, 5, 16), jnp.float64)
    params = MMRec(n_heads=4, segment=2, slots=2, dtype="float64").init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), params)
    forms = [MMRec(n_heads=4, segment=2, slots=2, dtype="float64", precompute=pre).apply(params, x)[0]
             for pre in (True, False)]
    assert forms[0].dtype == forms[1].dtype == jnp.float64
    np.testing.assert_allclose(forms[1], forms[0], rtol=0, atol=1e-12)
