"""Synthetic documents whose optimal predictors are known: each one a sequence of symbols from its own Markov chain.

Document i of a stream draws a K x K transition matrix P, every row from a symmetric Dirichlet(alpha), and a first
symbol uniformly from K, then samples its symbols from the chain. Nothing is shared between documents but the prior,
so what a predictor can know about a document's chain is what the document itself has shown so far. Three per-token
log-losses of predicting x_{t+1} from x_0..x_t have closed forms:

  oracle   -log P[x_t, x_{t+1}]: knows the chain (the entropy rate's floor).
  bayes    -log (n[i, j] + alpha) / (n[i, :] + K alpha), i = x_t, j = x_{t+1}, n the transition counts among
           x_0..x_t: the Bayes-optimal predictor from everything earlier in the document (Dirichlet-multinomial).
  window   the same with n counting only the transitions among the last R symbols x_{t-R+1}..x_t: the Bayes
           predictor of a model that sees R symbols (a decoder whose receptive field is R tokens), given the
           window's first symbol. It leaves out what the first symbol's own probability says about P (one draw from
           the chain's marginal, a small fraction of a nat of information about a K x K matrix), so a windowed
           predictor could beat it by at most that much.
  memory   the window's counts plus those of every transition among x_0..x_m: a windowed predictor that also
           remembers the document's first m + 1 symbols exactly, as a latent z fitted on them could.

Symbols are written as the bytes 'A', 'B', ... (token id SYMBOL_BASE + k), so a document decodes as text and the
byte-level models read it unchanged. Every draw comes from numpy's generator seeded by (stream, seed, index): a
document is the same whichever batch or process draws it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ltm_jax.config import MARKOV_MAX_SYMBOLS as MAX_SYMBOLS

SYMBOL_BASE = ord("A")
TRAIN_STREAM, VALIDATION_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class MarkovDocuments:
  """Documents of `length` symbols over `symbols` (K) states, chains from Dirichlet(`concentration`), drawn from the
  stream (`stream`, `seed`): `documents(indices)` gives the same document for an index every time."""
  symbols: int
  concentration: float
  length: int
  seed: int = 0
  stream: int = TRAIN_STREAM

  def __post_init__(self):
    if not 2 <= self.symbols <= MAX_SYMBOLS:
      raise ValueError(f"a Markov source needs 2..{MAX_SYMBOLS} symbols, got {self.symbols}")
    if not self.concentration > 0:
      raise ValueError(f"the Dirichlet concentration must be positive, got {self.concentration}")
    if self.length < 2:
      raise ValueError(f"a document needs at least 2 symbols, got {self.length}")

  def _rng(self, index: int) -> np.random.Generator:
    return np.random.default_rng([self.stream, self.seed, int(index)])

  def chain(self, index: int) -> np.ndarray:
    """Document `index`'s transition matrix [K, K] float64 (rows sum to 1)."""
    return self._rng(index).dirichlet(np.full(self.symbols, self.concentration), size=self.symbols)

  def documents(self, indices) -> tuple[np.ndarray, np.ndarray]:
    """(symbols [n, length] int32 in [0, K), chains [n, K, K] float64) of the documents at `indices`."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    k = self.symbols
    chains = np.empty((len(indices), k, k))
    uniforms = np.empty((len(indices), self.length))
    for row, index in enumerate(indices):
      rng = self._rng(index)
      chains[row] = rng.dirichlet(np.full(k, self.concentration), size=k)
      uniforms[row] = rng.random(self.length)
    # Inverse-CDF sampling of every document at once: symbol = the first j with u < cdf[prev, j]. Dividing by the
    # last entry makes each row's cdf end at exactly 1, so rounding never selects a state past the last one.
    cdf = np.cumsum(chains, axis=-1)
    cdf /= cdf[..., -1:]
    out = np.empty((len(indices), self.length), np.int32)
    out[:, 0] = np.minimum((uniforms[:, 0] * k).astype(np.int32), k - 1)
    rows = np.arange(len(indices))
    for t in range(1, self.length):
      out[:, t] = (uniforms[:, t, None] >= cdf[rows, out[:, t - 1]]).sum(-1)
    return out, chains

  def tokens(self, indices) -> np.ndarray:
    """The documents at `indices` as byte-tokenizer ids [n, length] int32."""
    return self.documents(indices)[0] + SYMBOL_BASE


def oracle_nll(symbols: np.ndarray, chains: np.ndarray) -> np.ndarray:
  """[n, L - 1]: -log P[x_t, x_{t+1}] under each document's own chain (symbols [n, L], chains [n, K, K])."""
  rows = np.arange(symbols.shape[0])[:, None]
  return -np.log(chains[rows, symbols[:, :-1], symbols[:, 1:]])


def bayes_nll(symbols: np.ndarray, symbols_k: int, concentration: float, window: int | None = None,
              memory: int = 0) -> np.ndarray:
  """[n, L - 1]: the Dirichlet-multinomial predictor's -log p(x_{t+1} | x_<=t) for every t, from the transition
  counts of the whole prefix (`window` None) or of the last `window` symbols x_{t-window+1}..x_t (window >= 1),
  together with every transition among x_0..x_memory (a memory of the document's start, as z fitted there)."""
  if window is not None and window < 1:
    raise ValueError(f"window must be at least 1 symbol, got {window}")
  n, length = symbols.shape
  k, alpha = symbols_k, float(concentration)
  counts = np.zeros((n, k, k))
  rows = np.arange(n)
  out = np.empty((n, length - 1))
  for t in range(length - 1):
    if t >= 1:  # The transition ending at x_t enters the counts ...
      counts[rows, symbols[:, t - 1], symbols[:, t]] += 1
    start = t - window + 1 if window is not None else 0
    if start > max(memory, 0):  # ... and, with a window, the one ending at its first symbol leaves them.
      counts[rows, symbols[:, start - 1], symbols[:, start]] -= 1
    i, j = symbols[:, t], symbols[:, t + 1]
    out[:, t] = -np.log((counts[rows, i, j] + alpha) / (counts[rows, i].sum(-1) + k * alpha))
  return out


@dataclasses.dataclass(frozen=True)
class References:
  """Mean nats per predicted symbol over scored positions: oracle, bayes (whole prefix), window (last R symbols),
  memory (last R symbols and the transitions before the scored part: a windowed decoder with a perfect memory of
  the unscored start), uniform (log K)."""
  oracle: float
  bayes: float
  window: float
  memory: float
  uniform: float

  def as_dict(self) -> dict[str, float]:
    return dataclasses.asdict(self)


def references(source: MarkovDocuments, indices, window: int, score_from: int) -> References:
  """The closed-form losses of the documents at `indices`, averaged over the targets t >= score_from (target t is
  the prediction of symbol t + 1, as a model's targets[:, t] with inputs = document[:-1]); the memory reference
  remembers the symbols up to x_{score_from}, those of the targets before the scored ones."""
  symbols, chains = source.documents(indices)
  mean = lambda losses: float(losses[:, score_from:].mean())
  return References(oracle=mean(oracle_nll(symbols, chains)),
                    bayes=mean(bayes_nll(symbols, source.symbols, source.concentration)),
                    window=mean(bayes_nll(symbols, source.symbols, source.concentration, window)),
                    memory=mean(bayes_nll(symbols, source.symbols, source.concentration, window, memory=score_from)),
                    uniform=math.log(source.symbols))
