"""`ltm info`'s counts against sums written out from the layer definitions."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.info import model_info


@pytest.mark.parametrize("pattern, window", [("A", None), ("A", 8), ("R", None), ("RA", None)])
def test_params_and_flops_match_hand_counts(pattern, window):
  cfg = micro_config(layer_pattern=pattern, window=window, n_kv_heads=2)
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=32))
  m, d, T = cfg.model, cfg.model.d_model, 32
  info = model_info(cfg)
  assert info["params"] == model_lib.count_params(model_lib.init_params(m, jax.random.key(0)))
  matmul = m.padded_vocab_size * d  # LM head; the embedding is a lookup, not a matmul.
  attention_flops = 0.0
  for kind in m.mixers:
    if kind == "attention":
      matmul += d * d * 2 + 2 * d * m.kv_heads * m.head_dim  # q, out; k, v (GQA)
      visible = sum(min(i + 1, window or T) for i in range(T)) / T  # Causal (windowed) keys per query.
      attention_flops += 2 * 2 * d * visible  # QK^T and AV.
      matmul += 3 * d * m.ffn_dim("swiglu")
    else:
      matmul += 4 * d * d  # key, value, receptance, output
      matmul += 2 * d * m.ffn_dim("channel_mix") + d * d  # key, value, receptance
  assert info["flops_per_token_forward"] == pytest.approx(2 * matmul + attention_flops)
  assert info["flops_per_token_train"] == pytest.approx(3 * info["flops_per_token_forward"])
