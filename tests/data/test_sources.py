"""Token sources: the synthetic Markov stream (a document per row, resumable, sharded) and text corpora behind one
interface."""

from __future__ import annotations

import numpy as np
import pytest

from ltm_jax.config import DataConfig
from ltm_jax.data import load_splits, markov, open_source
from ltm_jax.data.loader import DocumentLoader, eval_batches
from ltm_jax.errors import DataError

MARKOV = DataConfig(source="markov", markov_symbols=5, markov_concentration=0.3, worker_threads=1, prefetch=2)
T = 12


def _take(loader, n):
  with loader:
    return [next(loader) for _ in range(n)]


def test_markov_rows_are_whole_documents_of_the_training_stream():
  source = open_source(MARKOV, 259, T)
  batches = _take(source.train_loader(4, seed=3, worker_threads=1), 2)
  documents = markov.MarkovDocuments(5, 0.3, T + 1, seed=3).tokens(np.arange(8))
  for b, batch in enumerate(batches):
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (4, T)
    np.testing.assert_array_equal(batch["inputs"], documents[4 * b:4 * b + 4, :-1])
    np.testing.assert_array_equal(batch["targets"], documents[4 * b:4 * b + 4, 1:])
  assert np.all((documents >= markov.SYMBOL_BASE) & (documents < markov.SYMBOL_BASE + 5))
  other = _take(source.train_loader(4, seed=4, worker_threads=1), 1)[0]
  assert not np.array_equal(other["inputs"], batches[0]["inputs"])


def test_markov_validation_documents_are_fixed_and_apart_from_training():
  source = open_source(MARKOV, 259, T)
  val = source.validation_batches(4, 3)
  assert [len(b["inputs"]) for b in val] == [4, 4, 4]
  np.testing.assert_array_equal(np.concatenate([b["inputs"] for b in val]),
                                source.validation_documents().tokens(np.arange(12))[:, :-1])
  np.testing.assert_array_equal(val[0]["inputs"], open_source(MARKOV, 259, T).validation_batches(4, 1)[0]["inputs"])
  train = _take(source.train_loader(4, seed=0, worker_threads=1), 1)[0]
  assert not np.array_equal(train["inputs"], val[0]["inputs"])
  capped = source.validation_batches(64, 10**9)  # "All" validation documents: the fixed set.
  assert sum(len(b["inputs"]) for b in capped) == 512


def test_document_stream_resumes_and_shards_exactly():
  source = open_source(MARKOV, 259, T)
  whole = _take(source.train_loader(4, seed=1, worker_threads=2, prefetch=3), 5)
  loader = source.train_loader(4, seed=1, worker_threads=1)
  with loader:
    next(loader), next(loader)
    state = loader.get_state()
  resumed = source.train_loader(4, seed=1, worker_threads=1)
  resumed.set_state(state)
  for got, want in zip(_take(resumed, 3), whole[2:]):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
  halves = [_take(source.train_loader(4, seed=1, worker_threads=1, shard=(i, 2)), 5) for i in range(2)]
  for b in range(5):
    np.testing.assert_array_equal(np.concatenate([halves[0][b]["inputs"], halves[1][b]["inputs"]]),
                                  whole[b]["inputs"])
  other = source.train_loader(4, seed=2, worker_threads=1)
  with pytest.raises(DataError, match="saved with seed=1"):
    other.set_state(state)
  other.close()
  with pytest.raises(ValueError, match="shard"):
    DocumentLoader(lambda i: np.zeros((len(i), T + 1)), 3, {}, shard=(0, 2))


def test_text_sources_are_the_corpus_windows(tmp_path):
  (tmp_path / "notes.txt").write_text("hello world, " * 200)
  cfg = DataConfig(source=str(tmp_path / "notes.txt"), worker_threads=1)
  source = open_source(cfg, 259, T)
  splits = load_splits(cfg, 259, T)
  assert source.bytes_per_token == 1.0 and source.description == splits.description
  for got, want in zip(source.validation_batches(2, 3), eval_batches(splits.val, 2, T, 3)):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])


def test_a_markov_source_has_no_token_splits():
  with pytest.raises(DataError, match="data.source=markov generates its documents"):
    load_splits(MARKOV, 259, T)


def test_a_model_trains_and_evaluates_on_the_markov_stream(tmp_path, capsys):
  from conftest import micro_config  # noqa: PLC0415  (the suite's shared config, only for this end-to-end case)

  from ltm_jax import cli
  from ltm_jax.config import apply_overrides
  from ltm_jax.train import train
  cfg = apply_overrides(micro_config(layer_pattern="A", window=4), [
      "data.source=markov", "data.markov_symbols=4", "train.steps=2", "train.eval_every=2", "train.seq_len=16"])
  result = train(cfg, tmp_path, progress=False)
  assert result.step == 2 and 0 < result.metrics["val_loss"] < 10
  assert cli.main(["eval", "--workdir", str(tmp_path), "--batches", "2"]) == 0
  assert "continuation_ppl" in capsys.readouterr().out
