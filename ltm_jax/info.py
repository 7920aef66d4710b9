"""Static facts about a config: parameter count, training FLOPs per token and a memory estimate (no compilation)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.config import Config


def _visible_keys(seq_len: int, window: int | None) -> float:
  """Mean number of keys a query attends to under a causal (optionally windowed) mask: unmasked work only."""
  positions = np.arange(seq_len)
  return float(np.mean(np.minimum(positions + 1, window or seq_len)))


def model_info(cfg: Config) -> dict[str, Any]:
  m, t = cfg.model, cfg.train
  shapes = jax.eval_shape(lambda: model_lib.init_params(m, jax.random.key(0)))
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  n_params = sum(int(np.prod(x.shape)) for _, x in leaves)
  n_embedding = sum(int(np.prod(x.shape)) for path, x in leaves if "['embed']" in jax.tree_util.keystr(path))
  n_matmul = sum(int(np.prod(x.shape)) for path, x in leaves
                 if len(x.shape) >= 2 and "['embed']" not in jax.tree_util.keystr(path))
  if m.tie_embeddings:
    n_matmul += m.padded_vocab_size * m.d_model
  n_attention = sum(kind == "attention" for kind in m.mixers)
  # Forward: 2 FLOPs per multiply-add; QK^T and AV each cost 2*d per visible key. Training = 3x forward.
  attention_fwd = n_attention * 4 * m.d_model * _visible_keys(t.seq_len, m.window)
  flops_fwd = 2 * n_matmul + attention_fwd
  tokens = t.batch_size * t.seq_len
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
      "layers": "".join({"attention": "A", "rwkv4": "R"}[k] for k in m.mixers),
      "padded_vocab_size": m.padded_vocab_size,
      "flops_per_token_forward": flops_fwd,
      "flops_per_token_train": 3 * flops_fwd,
      "flops_per_step_train": 3 * flops_fwd * tokens,
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
