"""Model-level accounting from the config alone (no compilation): the parameter shapes and the forward and training
FLOPs per token. `ltm_jax.info` reports them; the training loop's MFU and throughput read the training FLOPs."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from ltm_jax import latent as latent_lib
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


class ForwardFlops(NamedTuple):
  """Forward FLOPs per token of a model's parts: `trunk`, the blocks below the first that reads z (every block of a
  plain decoder); `top`, the latent-reading blocks (their attention to z included) and the LM head (just the head for
  a plain decoder); `encoder`, the latent encoder over each token it reads (0 without one); `before_z`, the part of
  `top` that z does not reach: the first latent-reading block's mixer and its cross-attention's query projection
  (0 where that block is in the scanned stack, whose layers are not told apart here)."""
  trunk: float
  top: float
  encoder: float
  before_z: float = 0.0


def _block_index(path) -> int | None:
  """i of a separate block's parameter (`block_{i}` at the top level); None for the scanned stack and the rest."""
  first = getattr(path[0], "key", "")
  return int(first[6:]) if first.startswith("block_") else None


def forward_flops(m: ModelConfig, latent: LatentConfig | None, seq_len: int,
                  leaves: list[tuple[Any, jax.ShapeDtypeStruct]] | None = None) -> ForwardFlops:
  """The forward FLOPs per token of rows of `seq_len` tokens, split as `ForwardFlops`; `leaves` are
  `param_leaves(m, latent)` (computed here when None). 2 FLOPs per multiply-add; QK^T and AV each cost 2*d per
  visible key, an RWKV-7 layer's state products 8*N*d (head size N)."""
  if leaves is None:
    leaves = param_leaves(m, latent)
  latent = model_lib.uses_latents(latent)
  first = model_lib.first_latent_layer(m, latent)
  trunk = top = encoder = before_z = 0.0
  first_separate = False
  for path, x in leaves:
    size = float(np.prod(x.shape))
    if getattr(path[0], "key", None) == model_lib.ENCODER:
      encoder += _encoder_flops(path, x)
    elif len(x.shape) - model_lib.is_stacked(path) >= 2 and _per_token(path):
      index = _block_index(path)
      if index is not None and index < first:
        trunk += 2 * size
      else:  # The latent-reading blocks, the scanned stack (all of it reads z when latents are on), the head.
        top += 2 * size
      if latent is not None and index == first:
        first_separate = True
        name = jax.tree_util.keystr(path)
        if "['mixer']" in name or ("['cross_attention']" in name and "['q']" in name):
          before_z += 2 * size
  if m.tie_embeddings:
    top += 2 * m.padded_vocab_size * m.d_model
  for index, kind in enumerate(m.mixers):
    core = 0.0
    if kind in ("attention", "titans_mal", "titans_mag"):
      core += 4 * m.d_model * _visible_keys(seq_len, m.window)
    if kind in ("titans_mal", "titans_mag"):
      core += _memory_flops(m)
    if kind == "rwkv7":
      # The WKV-7 state S [N, N] per head, each token: S a and S r, and the rank-one updates (S a) b^T and v k^T
      # added to S: four N^2 multiply-adds a head (the decay's N^2 multiplies, like activations, uncounted).
      core += 8 * m.rwkv7_head_size * m.d_model
    if kind == "mmrec":
      core += _mmrec_flops(m, seq_len)
    if index < first:
      trunk += core
    else:
      top += core + (0.0 if latent is None else 4 * m.d_model * latent.n_per_layer)  # QK^T and AV against z.
    if index == first and first_separate:
      before_z += core
  return ForwardFlops(trunk, top, encoder, before_z)


def _encoder_flops(path, x) -> float:
  """Per-token forward FLOPs of one latent-encoder parameter: the token-wise projections (n-gram, token MLP, pooling
  keys and values) multiply every token, the pooling queries score and read every token; the per-latent layers
  after the pooling are negligible beside them."""
  name = jax.tree_util.keystr(path)
  if "['queries']" in name:
    return 2 * 2 * float(np.prod(x.shape))
  per_token = ("['ngram']", "['token_mlp_in']", "['token_mlp_out']", "['k']", "['v']")
  return 2 * float(np.prod(x.shape)) if len(x.shape) >= 2 and any(p in name for p in per_token) else 0.0


def latent_train_flops(parts: ForwardFlops, latent: LatentConfig, seq_len: int, one_pass: bool = False) -> float:
  """Training FLOPs per token of a latent model's train step (`ltm_jax.train.step`), from its parts' forward FLOPs.
  A backward pass costs 2 forwards with weight gradients, 1 without (the inner loop differentiates z only).

  final objective: the trunk once (forward and backward); the top over the whole row under the fitted z; with
  continuation rows, the top again over the prefix under the loop's start z_0 (the first split_bound(T) positions
  when every row is one, else whole rows), unless `one_pass` (`ltm_jax.latent.one_pass_split`: z read by the last
  block alone) scores both in one pass; each inner step a forward and a z-only backward of the top over the
  fitted positions (with 0 steps, one such pass for the encoder's gradient), the backward skipping what z does not
  reach (`ForwardFlops.before_z`); the encoder forward and backward over the fitted positions. iterates: every one
  of the K + 1 iterates a forward and a full backward of the model."""
  whole = parts.trunk + parts.top
  if latent.decoder_objective == "iterates":
    return 3 * (latent.inner_steps + 1) * whole + 3 * parts.encoder
  fitted = latent_lib.split_bound(seq_len) / seq_len if latent.continuation_fraction == 1 else 1.0
  flops = 3 * parts.trunk + 3 * parts.top
  if latent.continuation_fraction > 0 and not one_pass:
    flops += 3 * parts.top * fitted
  z_passes = latent.inner_steps if latent.inner_steps or not latent.encoder else 1
  flops += (2 * parts.top - parts.before_z) * fitted * z_passes
  if latent.encoder:
    flops += 3 * parts.encoder * fitted
  return flops


def flops_per_token(m: ModelConfig, latent: LatentConfig | None, seq_len: int,
                    leaves: list[tuple[Any, jax.ShapeDtypeStruct]] | None = None) -> tuple[float, float]:
  """(forward, training) FLOPs per token of rows of `seq_len` tokens; `leaves` are `param_leaves(m, latent)`
  (computed here when None). The forward is the decoder's (the encoder left out); training is 3x the forward for
  a plain decoder, `latent_train_flops` with latents."""
  parts = forward_flops(m, latent, seq_len, leaves)
  latent = model_lib.uses_latents(latent)
  if latent is None:
    return parts.trunk + parts.top, 3 * (parts.trunk + parts.top)
  return parts.trunk + parts.top, latent_train_flops(parts, latent, seq_len, latent_lib.one_pass_split(m, latent))
