"""Corpora: the embedded Python documentation (determinism, cache, split) and user text, folder and .bin sources."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest

from ltm_jax.config import DataConfig
from ltm_jax.data import corpus
from ltm_jax.data.tokenizer import ByteTokenizer
from ltm_jax.errors import DataError

TOK = ByteTokenizer()
SEQ = 16


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("ltm_cache")


@pytest.fixture(scope="module")
def documents():
  return corpus.embedded_documents()


@pytest.fixture(scope="module")
def fresh(cache_dir):
  """(train, val) built afresh through an empty cache, which writes it."""
  assert not os.listdir(cache_dir)
  return corpus.embedded_corpus(cache_dir=cache_dir)


def join(docs):
  return TOK.encode(corpus.DOC_SEPARATOR.join(text for _, text in docs))


def cfg(source, **kw):
  return DataConfig(source=str(source), **kw)


# --------------------------------------------------------------------------------------------------------- embedded


def test_embedded_builds_are_identical(documents, fresh):
  # Two independent builds: the split arrays are exactly the documents of each side, joined in order.
  val_docs = [(n, t) for n, t in documents if corpus.is_validation_document(n)]
  train_docs = [(n, t) for n, t in documents if not corpus.is_validation_document(n)]
  np.testing.assert_array_equal(fresh[0], join(train_docs))
  np.testing.assert_array_equal(fresh[1], join(val_docs))


def test_cache_hit_equals_fresh_build(fresh, cache_dir, monkeypatch):
  def no_build(*_):
    raise AssertionError("cache miss: the corpus was rebuilt")

  monkeypatch.setattr(corpus, "_build_embedded", no_build)
  train, val = corpus.embedded_corpus(cache_dir=cache_dir)
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
  val_docs = [(n, t) for n, t in documents if corpus.is_validation_document(n)]
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
      assert len(text) >= corpus.MIN_DOCSTRING_CHARS


def test_embedded_stats(cache_dir, fresh):
  stats = corpus.embedded_corpus_stats(cache_dir=cache_dir)
  assert stats["train_tokens"] == stats["train_bytes"] == len(fresh[0])
  assert stats["documents"] == stats["train_documents"] + stats["val_documents"]


def test_load_splits_embedded(cache_dir, fresh, monkeypatch):
  monkeypatch.setattr(corpus, "default_cache_dir", lambda: cache_dir)
  splits = corpus.load_splits(DataConfig(), vocab_size=259, seq_len=256)
  np.testing.assert_array_equal(splits.train, fresh[0])
  assert splits.name == "embedded" and "documents" in splits.description


def test_default_cache_dir_follows_xdg(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert corpus.default_cache_dir() == tmp_path / "ltm_jax"


def test_unwritable_cache_falls_back_to_memory(tmp_path, monkeypatch):
  fake = (np.arange(100, dtype=np.uint16), np.arange(40, dtype=np.uint16), {"python": "x", "documents": 2})
  monkeypatch.setattr(corpus, "_build_embedded", lambda tok: fake)
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("")
  train, val = corpus.embedded_corpus(cache_dir=blocker / "sub")
  np.testing.assert_array_equal(train, fake[0])
  np.testing.assert_array_equal(val, fake[1])


def test_damaged_cache_is_rebuilt(tmp_path, monkeypatch):
  fake = (np.arange(100, dtype=np.uint16), np.arange(40, dtype=np.uint16), {"python": "x", "documents": 2})
  monkeypatch.setattr(corpus, "_build_embedded", lambda tok: fake)
  path = corpus._cache_path(TOK, tmp_path)
  path.write_bytes(b"not a zip file")
  train, _ = corpus.embedded_corpus(cache_dir=tmp_path)
  np.testing.assert_array_equal(train, fake[0])
  train, _ = corpus.embedded_corpus(cache_dir=tmp_path)  # Now a valid cache file.
  np.testing.assert_array_equal(train, fake[0])


# ------------------------------------------------------------------------------------------------------- user data


def test_text_file_tail_split(tmp_path):
  text = "Der Bär läuft über die Brücke. " * 40
  path = tmp_path / "corpus.txt"
  path.write_text(text, encoding="utf-8")
  splits = corpus.load_splits(cfg(path, val_fraction=0.25), 259, SEQ)
  tokens = TOK.encode(text)
  n_val = math.ceil(len(tokens) * 0.25)
  assert len(splits.val) == n_val and len(splits.train) == len(tokens) - n_val
  np.testing.assert_array_equal(np.concatenate([splits.train, splits.val]), tokens)
  assert splits.name == str(path)


def test_folder_split_by_file(tmp_path):
  texts = {}
  for i in range(60):
    sub = tmp_path / f"part{i % 3}"
    sub.mkdir(exist_ok=True)
    name = f"doc{i:02d}.{'md' if i % 2 else 'txt'}"
    texts[f"part{i % 3}/{name}"] = f"document {i}: " + "words and more words. " * 5
    (sub / name).write_text(texts[f"part{i % 3}/{name}"])
  (tmp_path / "ignored.py").write_text("print('not text')" * 100)
  (tmp_path / ".hidden").mkdir()
  (tmp_path / ".hidden" / "notes.txt").write_text("hidden " * 100)
  splits = corpus.load_splits(cfg(tmp_path, val_fraction=0.2), 259, SEQ)
  train, val = TOK.decode(splits.train), TOK.decode(splits.val)
  assert "print(" not in train + val and "hidden" not in train + val
  for rel, text in texts.items():
    side = val if corpus._hash_fraction(rel) < 0.2 else train
    assert text in side, rel
    assert (text in train) != (text in val)
  assert 0 < len(splits.val) < len(splits.train)
  assert "60 text files" in splits.description


def test_folder_with_one_file_falls_back_to_tail_split(tmp_path):
  (tmp_path / "only.md").write_text("x" * 1000)
  splits = corpus.load_splits(cfg(tmp_path), 259, SEQ)
  assert len(splits.train) + len(splits.val) == 1000 and len(splits.val) == 50


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_source(tmp_path, dtype):
  ids = np.random.default_rng(0).integers(0, 259, size=2000).astype(dtype)
  path = tmp_path / "tokens.bin"
  ids.tofile(path)
  splits = corpus.load_splits(cfg(path, bin_dtype=dtype, val_fraction=0.1), 259, SEQ)
  assert isinstance(splits.train, np.memmap)
  np.testing.assert_array_equal(splits.train, ids[:1800])
  np.testing.assert_array_equal(splits.val, ids[1800:])


def test_bin_out_of_vocab_names_file_position_and_id(tmp_path, monkeypatch):
  monkeypatch.setattr(corpus, "_BIN_CHUNK", 256)  # The bad id sits in a later chunk: positions must be global.
  ids = np.zeros(2000, dtype=np.uint16)
  ids[1234] = 300
  ids[1500] = 999
  path = tmp_path / "bad.bin"
  ids.tofile(path)
  with pytest.raises(DataError, match=r"bad\.bin.*id 300 at position 1,234.*vocab_size=259"):
    corpus.load_splits(cfg(path), 259, SEQ)


def test_bin_size_not_a_multiple_of_dtype(tmp_path):
  path = tmp_path / "odd.bin"
  path.write_bytes(b"\x01\x00\x02")
  with pytest.raises(DataError, match="not a multiple of 2"):
    corpus.load_splits(cfg(path), 259, SEQ)


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "no such file or folder"),
    (lambda p: _write(p / "empty.txt", ""), "is empty"),
    (lambda p: _write(p / "blank.txt", " \n\n "), "is empty"),
    (lambda p: _write(p / "empty.bin", ""), "is empty"),
    (lambda p: _mkdir(p / "nothing"), "no .txt or .md files"),
    (lambda p: _write(_mkdir(p / "blanks") / "a.txt", "").parent, "files are empty"),
    (lambda p: _write(p / "tiny.txt", "x" * 100), "fewer than one window"),
])
def test_bad_sources_raise_data_error(tmp_path, make, message):
  path = make(tmp_path)
  with pytest.raises(DataError, match=message):
    corpus.load_splits(cfg(path), 259, SEQ)


def test_vocab_smaller_than_tokenizer(tmp_path):
  path = _write(tmp_path / "a.txt", "x" * 1000)
  with pytest.raises(DataError, match="smaller than the byte tokenizer"):
    corpus.load_splits(cfg(path), 200, SEQ)


def test_splits_is_a_named_tuple(tmp_path):
  path = _write(tmp_path / "a.txt", "y" * 1000)
  splits = corpus.load_splits(dataclasses.replace(DataConfig(), source=str(path)), 259, SEQ)
  train, val, name, description = splits
  assert name == str(path) and "train 950 tokens" in description


def _write(path, text):
  path.write_text(text)
  return path


def _mkdir(path):
  path.mkdir()
  return path
