"""Random checkpoints in the official RWKV layouts, for tests and benchmarks.

`x070_weights` and `rwkv4_weights` return {official name: float64 numpy array} with the names and shapes that the
official RWKV-LM trainers save (RWKV-7 "x070" and RWKV-4 "v4neo"), values drawn at natural scales and never zero, so
a converter that swaps two tensors, or a runtime that drops one, changes the logits visibly. `save` writes such a
dictionary as the float32 .pth file that `ltm_jax.convert.convert_rwkv` and the official `rwkv` package read.

Only `save` needs PyTorch, and imports it when called.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np


def _layernorm(rng: np.random.Generator, weights: dict[str, np.ndarray], prefix: str, d: int) -> None:
  """Adds a LayerNorm's `prefix`.weight [d] (around 1) and `prefix`.bias [d] to `weights`."""
  weights[prefix + ".weight"] = 1 + rng.normal(0, 0.2, d)
  weights[prefix + ".bias"] = rng.normal(0, 0.2, d)


def _matrix(rng: np.random.Generator, out: int, inp: int) -> np.ndarray:
  """A [out, inp] weight (torch's Linear layout) with 1/sqrt(inp) scale, so activations keep unit size."""
  return rng.normal(0, 1 / np.sqrt(inp), (out, inp))


def x070_weights(rng: np.random.Generator, vocab: int = 300, d: int = 128, head_size: int = 64, n_layers: int = 3,
                 hidden: int = 352, lora: Sequence[int] = (16, 8, 12, 24)) -> dict[str, np.ndarray]:
  """Random RWKV-7 (x070) weights: `vocab` ids, width `d` in heads of `head_size`, `n_layers` blocks, FFN width
  `hidden`, LoRA widths `lora` = (decay w, in-context rate a, value residual v, gate g).

  The defaults keep the FFN and LoRA widths off the official suggestions, so a converter must read them from the
  shapes. Layer 0 carries v0/v1/v2 too, as the official trainer saves them, although no runtime reads them there
  (that layer makes v_first)."""
  w = {"emb.weight": rng.normal(0, 1, (vocab, d)), "head.weight": _matrix(rng, vocab, d)}
  _layernorm(rng, w, "blocks.0.ln0", d)
  _layernorm(rng, w, "ln_out", d)
  vec = lambda low, high: rng.uniform(low, high, (1, 1, d))
  for i in range(n_layers):
    p = f"blocks.{i}."
    _layernorm(rng, w, p + "ln1", d)
    _layernorm(rng, w, p + "ln2", d)
    for c in "rwkvag":
      w[f"{p}att.x_{c}"] = vec(0, 1)
    for (name, base), rank in zip((("w", vec(-3, 1)), ("a", vec(-1, 1)), ("v", vec(-1, 1)), ("g", None)), lora):
      if base is not None:
        w[f"{p}att.{name}0"] = base
      w[f"{p}att.{name}1"] = _matrix(rng, rank, d).T
      w[f"{p}att.{name}2"] = _matrix(rng, d, rank).T
    w[p + "att.k_k"] = vec(0.5, 1.2)
    w[p + "att.k_a"] = vec(0.5, 1.5)
    w[p + "att.r_k"] = rng.normal(0, 0.3, (d // head_size, head_size))
    for name in ("receptance", "key", "value", "output"):
      w[f"{p}att.{name}.weight"] = _matrix(rng, d, d)
    _layernorm(rng, w, p + "att.ln_x", d)
    w[p + "ffn.x_k"] = vec(0, 1)
    w[p + "ffn.key.weight"] = _matrix(rng, hidden, d)
    w[p + "ffn.value.weight"] = _matrix(rng, d, hidden)
  return w


def rwkv4_weights(rng: np.random.Generator, vocab: int = 300, d: int = 64, n_layers: int = 3,
                  hidden: int = 256) -> dict[str, np.ndarray]:
  """Random RWKV-4 (v4neo) weights: `vocab` ids, width `d`, `n_layers` blocks, channel-mix width `hidden`."""
  w = {"emb.weight": rng.normal(0, 1, (vocab, d)), "head.weight": _matrix(rng, vocab, d)}
  _layernorm(rng, w, "blocks.0.ln0", d)
  _layernorm(rng, w, "ln_out", d)
  for i in range(n_layers):
    p = f"blocks.{i}."
    _layernorm(rng, w, p + "ln1", d)
    _layernorm(rng, w, p + "ln2", d)
    for c in "kvr":
      w[f"{p}att.time_mix_{c}"] = rng.uniform(0, 1, (1, 1, d))
    w[p + "att.time_decay"] = rng.uniform(-3, 1, d)
    w[p + "att.time_first"] = rng.normal(0, 0.5, d)
    for name in ("key", "value", "receptance", "output"):
      w[f"{p}att.{name}.weight"] = _matrix(rng, d, d)
    for c in "kr":
      w[f"{p}ffn.time_mix_{c}"] = rng.uniform(0, 1, (1, 1, d))
    w[p + "ffn.key.weight"] = _matrix(rng, hidden, d)
    w[p + "ffn.value.weight"] = _matrix(rng, d, hidden)
    w[p + "ffn.receptance.weight"] = _matrix(rng, d, d)
  return w


def save(weights: dict[str, np.ndarray], path: str | pathlib.Path) -> pathlib.Path:
  """Writes `weights` as a float32 torch .pth dictionary at `path` (the format official checkpoints ship in) and
  returns the path."""
  import torch  # Optional: only writing .pth files needs it.

  path = pathlib.Path(path)
  torch.save({k: torch.tensor(np.asarray(v), dtype=torch.float32) for k, v in weights.items()}, path)
  return path
