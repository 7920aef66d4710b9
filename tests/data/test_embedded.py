"""The embedded corpus built from Python's own documentation: determinism, split, cache, and loading as a source."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ltm_jax.config import DataConfig
from ltm_jax.data import corpus
from ltm_jax.data import embedded
from ltm_jax.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("ltm_cache")


@pytest.fixture(scope="module")
def documents():
  return embedded.embedded_documents()


@pytest.fixture(scope="module")
def fresh(cache_dir):
  """(train, val) built afresh through an empty cache, which writes it."""
  assert not os.listdir(cache_dir)
  return embedded.embedded_corpus(cache_dir=cache_dir)


def join(docs):
  return TOK.encode(embedded.DOC_SEPARATOR.join(text for _, text in docs))


def test_embedded_builds_are_identical(documents, fresh):
  # Two independent builds: the split arrays are exactly the documents of each side, joined in order.
  val_docs = [(n, t) for n, t in documents if embedded.is_validation_document(n)]
  train_docs = [(n, t) for n, t in documents if not embedded.is_validation_document(n)]
  np.testing.assert_array_equal(fresh[0], join(train_docs))
  np.testing.assert_array_equal(fresh[1], join(val_docs))


def test_cache_hit_equals_fresh_build(fresh, cache_dir, monkeypatch):
  def no_build(*_):
    raise AssertionError("cache miss: the corpus was rebuilt")

  monkeypatch.setattr(embedded, "_build_embedded", no_build)
  train, val = embedded.embedded_corpus(cache_dir=cache_dir)
  np.testing.assert_array_equal(train, fresh[0])
  np.testing.assert_array_equal(val, fresh[1])
  assert not [f for f in os.listdir(cache_dir) if f.endswith(".tmp")]


def test_embedded_is_large_enough(fresh):
  train, val = fresh
  assert train.dtype == np.uint16 and train.ndim == 1
  assert len(train) >= 1_000_000 and len(val) >= 20_000
  assert int(train.max()) < 256  # Plain UTF-8 bytes: documents are joined by blank lines, not special ids.


def test_embedded_split_is_disjoint_and_about_five_percent(documents, fresh):
  names = [name for name, _ in documents]
  assert len(names) == len(set(names))
  texts = [text for _, text in documents]
  assert len(texts) == len(set(texts))  # Duplicates are dropped, so no text is on both sides.
  val_docs = [(n, t) for n, t in documents if embedded.is_validation_document(n)]
  assert 0.03 < len(val_docs) / len(documents) < 0.08
  train, val = fresh
  assert 0.02 < len(val) / (len(train) + len(val)) < 0.10


def test_embedded_documents_skip_tests_and_short_docstrings(documents):
  names = [name for name, _ in documents]
  assert any(n.startswith("topic/") for n in names)
  assert any(n.startswith("json/") for n in names)
  for name, text in documents:
    parts = name.split(":")[0].split("/")
    assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), name
    assert text == text.strip() and "\t" not in text and "\n\n\n" not in text
    if not name.startswith("topic/"):
      assert len(text) >= embedded.MIN_DOCSTRING_CHARS


def test_embedded_stats(cache_dir, fresh):
  stats = embedded.embedded_corpus_stats(cache_dir=cache_dir)
  assert stats["train_tokens"] == stats["train_bytes"] == len(fresh[0])
  assert stats["documents"] == stats["train_documents"] + stats["val_documents"]


def test_load_splits_embedded(cache_dir, fresh, monkeypatch):
  monkeypatch.setattr(embedded, "default_cache_dir", lambda: cache_dir)
  splits = corpus.load_splits(DataConfig(), vocab_size=259, seq_len=256)
  np.testing.assert_array_equal(splits.train, fresh[0])
  assert splits.name == "embedded" and "documents" in splits.description


def test_default_cache_dir_follows_xdg(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert embedded.default_cache_dir() == tmp_path / "ltm_jax"


def test_unwritable_cache_falls_back_to_memory(tmp_path, monkeypatch):
  fake = (np.arange(100, dtype=np.uint16), np.arange(40, dtype=np.uint16), {"python": "x", "documents": 2})
  monkeypatch.setattr(embedded, "_build_embedded", lambda tok: fake)
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("")
  train, val = embedded.embedded_corpus(cache_dir=blocker / "sub")
  np.testing.assert_array_equal(train, fake[0])
  np.testing.assert_array_equal(val, fake[1])


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
  fake = (np.arange(100, dtype=np.uint16), np.arange(40, dtype=np.uint16), {"python": "x", "documents": 2})
  monkeypatch.setattr(embedded, "_build_embedded", lambda tok: fake)
  path = embedded._cache_path(TOK, tmp_path)
  path.write_bytes(b"not a zip file")
  train, _ = embedded.embedded_corpus(cache_dir=tmp_path)
  np.testing.assert_array_equal(train, fake[0])
  train, _ = embedded.embedded_corpus(cache_dir=tmp_path)  # Now a valid cache file.
  np.testing.assert_array_equal(train, fake[0])
