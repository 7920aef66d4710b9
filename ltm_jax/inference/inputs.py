"""Checks of what users pass to the API, on the host at the call boundary, each failing with a one-line ValueError:
token ids (shape, integer dtype, inside the vocabulary, with the first bad id's position), sampling settings, seeds
and the batch size a decoding state was made for. Jitted code never sees an unchecked value."""

from __future__ import annotations

import math
import numbers
import operator

import jax
import numpy as np

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.inference import generate as generation


def as_prompts(prompt, pad_id: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """A [B, T] array (all rows T tokens) or a list of B token sequences -> left-padded (tokens, lengths), every id
  checked against the vocabulary."""
  _refuse_non_ids(prompt, "prompt", "[B, T] or a list of token-id sequences")
  if isinstance(prompt, (list, tuple)) and prompt and np.ndim(prompt[0]) == 1:
    rows = [np.asarray(row) for row in prompt]
    for i, row in enumerate(rows):
      check_ids(row, vocab_size, where=(i,))
    return generation.left_pad(rows, pad_id)
  prompt = np.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be token ids [B, T] with B >= 1 and T >= 1 or a list of token sequences, got "
                     f"shape {prompt.shape}")
  check_ids(prompt, vocab_size)
  return prompt.astype(np.int32), np.full(prompt.shape[:1], prompt.shape[1], np.int32)


PROMPT_TYPES = ("a prompt string, a list of strings, token ids [T] (a list of ints or a 1-D integer array) or a list "
                "of token-id sequences ([B, T] array)")


def prompt_rows(prompt, vocab_size: int, what: str) -> tuple[list[np.ndarray], bool]:
  """Token-id prompts -> (one id array per prompt, whether `prompt` was a single prompt): token ids [T] are one
  prompt; a list of sequences or a [B, T] array are several, of any lengths. Anything else (None, a mix of text
  and ids, ...) is a one-line ValueError naming the accepted types (`PROMPT_TYPES`: text is the caller's)."""
  refused = ValueError(f"{what} takes {PROMPT_TYPES}; got {_describe(prompt)}")
  if prompt is None or isinstance(prompt, (bytes, dict, set)) or isinstance(prompt, (list, tuple)) and not prompt:
    raise refused
  if isinstance(prompt, (list, tuple)) and all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt):
    rows = [np.asarray(p) for p in prompt]
    if any(row.ndim != 1 or row.dtype.kind not in "iu" and row.size for row in rows):
      raise refused
    for i, row in enumerate(rows):
      check_ids(row, vocab_size, where=(i,))
    return [row.astype(np.int32) for row in rows], False
  ids = np.asarray(prompt) if isinstance(prompt, (list, tuple, np.ndarray, jax.Array)) else None
  if ids is None or ids.ndim not in (1, 2) or ids.dtype.kind not in "iu":
    raise refused
  check_ids(ids, vocab_size)
  return ([ids.astype(np.int32)], True) if ids.ndim == 1 else (list(ids.astype(np.int32)), False)


def _describe(value) -> str:
  """A short name of what was passed, for errors: its type, and a list's element types."""
  if isinstance(value, (list, tuple)):
    kinds = sorted({type(v).__name__ for v in value})
    return f"an empty {type(value).__name__}" if not value else f"a {type(value).__name__} of {', '.join(kinds)}"
  return "None" if value is None else type(value).__name__


def _refuse_non_ids(tokens, what: str, layout: str) -> None:
  """A one-line ValueError for a value that is not token ids at all (text, None, a mapping), before numpy reads
  it as a 0-d array of another kind."""
  if tokens is None or isinstance(tokens, (str, bytes, dict, set)):
    hint = "; lm.encode(text) gives a text's ids" if isinstance(tokens, str) else ""
    raise ValueError(f"{what} takes token ids {layout} (an integer array or lists of ints), got "
                     f"{_describe(tokens)}{hint}")


def token_ids(tokens, vocab_size: int, what: str, *, single: bool = True, min_length: int = 1) -> np.ndarray:
  """`tokens` as int32 host ids [B, T] (or [T] when `single`), or a one-line ValueError for text or None, another
  shape, fewer than `min_length` tokens per row, a non-integer dtype or an id outside [0, vocab_size). Checked on
  the host, once per call: out of range, a gather would silently clamp, wrap around or read an untrained padding
  row."""
  _refuse_non_ids(tokens, what, "[B, T] or [T]" if single else "[B, T]")
  ids = np.asarray(tokens)
  if ids.ndim not in ((1, 2) if single else (2,)) or ids.size == 0 or ids.shape[-1] < min_length:
    layout = "[B, T] or [T]" if single else "[B, T]"
    raise ValueError(f"{what} needs token ids {layout} with B >= 1 and T >= {min_length}, got shape {ids.shape}")
  check_ids(ids, vocab_size)
  return ids.astype(np.int32)


def check_ids(ids: np.ndarray, vocab_size: int, what: str = "token id", where: tuple[int, ...] = ()) -> None:
  """ValueError naming the first id outside [0, vocab_size) and its index (prefixed by `where`)."""
  if not ids.size:
    return
  if ids.dtype.kind not in "iu":
    raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
  if ids.min() < 0 or ids.max() >= vocab_size:  # Two cheap reductions; the position is searched only on failure.
    index = tuple(int(i) for i in np.argwhere((ids < 0) | (ids >= vocab_size))[0])
    position = ", ".join(str(i) for i in where + index)
    raise ValueError(f"{what} {int(ids[index])} at [{position}] is outside the vocabulary [0, {vocab_size})")


def state_batch(cfg: config_lib.ModelConfig, state) -> int | None:
  """The batch size `state` (from `init_state`) was made for; None for a state without arrays."""
  leaves = jax.tree.leaves(state[0]) if isinstance(state, (tuple, list)) and state else []
  if not leaves:
    return None
  stacked = model_lib.scan_layout(cfg).prefix_layers == 0  # The first entry holds scanned layers: [units, B, ...].
  return leaves[0].shape[1 if stacked else 0]


SEED_RANGE = (-2**63, 2**63)  # jax.random.key takes a signed 64-bit integer.


def key(seed) -> jax.Array:
  """jax.random.key(seed), or a one-line ValueError for a seed it cannot take."""
  if not _is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
    raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
  return jax.random.key(operator.index(seed))


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, *, low: int) -> None:
  if not _is_int(value) or value < low:
    raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_sampling(*, max_new_tokens, temperature, top_k, top_p) -> None:
  """One-line ValueErrors for settings the sampler cannot use; NaN would otherwise pass every comparison and make
  every sampled token garbage."""
  check_int("max_new_tokens", max_new_tokens, low=1)
  if top_k is not None:
    check_int("top_k", top_k, low=1)
  if not _is_real(temperature) or not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
  if top_p is not None and (not _is_real(top_p) or not 0 < top_p <= 1):
    raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def _is_real(value) -> bool:
  """A Python or NumPy number, or a 0-d numeric array (a jax scalar); not a bool, a string or None."""
  if isinstance(value, bool):
    return False
  return isinstance(value, numbers.Real) or (np.ndim(value) == 0 and np.asarray(value).dtype.kind in "iuf")
