"""The synthetic Markov documents and their three closed-form losses, against brute-force computations."""

import itertools
import math

import numpy as np
import pytest

from ltm_jax.data import markov


def _brute_predictive_quadrature(sequence, alpha, nodes=40):
  """K = 2: p(x_{t+1} | x_<=t) as a ratio of integrals over both rows' Beta(alpha, alpha) transition probabilities,
  by Gauss-Legendre quadrature on [0, 1] (exact: with integer alpha every integrand is a polynomial of low degree)."""
  x, w = np.polynomial.legendre.leggauss(nodes)
  p, w = (x + 1) / 2, w / 2  # Nodes and weights on [0, 1].
  prior = p ** (alpha - 1) * (1 - p) ** (alpha - 1)

  def marginal(seq):
    total = 1.0
    for row in range(2):
      moves = [b for a, b in zip(seq[:-1], seq[1:]) if a == row]
      lik = np.prod([p if b == 0 else 1 - p for b in moves], axis=0) if moves else np.ones_like(p)
      total *= (w * prior * lik).sum() / (w * prior).sum()
    return total

  return marginal(list(sequence)) / marginal(list(sequence[:-1]))


def _brute_predictive_gamma(sequence, k, alpha):
  """Any K: p(x_{t+1} | x_<=t) = p(x_0..x_{t+1}) / p(x_0..x_t), each the product over rows of the Dirichlet
  normaliser ratio B(n_i + alpha) / B(alpha) of that sequence's transition counts (the first symbol given)."""
  def log_marginal(seq):
    counts = np.zeros((k, k))
    for a, b in zip(seq[:-1], seq[1:]):
      counts[a, b] += 1
    out = 0.0
    for row in counts:
      out += math.lgamma(k * alpha) - math.lgamma(row.sum() + k * alpha)
      out += sum(math.lgamma(c + alpha) - math.lgamma(alpha) for c in row)
    return out

  return math.exp(log_marginal(list(sequence)) - log_marginal(list(sequence[:-1])))


def test_bayes_losses_equal_quadrature_on_every_binary_sequence():
  """Every binary sequence of 7 symbols: whole-prefix and window-3 losses at every position against quadrature."""
  alpha, window = 2.0, 3
  seqs = np.array(list(itertools.product(range(2), repeat=7)))
  whole = markov.bayes_nll(seqs, 2, alpha)
  windowed = markov.bayes_nll(seqs, 2, alpha, window)
  for s, seq in enumerate(seqs):
    for t in range(len(seq) - 1):
      expected = -math.log(_brute_predictive_quadrature(seq[:t + 2], alpha))
      np.testing.assert_allclose(whole[s, t], expected, rtol=1e-10)
      start = max(0, t - window + 1)
      expected = -math.log(_brute_predictive_quadrature(seq[start:t + 2], alpha))
      np.testing.assert_allclose(windowed[s, t], expected, rtol=1e-10)


@pytest.mark.parametrize("k,alpha,window", [(3, 0.3, 4), (5, 0.1, 1), (4, 1.7, 9)])
def test_bayes_losses_equal_dirichlet_normalisers(k, alpha, window):
  """Random sequences of K states: the counting recursions against the ratio of whole-sequence marginals."""
  rng = np.random.default_rng(k)
  seqs = rng.integers(0, k, size=(3, 14))
  whole = markov.bayes_nll(seqs, k, alpha)
  windowed = markov.bayes_nll(seqs, k, alpha, window)
  for s, seq in enumerate(seqs):
    for t in range(seqs.shape[1] - 1):
      np.testing.assert_allclose(whole[s, t], -math.log(_brute_predictive_gamma(seq[:t + 2], k, alpha)), rtol=1e-10)
      start = max(0, t - window + 1)
      np.testing.assert_allclose(windowed[s, t], -math.log(_brute_predictive_gamma(seq[start:t + 2], k, alpha)),
                                 rtol=1e-10)


def test_memory_counts_are_the_union_of_the_start_and_the_window():
  """Against counts built from the explicit set of transitions each prediction may use."""
  k, alpha, window, memory = 3, 0.4, 4, 6
  seqs = np.random.default_rng(7).integers(0, k, size=(3, 18))
  got = markov.bayes_nll(seqs, k, alpha, window, memory=memory)
  for s, seq in enumerate(seqs):
    for t in range(seqs.shape[1] - 1):
      ends = set(range(1, min(memory, t) + 1)) | set(range(max(1, t - window + 2), t + 1))
      counts = np.zeros((k, k))
      for e in ends:
        counts[seq[e - 1], seq[e]] += 1
      i, j = seq[t], seq[t + 1]
      assert got[s, t] == pytest.approx(-math.log((counts[i, j] + alpha) / (counts[i].sum() + k * alpha)), rel=1e-12)


def test_a_window_as_long_as_the_document_is_the_whole_prefix():
  source = markov.MarkovDocuments(symbols=6, concentration=0.2, length=40, seed=3)
  symbols, _ = source.documents(range(4))
  np.testing.assert_array_equal(markov.bayes_nll(symbols, 6, 0.2, window=40), markov.bayes_nll(symbols, 6, 0.2))
  assert not np.allclose(markov.bayes_nll(symbols, 6, 0.2, window=5), markov.bayes_nll(symbols, 6, 0.2))


def test_oracle_loss_is_the_chains_own_transition_probability():
  source = markov.MarkovDocuments(symbols=5, concentration=0.5, length=30, seed=1)
  symbols, chains = source.documents([7, 2])
  losses = markov.oracle_nll(symbols, chains)
  for d in range(2):
    for t in range(29):
      assert losses[d, t] == pytest.approx(-math.log(chains[d][symbols[d, t], symbols[d, t + 1]]), rel=1e-12)


def test_documents_are_deterministic_per_seed_and_index_and_independent_of_the_batch():
  source = markov.MarkovDocuments(symbols=8, concentration=0.1, length=64, seed=5)
  together, chains = source.documents([3, 11, 4])
  alone, chain = source.documents([11])
  np.testing.assert_array_equal(together[1], alone[0])
  np.testing.assert_array_equal(chains[1], chain[0])
  np.testing.assert_array_equal(source.chain(11), chain[0])
  np.testing.assert_array_equal(source.tokens([11])[0], alone[0] + markov.SYMBOL_BASE)
  other_seed = markov.MarkovDocuments(symbols=8, concentration=0.1, length=64, seed=6)
  other_stream = markov.MarkovDocuments(symbols=8, concentration=0.1, length=64, seed=5,
                                        stream=markov.VALIDATION_STREAM)
  for other in (other_seed, other_stream):
    assert not np.array_equal(other.documents([11])[0], alone)


def test_chains_follow_the_dirichlet_prior_and_are_independent_across_documents():
  """Entry moments of Dirichlet(alpha) rows: mean 1/K, variance (1/K)(1 - 1/K)/(K alpha + 1); neighbouring
  documents' chains uncorrelated. 3000 chains of 4 x 4: tolerances are about 5 standard errors."""
  k, alpha, n = 4, 0.3, 3000
  source = markov.MarkovDocuments(symbols=k, concentration=alpha, length=2, seed=0)
  chains = np.stack([source.chain(i) for i in range(n)])
  np.testing.assert_allclose(chains.sum(-1), 1.0, atol=1e-12)
  entries = chains[:, 0, 0]
  variance = (1 / k) * (1 - 1 / k) / (k * alpha + 1)
  assert abs(entries.mean() - 1 / k) < 5 * math.sqrt(variance / n)
  assert abs(entries.var() / variance - 1) < 0.15
  flat = chains.reshape(n, -1)
  correlation = np.corrcoef(flat[:-1, 0], flat[1:, 0])[0, 1]
  assert abs(correlation) < 5 / math.sqrt(n)
  rows_corr = np.corrcoef(chains[:, 0, 0], chains[:, 1, 0])[0, 1]  # Rows of one chain are independent too.
  assert abs(rows_corr) < 5 / math.sqrt(n)


def test_sampled_transitions_follow_the_documents_chain():
  """One long document: empirical transition frequencies within 5 standard errors of its chain's rows."""
  source = markov.MarkovDocuments(symbols=4, concentration=2.0, length=40_000, seed=2)
  (symbols,), (chain,) = source.documents([0])
  counts = np.zeros((4, 4))
  np.add.at(counts, (symbols[:-1], symbols[1:]), 1)
  freq = counts / counts.sum(-1, keepdims=True)
  stderr = np.sqrt(chain * (1 - chain) / counts.sum(-1, keepdims=True))
  assert np.all(np.abs(freq - chain) < 5 * stderr + 1e-9)


def test_references_order_and_the_window_gap_of_the_benchmark_setting():
  """oracle < bayes < window < uniform on average; at K=16, alpha 0.1, 257 symbols and R=61 the whole-prefix Bayes
  predictor beats the windowed one by about 0.3 nats on the second half (the benchmark needs a gap that large)."""
  source = markov.MarkovDocuments(symbols=16, concentration=0.1, length=257, seed=0, stream=markov.VALIDATION_STREAM)
  refs = markov.references(source, range(64), window=61, score_from=128)
  assert refs.oracle < refs.bayes < refs.memory < refs.window < refs.uniform
  assert 0.25 < refs.window - refs.bayes < 0.4


@pytest.mark.parametrize("kwargs", [dict(symbols=1), dict(symbols=63), dict(concentration=0.0), dict(length=1)])
def test_bad_parameters_are_refused(kwargs):
  base = dict(symbols=4, concentration=0.1, length=8)
  with pytest.raises(ValueError):
    markov.MarkovDocuments(**{**base, **kwargs})
