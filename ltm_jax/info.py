"""Facts about a config: parameter count, training FLOPs per token and a memory estimate (no compilation). The
memory of the real train step as XLA compiles it is `ltm_jax.train.compiled.compiled_memory`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ltm_jax import flops
from ltm_jax import model as model_lib
from ltm_jax.config import MIXERS, Config
from ltm_jax.layers import pipeline


def model_info(cfg: Config) -> dict[str, Any]:
  m, t = cfg.model, cfg.train
  latent = model_lib.uses_latents(cfg.latent)
  leaves = flops.param_leaves(m, cfg.latent)
  n_params = sum(int(np.prod(x.shape)) for _, x in leaves)
  n_embedding = sum(int(np.prod(x.shape)) for path, x in leaves if "['embed']" in jax.tree_util.keystr(path))
  flops_fwd, flops_train = flops.flops_per_token(m, cfg.latent, t.seq_len, leaves)
  # What latents cost: the train step's FLOPs against the same decoder's without them.
  plain_train = flops.flops_per_token(m, None, t.seq_len)[1] if latent is not None else flops_train
  tokens = t.batch_size * t.seq_len
  compute_bytes = 2 if m.dtype in ("bfloat16", "float16") else 4
  # Activations kept for the backward pass, per token and layer, in units of d_model-sized vectors (approximate).
  per_layer = 0.0
  for kind in m.mixers:
    attention = 4 + 1 + 2 * m.kv_heads * m.head_dim / m.d_model  # Norm in/out, q, k/v, attention out.
    # RWKV: shifts, r, k, v, wkv. Titans: the attention's, and the memory's q, k, v before and after the
    # convolution, its read and output.
    # MM-Rec: q, k, v, z, the decay MLPs' hidden and outputs, the gate input, h and the saved gate, the memory
    # query, read and output.
    per_layer += {"attention": attention, "titans_mal": attention + 7, "titans_mag": attention + 7,
                  "mmrec": 14}.get(kind, 9)
    ffn = m.ffn_kind(kind)
    per_layer += 2 + (3 if ffn == "swiglu" else 2) * m.ffn_dim(ffn) / m.d_model
  activation_bytes = tokens / t.grad_accum * m.d_model * per_layer * compute_bytes
  # Float32 logits over the padded vocabulary and their softmax: loss_chunk positions of each row at a time.
  logit_positions = m.loss_chunk if 0 < m.loss_chunk < t.seq_len else t.seq_len
  activation_bytes += t.batch_size / t.grad_accum * logit_positions * m.padded_vocab_size * 4 * 2
  # A mesh.pipeline of -1 is only known against the devices; it is reported as the one stage it may turn out to be.
  stages = max(cfg.mesh.pipeline, 1)
  micro_batches = m.pipeline_micro_batches if stages > 1 else 1
  return {
      "name": cfg.name,
      "params": n_params,
      "params_non_embedding": n_params - n_embedding,
      "layers": "".join({name: letter for letter, name in MIXERS.items()}[k] for k in m.mixers),
      "padded_vocab_size": m.padded_vocab_size,
      "receptive_field": m.receptive_field,  # Tokens a logit can see without latents; None: unbounded.
      "flops_per_token_forward": flops_fwd,
      "flops_per_token_train": flops_train,
      "flops_per_step_train": flops_train * tokens,
      "latent_inner_steps": 0 if latent is None else latent.inner_steps,
      "latent_layers": 0 if latent is None else model_lib.latent_layers(m, latent),
      "latent_encoder": latent is not None and latent.encoder,
      "latent_train_flops_vs_plain": flops_train / plain_train,
      "tokens_per_step": tokens,
      "param_bytes": 4 * n_params,
      "train_state_bytes": 16 * n_params,  # float32 params + grads + two Adam moments.
      "activation_bytes_estimate": int(activation_bytes),
      "memory_bytes_estimate": int(16 * n_params + activation_bytes),
      "pipeline_stages": stages,
      "pipeline_units_per_stage": m.scanned_units // stages if stages > 1 else m.scanned_units,
      "pipeline_micro_batches": micro_batches,
      # The idle fraction of every stage in a GPipe step: what MFU loses to the schedule alone.
      "pipeline_bubble": pipeline.bubble_fraction(stages, micro_batches),
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
           f"receptive field      {info['receptive_field'] or 'unbounded'} tokens (without latents)",
           f"parameters           {info['params']:,} ({info['params_non_embedding']:,} non-embedding)",
           f"FLOPs/token (fwd)    {human(info['flops_per_token_forward'], 'FLOP')}",
           f"FLOPs/token (train)  {human(info['flops_per_token_train'], 'FLOP')}",
           f"FLOPs/step (train)   {human(info['flops_per_step_train'], 'FLOP')} for {info['tokens_per_step']:,} tokens",
           *([f"latent step          {info['latent_train_flops_vs_plain']:.2f}x the plain decoder's training FLOPs "
              f"(z read by {info['latent_layers']} block(s), {info['latent_inner_steps']} inner steps, "
              f"{'an' if info['latent_encoder'] else 'no'} encoder)"] if info["latent_layers"] else []),
           f"train state memory   {human(info['train_state_bytes'], 'B')} (f32 params, grads, Adam moments)",
           f"activations (est.)   {human(info['activation_bytes_estimate'], 'B')} per micro-batch, no remat",
           f"total (est.)         {human(info['memory_bytes_estimate'], 'B')}"]
  if info["pipeline_stages"] > 1:
    lines.append(f"pipeline             {info['pipeline_stages']} stages x {info['pipeline_units_per_stage']} scanned "
                 f"units, {info['pipeline_micro_batches']} micro-batches (GPipe), bubble "
                 f"{100 * info['pipeline_bubble']:.1f}% of each step")
  if "compiled_temp_bytes" in info:
    lines += [(f"compiled for         {info['compiled_for']}: remat={info['remat']}, "
               f"scan_layers={info['scan_layers']}; lowered in {info['lower_seconds']:.1f}s, "
               f"compiled in {info['compile_seconds']:.1f}s"),
              f"compiled temp        {human(info['compiled_temp_bytes'], 'B')} (activations, gradients, scratch)",
              (f"compiled args/out    {human(info['compiled_argument_bytes'], 'B')} in, "
               f"{human(info['compiled_output_bytes'], 'B')} out ({human(info['compiled_alias_bytes'], 'B')} donated)"),
              f"compiled total       {human(info['compiled_total_bytes'], 'B')}"]
  return "\n".join(lines)
