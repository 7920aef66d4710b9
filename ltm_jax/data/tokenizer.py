"""Tokenizers: text <-> integer ids. The byte tokenizer needs no vocabulary file and covers every string."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ltm_jax.data.ids import checked_ids
from ltm_jax.data.rwkv_world import RwkvWorldTokenizer

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
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
    """The raw bytes of `ids` (special ids dropped); streaming callers decode them with an incremental UTF-8
    decoder, so a character split across chunks is not mangled."""
    ids = checked_ids(ids, self.vocab_size, "byte")
    return ids[ids < 256].astype(np.uint8).tobytes()


_TOKENIZERS = {"byte": ByteTokenizer, "rwkv_world": RwkvWorldTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer | RwkvWorldTokenizer:
  """Returns the tokenizer called `name` ("byte" or "rwkv_world"); ValueError names the known ones otherwise."""
  if name not in _TOKENIZERS:
    raise ValueError(f"unknown tokenizer {name!r}; choose from {', '.join(sorted(_TOKENIZERS))}")
  return _TOKENIZERS[name]()

