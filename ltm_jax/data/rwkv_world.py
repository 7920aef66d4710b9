"""The RWKV "World" tokenizer: 65,529 byte strings, encoded by greedy longest match from left to right.

This is the tokenizer of the official RWKV World / RWKV-7 models (vocabulary `rwkv_vocab_v20230424.txt`). The
vocabulary file is not shipped with ltm_jax: it comes with the `rwkv` pip package (`pip install rwkv`, pure Python,
no torch needed), or from a path given as `RwkvWorldTokenizer(path)` or in the environment variable
LTM_RWKV_WORLD_VOCAB. Every byte 0..255 is a token, so every string encodes; id 0 is the end-of-text token that
separates documents (it has no bytes).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import pathlib
from collections.abc import Iterable

import numpy as np

from ltm_jax.data.ids import checked_ids

VOCAB_FILE = "rwkv_vocab_v20230424.txt"
ENV_VAR = "LTM_RWKV_WORLD_VOCAB"
_TOKEN = -1  # Trie key under which a node stores the id of the token ending there (bytes are 0..255).


def default_vocab_path() -> pathlib.Path:
  """$LTM_RWKV_WORLD_VOCAB, else the copy inside the installed `rwkv` package; FileNotFoundError says how to get one."""
  if os.environ.get(ENV_VAR):
    path = pathlib.Path(os.environ[ENV_VAR])
    if not path.is_file():
      raise FileNotFoundError(f"{ENV_VAR}={path} is not a file")
    return path
  spec = importlib.util.find_spec("rwkv")  # Locates the package without importing it (no torch import).
  if spec is not None and spec.submodule_search_locations:
    for folder in spec.submodule_search_locations:
      path = pathlib.Path(folder) / VOCAB_FILE
      if path.is_file():
        return path
  raise FileNotFoundError(f"the RWKV World vocabulary {VOCAB_FILE} was not found: `pip install rwkv` (it ships the "
                          f"file) or set {ENV_VAR}=/path/to/{VOCAB_FILE}")


def _parse_token(literal: str) -> bytes:
  if "\\" not in literal and literal[:1] in ("'", '"') and literal[-1:] == literal[:1]:
    return literal[1:-1].encode("utf-8")  # The common case, ~30x faster than literal_eval.
  value = ast.literal_eval(literal)  # A Python str or bytes literal; never evaluated as code.
  return value.encode("utf-8") if isinstance(value, str) else value


@functools.lru_cache(maxsize=4)
def _load(path: str) -> tuple[tuple[bytes, ...], dict]:
  """(bytes of every id, with b"" for ids without a token; the byte trie) from a vocabulary file whose lines read
  `<id> <Python str or bytes literal> <length in bytes>`."""
  tokens: dict[int, bytes] = {}
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.rstrip("\n")
      if not line:
        continue
      first, last = line.index(" "), line.rindex(" ")
      token = _parse_token(line[first + 1:last])
      if not isinstance(token, bytes) or len(token) != int(line[last + 1:]):
        raise ValueError(f"{path}:{number}: malformed vocabulary line {line[:80]!r}")
      tokens[int(line[:first])] = token
  table = [b""] * (max(tokens) + 1)
  root: dict = {}
  for token_id, token in tokens.items():
    table[token_id] = token
    node = root
    for byte in token:
      node = node.setdefault(byte, {})
    node[_TOKEN] = token_id
  missing = [b for b in range(256) if _TOKEN not in root.get(b, {})]
  if missing:
    raise ValueError(f"{path}: single bytes {missing[:8]} have no token, so some text could not be encoded")
  return tuple(table), root


class RwkvWorldTokenizer:
  """Text <-> RWKV World ids (vocab_size 65536; id 0 = end of text, also used as bos and pad)."""

  name = "rwkv_world"
  vocab_size = 65536
  pad_id = 0
  bos_id = 0
  eos_id = 0

  def __init__(self, vocab_path: str | os.PathLike[str] | None = None):
    path = pathlib.Path(vocab_path) if vocab_path is not None else default_vocab_path()
    self._id_to_bytes, self._trie = _load(str(path.resolve()))
    if len(self._id_to_bytes) > self.vocab_size:
      raise ValueError(f"{path} has ids up to {len(self._id_to_bytes) - 1}, beyond vocab_size {self.vocab_size}")

  @property
  def bytes_per_token(self) -> None:
    """None: bytes per token depend on the text, so bits-per-byte is not derived from a fixed ratio here."""
    return None

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """Greedy longest match: at each position, the longest vocabulary entry that starts there. [n] int32."""
    trie, ids, start, end = self._trie, [], 0, len(data)
    while start < end:
      node, pos, best, best_end = trie, start, -1, start
      while pos < end:
        node = node.get(data[pos])
        if node is None:
          break
        pos += 1
        token_id = node.get(_TOKEN)
        if token_id is not None:
          best, best_end = token_id, pos
      ids.append(best)  # Every single byte is a token, so a match always exists.
      start = best_end
    return np.asarray(ids, np.int32)

  def encode(self, text: str) -> np.ndarray:
    """The ids of `text`'s UTF-8 bytes, shape [n] int32. No bos/eos are added."""
    return self.encode_bytes(text.encode("utf-8"))

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """The text of `ids` (any shape, flattened). Id 0 and the unused ids above 65529 have no bytes and vanish;
    byte sequences that are not valid UTF-8 (a sample cut mid-character) become U+FFFD. Ids outside
    [0, vocab_size) raise ValueError."""
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
    """The raw bytes of `ids` (for streaming through an incremental UTF-8 decoder)."""
    ids = checked_ids(ids, self.vocab_size, "RWKV World")
    table, known = self._id_to_bytes, len(self._id_to_bytes)
    return b"".join(table[i] for i in ids.tolist() if i < known)
