"""Tokenizers: text <-> integer ids. The byte tokenizer needs no vocabulary file and covers every string."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PAD_ID = 256
BOS_ID = 257
EOS_ID = 258


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, plus the specials pad=256, bos=257, eos=258 (vocab_size 259)."""

  name = "byte"
  vocab_size = 259
  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID

  @property
  def bytes_per_token(self) -> float:
    """Average UTF-8 bytes per (non-special) token; converts nats/token into bits-per-byte."""
    return 1.0

  def encode(self, text: str) -> np.ndarray:
    """Returns the UTF-8 bytes of `text` as int32 ids, shape [len(text.encode())]. No bos/eos are added."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Returns the text of `ids` (any shape, flattened); special ids are dropped.

    Byte sequences that are not valid UTF-8 (e.g. a sample cut mid-character) become U+FFFD instead of raising, so
    any sequence of in-vocabulary ids decodes. Ids outside [0, vocab_size) raise ValueError.
    """
    if not hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
      ids = list(ids)  # A generator; arrays (numpy or jax) convert without a Python loop.
    ids = np.asarray(ids)
    if ids.size and ids.dtype.kind not in "iu":
      raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    ids = ids.reshape(-1)
    bad = (ids < 0) | (ids >= self.vocab_size)
    if bad.any():
      first = int(np.argmax(bad))
      raise ValueError(f"token id {int(ids[first])} at position {first} is outside the byte vocabulary "
                       f"[0, {self.vocab_size})")
    return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


_TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer:
  """Returns the tokenizer called `name` ("byte"); ValueError names the known ones otherwise."""
  if name not in _TOKENIZERS:
    raise ValueError(f"unknown tokenizer {name!r}; choose from {', '.join(sorted(_TOKENIZERS))}")
  return _TOKENIZERS[name]()
