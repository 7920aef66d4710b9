"""User corpora: text file, folder and .bin sources, and load_splits' checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ltm_jax.config import DataConfig
from ltm_jax.data import corpus
from ltm_jax.data.tokenizer import ByteTokenizer
from ltm_jax.errors import DataError

TOK = ByteTokenizer()
SEQ = 16


def cfg(source, **kw):
  return DataConfig(source=str(source), **kw)


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
