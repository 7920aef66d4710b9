"""A layer pattern's letters: which of them run attention, and how a layer scan splits the pattern's layers (the
pattern's smallest repeating unit, the units kept as separate blocks before the scan, and the units the scan
stacks)."""

from __future__ import annotations

ATTENTION_LETTERS = "AMG"  # Letters whose layers run (windowed) attention, with RoPE and a key/value cache.


def period(pattern: str) -> int:
  """The length of the smallest unit that `pattern` repeats ("RARA" -> 2, "A" -> 1)."""
  return next(p for p in range(1, len(pattern) + 1)
              if len(pattern) % p == 0 and pattern[:p] * (len(pattern) // p) == pattern)


def prefix_units(pattern: str) -> int:
  """Units kept as separate blocks before a layer scan: the unit holding the first RWKV-7 layer ("W"), which makes
  v_first and has no value-residual parameters, unlike the RWKV-7 layers after it; none without RWKV-7 layers."""
  return 1 if "W" in pattern else 0


def scanned_units(pattern: str, n_layers: int) -> int:
  """How many repeats of `pattern`'s smallest unit a layer scan over `n_layers` layers stacks: all of them, less the
  `prefix_units`."""
  return n_layers // period(pattern) - prefix_units(pattern)
