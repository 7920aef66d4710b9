"""Validation of token ids shared by the tokenizers."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def checked_ids(ids: Iterable[int] | np.ndarray, vocab_size: int, vocabulary: str) -> np.ndarray:
  """`ids` (any shape, any iterable) as a flat integer array, or ValueError naming the first id outside
  [0, vocab_size) and its position."""
  if not hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
    ids = list(ids)  # A generator; arrays (numpy or jax) convert without a Python loop.
  ids = np.asarray(ids)
  if ids.size and ids.dtype.kind not in "iu":
    raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
  ids = ids.reshape(-1)
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    first = int(np.argmax(bad))
    raise ValueError(f"token id {int(ids[first])} at position {first} is outside the {vocabulary} vocabulary "
                     f"[0, {vocab_size})")
  return ids
