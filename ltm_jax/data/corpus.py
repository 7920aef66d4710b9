"""Training text: the embedded corpus (see `ltm_jax.data.embedded`), or a user's text, folder or .bin file."""

from __future__ import annotations

import math
import os
import pathlib
import zlib
from typing import NamedTuple

import numpy as np

from ltm_jax.config import DataConfig
from ltm_jax.data.embedded import DOC_SEPARATOR, _encode, _load_embedded
from ltm_jax.data.tokenizer import ByteTokenizer, get_tokenizer
from ltm_jax.errors import DataError

EMBEDDED = "embedded"
TEXT_SUFFIXES = (".txt", ".md")
_BIN_CHUNK = 1 << 22


class Splits(NamedTuple):
  """Token ids of a corpus. `train`/`val`: 1-D unsigned integer arrays (np.memmap for .bin sources)."""
  train: np.ndarray
  val: np.ndarray
  name: str  # "embedded" or the source path.
  description: str  # One line with sizes, for logs.

  @property
  def is_token_file(self) -> bool:
    """Pre-tokenized ids (.bin): how many bytes a token stands for is unknown, so there is no bits-per-byte."""
    return self.name.endswith(".bin")


def load_splits(data_cfg: DataConfig, vocab_size: int, seq_len: int) -> Splits:
  """Loads `data_cfg.source` as train/validation token arrays; each holds at least one (seq_len+1)-token window.

  `source` is "embedded", a text file (its last `val_fraction` of tokens is validation), a .bin file of token ids
  (split the same way) or a folder. A folder that holds both `train.txt` and `val.txt` (such as a corpus written by
  `ltm_jax.data.pycorpus`) is read as already split: train.txt is the training split and val.txt the validation
  split, and its other files are ignored. Any other folder's .txt/.md files are split by file.

  Raises DataError for a missing path, an empty corpus, a .bin id >= `vocab_size`, or a split that is too small.
  """
  tokenizer = get_tokenizer(data_cfg.tokenizer)
  source = data_cfg.source
  if source == "markov":
    raise DataError("data.source=markov generates its documents as it goes and has no fixed token splits; this "
                    "command needs a text corpus (embedded, a file or a folder)")
  if source == EMBEDDED:
    _check_vocab(tokenizer, vocab_size)
    train, val, meta = _load_embedded(tokenizer)
    name = EMBEDDED
    what = f"embedded Python {meta['python']} documentation, {meta['documents']:,} documents"
  else:
    path = pathlib.Path(source).expanduser()
    name = str(path)
    if not path.exists():
      raise DataError(f"data.source {source!r}: no such file or folder")
    if path.is_dir():
      _check_vocab(tokenizer, vocab_size)
      train, val, n_files = _load_folder(path, tokenizer, data_cfg.val_fraction, seq_len)
      what = f"folder {path}, {n_files:,} text files"
    elif path.suffix == ".bin":
      train, val = _load_bin(path, data_cfg.bin_dtype, data_cfg.val_fraction, vocab_size)
      what = f"token file {path} ({data_cfg.bin_dtype})"
    else:
      _check_vocab(tokenizer, vocab_size)
      train, val = _load_text_file(path, tokenizer, data_cfg.val_fraction)
      what = f"text file {path}"
  for split, tokens in (("train", train), ("validation", val)):
    if len(tokens) < seq_len + 1:
      raise DataError(f"{split} split of {name} has {len(tokens):,} tokens, fewer than one window of "
                      f"seq_len+1={seq_len + 1}; use more data or a shorter train.seq_len")
  return Splits(train, val, name, f"{what}: train {len(train):,} tokens, validation {len(val):,} tokens")


def check_model_reads(data_cfg: DataConfig, vocab_size: int) -> None:
  """DataError unless a model of `vocab_size` ids can read `data_cfg.source`. Text is read through the tokenizer,
  whose ids mean what the model learnt only when the model has exactly the tokenizer's vocabulary (a larger one came
  with another tokenizer, e.g. a converted RWKV-4 model's 50,277 ids); a .bin token file holds the model's own ids,
  each checked against `vocab_size` when it is loaded."""
  path = pathlib.Path(data_cfg.source).expanduser()
  if data_cfg.source != EMBEDDED and path.suffix == ".bin" and not path.is_dir():
    return
  tokenizer = get_tokenizer(data_cfg.tokenizer)
  if vocab_size != tokenizer.vocab_size:
    raise DataError(f"the model's vocabulary ({vocab_size:,} ids) is not the {tokenizer.name} tokenizer's "
                    f"({tokenizer.vocab_size:,} ids), so it cannot read the text of data.source={data_cfg.source!r}; "
                    "use a .bin file of the model's own token ids (data.source=tokens.bin)")


def _check_vocab(tokenizer: ByteTokenizer, vocab_size: int) -> None:
  if vocab_size < tokenizer.vocab_size:
    raise DataError(f"model vocab_size={vocab_size} is smaller than the {tokenizer.name} tokenizer's "
                    f"{tokenizer.vocab_size} ids")


def _tail_split(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  n_val = min(len(tokens), max(1, math.ceil(len(tokens) * val_fraction)))
  return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]


def _hash_fraction(name: str) -> float:
  """A stable number in [0, 1) for `name`; crc32 does not change between runs like hash() does."""
  return zlib.crc32(name.encode("utf-8")) / 2**32


# -------------------------------------------------------------------------------------------------------- user data


def _read_text(path: pathlib.Path) -> str:
  try:
    # Undecodable bytes become U+FFFD: one bad byte in a large scrape should not stop training.
    return path.read_text(encoding="utf-8", errors="replace")
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from e


def _load_text_file(path: pathlib.Path, tokenizer: ByteTokenizer,
                    val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """The last `val_fraction` of the file's tokens is validation."""
  text = _read_text(path)
  if not text.strip():
    raise DataError(f"text file {path} is empty")
  return _tail_split(_encode(tokenizer, text), val_fraction)


def _text_files(folder: pathlib.Path) -> list[str]:
  """Relative POSIX paths of all .txt/.md files below `folder`, sorted; hidden files and folders are skipped."""
  found = []
  for dirpath, dirnames, filenames in os.walk(folder):
    # Hidden folders (.git, .venv) hold tool files, not the user's corpus.
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    rel_dir = pathlib.Path(dirpath).relative_to(folder)
    for f in filenames:
      if not f.startswith(".") and f.lower().endswith(TEXT_SUFFIXES):
        found.append((rel_dir / f).as_posix())
  return sorted(found)


def _load_folder(folder: pathlib.Path, tokenizer: ByteTokenizer, val_fraction: float,
                 seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Splits by file (stable hash of the relative path); falls back to a token tail split if a side is too small.

  A folder holding both train.txt and val.txt is already split: those two files are the splits.
  """
  presplit = (folder / "train.txt", folder / "val.txt")
  if all(path.is_file() for path in presplit):
    train, val = (_encode(tokenizer, _read_text(path)) for path in presplit)
    return train, val, len(presplit)
  names = _text_files(folder)
  if not names:
    raise DataError(f"folder {folder} contains no .txt or .md files")
  texts = {name: _read_text(folder / name) for name in names}
  texts = {name: text for name, text in texts.items() if text.strip()}
  if not texts:
    raise DataError(f"folder {folder}: all {len(names)} .txt/.md files are empty")
  sides = {True: [], False: []}
  for name, text in texts.items():
    sides[_hash_fraction(name) < val_fraction].append(text)
  train = _encode(tokenizer, DOC_SEPARATOR.join(sides[False]))
  val = _encode(tokenizer, DOC_SEPARATOR.join(sides[True]))
  if min(len(train), len(val)) < seq_len + 1:
    # Few or small files: a file-level split would leave one side without a single window.
    train, val = _tail_split(_encode(tokenizer, DOC_SEPARATOR.join(texts.values())), val_fraction)
  return train, val, len(texts)


def _load_bin(path: pathlib.Path, dtype: str, val_fraction: float,
              vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Raw token ids; every id is checked, since JAX clamps out-of-range gathers instead of failing."""
  itemsize = np.dtype(dtype).itemsize
  size = path.stat().st_size
  if size == 0:
    raise DataError(f"token file {path} is empty")
  if size % itemsize:
    raise DataError(f"token file {path} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
                    f"check data.bin_dtype")
  tokens = np.memmap(path, dtype=dtype, mode="r")
  # Chunked so that memory stays flat for files larger than RAM.
  for start in range(0, len(tokens), _BIN_CHUNK):
    chunk = tokens[start:start + _BIN_CHUNK]
    if int(chunk.max()) >= vocab_size:
      pos = int(np.argmax(chunk >= vocab_size))
      raise DataError(f"token file {path}: id {int(chunk[pos])} at position {start + pos:,} is outside the "
                      f"vocabulary (vocab_size={vocab_size})")
  return _tail_split(tokens, val_fraction)
