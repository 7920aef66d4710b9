"""What a language model trains and is evaluated on, whatever the data source: a training stream and fixed
validation batches of [B, seq_len] inputs/targets.

A text corpus (`load_splits`: embedded, file, folder, .bin) is cut into windows of its token arrays; the synthetic
Markov source (`data.source=markov`) generates one document per row, training documents never repeated and a fixed
set of MARKOV_VALIDATION_DOCUMENTS validation documents drawn from a stream of their own (the same for every
training seed, so runs compare on the same documents)."""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from ltm_jax.config import DataConfig
from ltm_jax.data import markov
from ltm_jax.data.corpus import Splits, load_splits
from ltm_jax.data.loader import DocumentLoader, ResumableLoader, TrainLoader, eval_batches
from ltm_jax.data.tokenizer import get_tokenizer

MARKOV = "markov"
MARKOV_VALIDATION_DOCUMENTS = 512


class TokenSource(abc.ABC):
  """description: one line for logs; bytes_per_token: converts nats/token to bits/byte (None: unknown, a .bin)."""
  description: str
  bytes_per_token: float | None

  @abc.abstractmethod
  def train_loader(self, batch_size: int, seed: int, worker_threads: int = 2, prefetch: int = 4,
                   shard: tuple[int, int] = (0, 1)) -> ResumableLoader:
    """The resumable, endless training stream of this source for a run of `seed`."""

  @abc.abstractmethod
  def validation_batches(self, batch_size: int, n_batches: int) -> list[dict[str, np.ndarray]]:
    """Up to `n_batches` fixed validation batches (as `loader.eval_batches`)."""


@dataclasses.dataclass
class CorpusSource(TokenSource):
  splits: Splits
  seq_len: int
  bytes_per_token: float | None

  @property
  def description(self) -> str:
    return self.splits.description

  def train_loader(self, batch_size, seed, worker_threads=2, prefetch=4, shard=(0, 1)):
    return TrainLoader(self.splits.train, batch_size, self.seq_len, seed=seed, worker_threads=worker_threads,
                       prefetch=prefetch, shard=shard)

  def validation_batches(self, batch_size, n_batches):
    return eval_batches(self.splits.val, batch_size, self.seq_len, n_batches)


@dataclasses.dataclass
class MarkovSource(TokenSource):
  symbols: int
  concentration: float
  seq_len: int
  bytes_per_token: float | None = 1.0

  @property
  def description(self) -> str:
    return (f"synthetic Markov documents of {self.seq_len + 1} symbols over {self.symbols} states, Dirichlet("
            f"{self.concentration:g}) transition rows; validation {MARKOV_VALIDATION_DOCUMENTS} documents")

  def documents(self, seed: int, stream: int) -> markov.MarkovDocuments:
    return markov.MarkovDocuments(self.symbols, self.concentration, self.seq_len + 1, seed=seed, stream=stream)

  def validation_documents(self) -> markov.MarkovDocuments:
    return self.documents(0, markov.VALIDATION_STREAM)

  def train_loader(self, batch_size, seed, worker_threads=2, prefetch=4, shard=(0, 1)):
    keys = {"source": MARKOV, "symbols": self.symbols, "concentration": self.concentration, "seed": seed,
            "seq_len": self.seq_len}
    return DocumentLoader(self.documents(seed, markov.TRAIN_STREAM).tokens, batch_size, keys,
                          worker_threads=worker_threads, prefetch=prefetch, shard=shard)

  def validation_batches(self, batch_size, n_batches):
    count = min(n_batches * batch_size, MARKOV_VALIDATION_DOCUMENTS)
    tokens = self.validation_documents().tokens(np.arange(count))
    return [{"inputs": tokens[i:i + batch_size, :-1], "targets": tokens[i:i + batch_size, 1:]}
            for i in range(0, count, batch_size)]


def open_source(data_cfg: DataConfig, vocab_size: int, seq_len: int) -> TokenSource:
  """The source of `data_cfg` for models of `vocab_size` ids on windows of `seq_len`; refusals as `load_splits`."""
  if data_cfg.source == MARKOV:
    return MarkovSource(data_cfg.markov_symbols, data_cfg.markov_concentration, seq_len)
  splits = load_splits(data_cfg, vocab_size, seq_len)
  bytes_per_token = None if splits.is_token_file else get_tokenizer(data_cfg.tokenizer).bytes_per_token
  return CorpusSource(splits, seq_len, bytes_per_token)
