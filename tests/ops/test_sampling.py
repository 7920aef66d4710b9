"""ltm_jax.ops.sampling: filters against a numpy reference, greedy decoding and the empirical sampling distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.sampling import filter_logits, sample_logits

FILTER_RTOL = 1e-6
# 20k draws on a 6-token vocabulary: a frequency's standard error is at most sqrt(0.25 / 20000) = 0.0035, so 0.02
# is a 5.7-sigma bound per token.
NUM_DRAWS = 20_000
FREQ_ATOL = 0.02


def reference_filter(logits, *, temperature=1.0, top_k=None, top_p=None, vocab_size=None):
  """Row by row in float64, following the documented order."""
  x = np.array(logits, np.float64)
  for row in x:
    if vocab_size is not None:
      row[vocab_size:] = -np.inf
    if temperature == 0:
      best = int(np.argmax(row))
      row[np.arange(row.size) != best] = -np.inf
      continue
    row /= temperature
    if top_k is not None and top_k < row.size:
      kth = np.sort(row)[::-1][top_k - 1]
      row[row < kth] = -np.inf
    if top_p is not None:
      order = np.argsort(-row, kind="stable")
      probs = np.exp(row[order] - row[order[0]])
      probs /= probs.sum()
      total, kept = 0.0, []
      for idx, p in zip(order, probs):
        kept.append(row[idx])
        total += p
        if total >= top_p:
          break
      row[row < min(kept)] = -np.inf
  return x


def _logits(seed, b=4, v=50, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((b, v)) * 2.0, dtype)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("options", [
    dict(),
    dict(temperature=0.7),
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=50),
    dict(top_k=80),
    dict(top_p=0.1),
    dict(top_p=0.6),
    dict(top_p=0.95),
    dict(top_p=1.0),
    dict(temperature=1.5, top_k=10, top_p=0.7),
    dict(temperature=0.5, top_k=20, top_p=0.9, vocab_size=37),
    dict(vocab_size=37),
    dict(vocab_size=37, top_k=45),
    dict(temperature=0.0, vocab_size=10),
])
def test_filter_matches_reference(options):
  logits = _logits(sum(map(ord, str(options))))
  got = np.asarray(jax.jit(lambda x: filter_logits(x, **options))(logits))
  want = reference_filter(np.asarray(logits), **options)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=FILTER_RTOL)


def test_filter_takes_bfloat16_and_traced_scalars():
  logits = _logits(1, dtype=jnp.bfloat16)
  fn = jax.jit(lambda x, t, p: filter_logits(x, temperature=t, top_k=12, top_p=p))
  got = np.asarray(fn(logits, 0.8, 0.75))
  want = reference_filter(np.asarray(logits, np.float32), temperature=0.8, top_k=12, top_p=0.75)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=FILTER_RTOL)


def test_ties_with_the_threshold_are_kept():
  logits = jnp.asarray([[1.0, 2.0, 2.0, 3.0, 0.0]])
  assert np.isfinite(filter_logits(logits, top_k=2)).sum() == 3
  # p(3) ~ 0.53 < 0.6, so a 2.0 is needed, and its twin stays with it.
  assert np.isfinite(filter_logits(logits, top_p=0.6)).sum() == 3


@pytest.mark.parametrize("traced", [False, True])
def test_greedy_is_argmax(traced):
  logits = _logits(2, b=16, v=300)
  logits = logits.at[:, 290:].set(100.0)  # Padding ids with huge logits must never win.
  expected = np.argmax(np.asarray(logits)[:, :290], axis=-1)
  if traced:
    fn = jax.jit(lambda k, x, t: sample_logits(k, x, temperature=t, top_k=5, top_p=0.5, vocab_size=290))
    ids = fn(jax.random.key(0), logits, 0.0)
  else:
    ids = sample_logits(jax.random.key(0), logits, temperature=0.0, vocab_size=290)
  assert ids.dtype == jnp.int32 and ids.shape == (16,)
  np.testing.assert_array_equal(ids, expected)


def _draws(options, logits, seed=0):
  row = jnp.broadcast_to(logits, (NUM_DRAWS, logits.shape[-1]))
  fn = jax.jit(lambda k, x: sample_logits(k, x, **options))
  return np.asarray(fn(jax.random.key(seed), row))


@pytest.mark.parametrize("options", [
    dict(vocab_size=5),
    dict(temperature=0.8, top_k=4, vocab_size=6),
    dict(temperature=1.3, top_p=0.8, vocab_size=7),
])
def test_never_samples_removed_ids(options):
  logits = jnp.asarray(np.random.default_rng(3).standard_normal((1, 8)) * 0.5, jnp.float32)
  allowed = np.isfinite(np.asarray(filter_logits(logits, **options)))[0]
  ids = _draws(options, logits)
  assert allowed[ids].all()


@pytest.mark.parametrize("options", [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=4),
    dict(top_p=0.8),
    dict(temperature=0.9, top_k=5, top_p=0.9, vocab_size=6),
])
def test_frequencies_match_filtered_softmax(options):
  logits = jnp.asarray([[1.0, 0.5, 0.0, -0.3, 0.8, -1.0, 2.0, 0.2]], jnp.float32)
  expected = _softmax(reference_filter(np.asarray(logits), **options))[0]
  ids = _draws(options, logits, seed=len(options))
  freqs = np.bincount(ids, minlength=logits.shape[-1]) / NUM_DRAWS
  np.testing.assert_allclose(freqs, expected, atol=FREQ_ATOL)


def test_same_key_same_ids():
  logits = _logits(4, b=64, v=100)
  fn = jax.jit(lambda k: sample_logits(k, logits, temperature=1.2, top_p=0.95))
  np.testing.assert_array_equal(fn(jax.random.key(7)), fn(jax.random.key(7)))
  assert (fn(jax.random.key(7)) != fn(jax.random.key(8))).any()


@pytest.mark.parametrize("options,match", [
    (dict(top_k=0), "top_k must be >= 1"),
    (dict(top_k=2.5), "static int"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(temperature=-0.1), "temperature must be in"),
    (dict(vocab_size=51), "exceeds"),
    (dict(vocab_size=0), ">= 1"),
])
def test_rejects_bad_options(options, match):
  with pytest.raises(ValueError, match=match):
    filter_logits(_logits(5), **options)


def test_rejects_integer_logits():
  with pytest.raises(ValueError, match="float"):
    filter_logits(jnp.zeros((2, 4), jnp.int32))
