"""Model-level accounting from the config alone (no compilation): the parameter shapes and the forward and training
FLOPs per token. `ltm_jax.info` reports them; the training loop's MFU and throughput read the training FLOPs."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.config import LatentConfig, ModelConfig


def _visible_keys(seq_len: int, window: int | None) -> float:
  """Mean number of keys a query attends to under a causal (optionally windowed) mask: unmasked work only."""
  positions = np.arange(seq_len)
  return float(np.mean(np.minimum(positions + 1, window or seq_len)))


def _per_token(path) -> bool:
  """Whether a matrix multiplies every token (not the embedding lookup, not the latents' own key/value projections,
  not the Titans memory's initial weights, whose per-token work `_memory_flops` counts)."""
  name = jax.tree_util.keystr(path)
  return ("['embed']" not in name and "['memory_" not in name
          and not ("['cross_attention']" in name and ("['k']" in name or "['v']" in name)))


def _memory_flops(m) -> float:
  """Forward FLOPs per token of one Titans memory (the chunked op): per head and memory layer of d_in x d_out
  weights, the reads through W_0 and S_0, the forward and backward at the anchor that give the gradient factors, and
  the chunk's state update are each a d_in x d_out product (6 in all), and the read against the chunk's C factor
  pairs costs C (d_in + d_out)."""
  dims = [m.head_dim] + [m.memory_expansion * m.head_dim] * (m.memory_depth - 1) + [m.head_dim]
  return m.n_heads * sum(2 * (6 * i * o + m.memory_chunk * (i + o)) for i, o in zip(dims, dims[1:]))


def _mmrec_flops(m, seq_len: int) -> float:
  """Forward FLOPs per token of one MM-Rec (D) layer beyond its weight matmuls (which `n_matmul` counts, the
  recurrent gate's h_{t-1} W_gh included): the memory attention's scores and read, 2 d_model each per visible bank
  entry, averaged over a training row from an empty state (position p sees min(slots, p // segment) summaries)."""
  visible = np.minimum(np.arange(seq_len) // m.mmrec_segment, m.mmrec_slots)
  return 4 * m.d_model * float(np.mean(visible))


def param_leaves(m: ModelConfig, latent: LatentConfig | None) -> list[tuple[Any, jax.ShapeDtypeStruct]]:
  """(path, shape) of every parameter of `model_lib.init_params` for `m` (with latents when `latent` uses them),
  from an abstract evaluation: nothing is allocated."""
  latent = model_lib.uses_latents(latent)
  shapes = jax.eval_shape(lambda: model_lib.init_params(m, jax.random.key(0), latent))
  return jax.tree_util.tree_flatten_with_path(shapes)[0]


def flops_per_token(m: ModelConfig, latent: LatentConfig | None, seq_len: int,
                    leaves: list[tuple[Any, jax.ShapeDtypeStruct]] | None = None) -> tuple[float, float]:
  """(forward, training) FLOPs per token of rows of `seq_len` tokens; `leaves` are `param_leaves(m, latent)`
  (computed here when None)."""
  if leaves is None:
    leaves = param_leaves(m, latent)
  latent = model_lib.uses_latents(latent)
  # A scanned model's stacked parameters lead with the layer axis: a per-layer vector is not a matrix.
  n_matmul = sum(int(np.prod(x.shape)) for path, x in leaves
                 if len(x.shape) - model_lib.is_stacked(path) >= 2 and _per_token(path))
  if m.tie_embeddings:
    n_matmul += m.padded_vocab_size * m.d_model
  n_attention = sum(kind in ("attention", "titans_mal", "titans_mag") for kind in m.mixers)
  n_memory = sum(kind in ("titans_mal", "titans_mag") for kind in m.mixers)
  # Forward: 2 FLOPs per multiply-add; QK^T and AV each cost 2*d per visible key. Training = 3x forward.
  attention_fwd = n_attention * 4 * m.d_model * _visible_keys(seq_len, m.window)
  n_mmrec = sum(kind == "mmrec" for kind in m.mixers)
  flops_fwd = 2 * n_matmul + attention_fwd + n_memory * _memory_flops(m) + n_mmrec * _mmrec_flops(m, seq_len)
  # Training = 3x forward (forward, gradients of activations and of weights). With latents, each inner step is a
  # forward and a backward to z only (~2x forward; no weight gradients), plus one forward scoring the fitted z.
  flops_train = 3 * flops_fwd
  if latent is not None:
    flops_fwd += m.n_layers * 4 * m.d_model * latent.n_per_layer  # QK^T and AV against the latents.
    flops_train = 3 * flops_fwd + (2 * latent.inner_steps + 1) * flops_fwd
    if latent.decoder_objective == "iterates":  # Every iterate's backward also takes the weight gradients.
      flops_train = 3 * (latent.inner_steps + 1) * flops_fwd
  return flops_fwd, flops_train
