"""Static facts about a config: parameter count, training FLOPs per token and a memory estimate (no compilation)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.config import MIXERS, Config


def _visible_keys(seq_len: int, window: int | None) -> float:
  """Mean number of keys a query attends to under a causal (optionally windowed) mask: unmasked work only."""
  positions = np.arange(seq_len)
  return float(np.mean(np.minimum(positions + 1, window or seq_len)))


def _per_token(path) -> bool:
  """Whether a matrix multiplies every token (not the embedding lookup, not the latents' own key/value projections)."""
  name = jax.tree_util.keystr(path)
  return "['embed']" not in name and not ("['cross_attention']" in name and ("['k']" in name or "['v']" in name))


def model_info(cfg: Config) -> dict[str, Any]:
  m, t = cfg.model, cfg.train
  latent = model_lib.uses_latents(cfg.latent)
  shapes = jax.eval_shape(lambda: model_lib.init_params(m, jax.random.key(0), latent))
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  n_params = sum(int(np.prod(x.shape)) for _, x in leaves)
  n_embedding = sum(int(np.prod(x.shape)) for path, x in leaves if "['embed']" in jax.tree_util.keystr(path))
  n_matmul = sum(int(np.prod(x.shape)) for path, x in leaves if len(x.shape) >= 2 and _per_token(path))
  if m.tie_embeddings:
    n_matmul += m.padded_vocab_size * m.d_model
  n_attention = sum(kind == "attention" for kind in m.mixers)
  # Forward: 2 FLOPs per multiply-add; QK^T and AV each cost 2*d per visible key. Training = 3x forward.
  attention_fwd = n_attention * 4 * m.d_model * _visible_keys(t.seq_len, m.window)
  flops_fwd = 2 * n_matmul + attention_fwd
  tokens = t.batch_size * t.seq_len
  # Training = 3x forward (forward, gradients of activations and of weights). With latents, each inner step is a
  # forward and a backward to z only (~2x forward; no weight gradients), plus one forward scoring the fitted z.
  flops_train = 3 * flops_fwd
  if latent is not None:
    flops_fwd += m.n_layers * 4 * m.d_model * latent.n_per_layer  # QK^T and AV against the latents.
    flops_train = 3 * flops_fwd + (2 * latent.inner_steps + 1) * flops_fwd
  compute_bytes = 2 if m.dtype == "bfloat16" else 4
  # Activations kept for the backward pass, per token and layer, in units of d_model-sized vectors (approximate).
  per_layer = 0.0
  for kind in m.mixers:
    kv = 2 * m.kv_heads * m.head_dim / m.d_model
    per_layer += (4 + 1 + kv) if kind == "attention" else 9  # norm in/out, q, k/v, attn out | shifts, r, k, v, wkv
    ffn = m.ffn_kind(kind)
    per_layer += 2 + (3 if ffn == "swiglu" else 2) * m.ffn_dim(ffn) / m.d_model
  activation_bytes = tokens / t.grad_accum * m.d_model * per_layer * compute_bytes
  activation_bytes += tokens / t.grad_accum * m.vocab_size * 4 * 2  # float32 logits and their softmax.
  return {
      "name": cfg.name,
      "params": n_params,
      "params_non_embedding": n_params - n_embedding,
      "layers": "".join({name: letter for letter, name in MIXERS.items()}[k] for k in m.mixers),
      "padded_vocab_size": m.padded_vocab_size,
      "flops_per_token_forward": flops_fwd,
      "flops_per_token_train": flops_train,
      "flops_per_step_train": flops_train * tokens,
      "latent_inner_steps": 0 if latent is None else latent.inner_steps,
      "tokens_per_step": tokens,
      "param_bytes": 4 * n_params,
      "train_state_bytes": 16 * n_params,  # float32 params + grads + two Adam moments.
      "activation_bytes_estimate": int(activation_bytes),
      "memory_bytes_estimate": int(16 * n_params + activation_bytes),
  }


def format_info(info: dict[str, Any]) -> str:
  def human(x: float, unit: str) -> str:
    for prefix in ("", "K", "M", "G", "T", "P"):
      if abs(x) < 1000:
        return f"{x:.3g} {prefix}{unit}"
      x /= 1000
    return f"{x:.3g} E{unit}"

  lines = [f"config               {info['name']}",
           f"layers               {info['layers']}",
           f"parameters           {info['params']:,} ({info['params_non_embedding']:,} non-embedding)",
           f"FLOPs/token (fwd)    {human(info['flops_per_token_forward'], 'FLOP')}",
           f"FLOPs/token (train)  {human(info['flops_per_token_train'], 'FLOP')}",
           f"FLOPs/step (train)   {human(info['flops_per_step_train'], 'FLOP')} for {info['tokens_per_step']:,} tokens",
           f"train state memory   {human(info['train_state_bytes'], 'B')} (f32 params, grads, Adam moments)",
           f"activations (est.)   {human(info['activation_bytes_estimate'], 'B')} per micro-batch, no remat",
           f"total (est.)         {human(info['memory_bytes_estimate'], 'B')}"]
  return "\n".join(lines)
