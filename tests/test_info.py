"""`ltm info`'s counts against sums written out from the layer definitions, and its compiled memory analysis."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from conftest import ROOT, micro_config
from ltm_jax import cli
from ltm_jax import model as model_lib
from ltm_jax.config import load_config
from ltm_jax.info import model_info
from ltm_jax.train.compiled import compiled_memory


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


@pytest.mark.parametrize("pattern", ["M", "G"])
def test_titans_flops_match_hand_counts(pattern):
  cfg = micro_config(layer_pattern=pattern, window=8, n_kv_heads=2, memory_depth=2, memory_chunk=4)
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=32))
  m, d, T = cfg.model, cfg.model.d_model, 32
  info = model_info(cfg)
  assert info["params"] == model_lib.count_params(model_lib.init_params(m, jax.random.key(0)))
  matmul = m.padded_vocab_size * d
  visible = sum(min(i + 1, 8) for i in range(T)) / T
  per_layer_memory = 0.0
  n, hidden = m.head_dim, 2 * m.head_dim  # Memory MLP N -> 2N -> N per head.
  for i, o in ((n, hidden), (hidden, n)):
    # Reads through W_0 and S_0, forward and backward at the anchor, the state update; the chunk's factor reads.
    per_layer_memory += m.n_heads * 2 * (6 * i * o + 4 * (i + o))
  for _ in m.mixers:
    matmul += 4 * d * d + 3 * d * m.n_heads  # Memory q, k, v, out; the three gates.
    matmul += 3 * 4 * d  # The 4-tap convolutions of q, k, v: one multiply-add per tap and channel.
    matmul += d * d * 2 + 2 * d * m.kv_heads * m.head_dim  # Attention q, out; k, v.
    matmul += d * d if pattern == "G" else 0  # The mixing gate.
    matmul += 3 * d * m.ffn_dim("swiglu")
  expected = 2 * matmul + m.n_layers * (2 * 2 * d * visible + per_layer_memory)
  assert info["flops_per_token_forward"] == pytest.approx(expected)


def test_scanned_model_has_the_same_counts():
  cfg = micro_config(layer_pattern="RA", n_layers=4)
  scanned = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
  a, b = model_info(cfg), model_info(scanned)
  for key in ("params", "params_non_embedding", "flops_per_token_forward", "flops_per_token_train"):
    assert a[key] == b[key], key


def test_the_logits_estimate_follows_the_loss_chunk():
  """The float32 logits and their softmax [rows, positions held at once, padded vocabulary]: the whole sequence
  without a chunk, loss_chunk positions with one."""
  cfg = micro_config(vocab_size=1000)  # Padded to 1024.
  whole = model_info(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk=0)))
  chunked = model_info(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk=8)))
  t = cfg.train
  expected = t.batch_size / t.grad_accum * (t.seq_len - 8) * 1024 * 4 * 2
  assert whole["activation_bytes_estimate"] - chunked["activation_bytes_estimate"] == expected


def test_compiled_memory_of_the_train_step_follows_the_remat_policy(capsys):
  overrides = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "train.batch_size=2", "train.seq_len=128",
               "model.max_seq_len=128"]
  assert cli.main(["info", "--config", str(ROOT / "configs" / "tiny.py"), "--json", "--compile", *overrides]) == 0
  plain = json.loads(capsys.readouterr().out)
  for key in ("compiled_temp_bytes", "compiled_argument_bytes", "compiled_output_bytes", "compile_seconds"):
    assert plain[key] > 0, key
  # The donated train state (float32 params and two Adam moments) is written over in place.
  assert plain["compiled_alias_bytes"] >= 12 * plain["params"]
  remat = compiled_memory(load_config(ROOT / "configs" / "tiny.py", [*overrides, "model.remat=full"]))
  assert remat["compiled_temp_bytes"] < plain["compiled_temp_bytes"]
  assert remat["compiled_argument_bytes"] == plain["compiled_argument_bytes"]


def _compiled_flops_per_token(cfg) -> float:
  """XLA's FLOP count of the compiled train step per token (a loop body counted once)."""
  from ltm_jax.train.optimizer import learning_rate, make_optimizer
  from ltm_jax.train.step import create_train_state, make_train_step
  t = cfg.train
  model, optimizer = model_lib.LM(cfg.model, cfg.latent), make_optimizer(t)
  state = jax.eval_shape(lambda: create_train_state(
      model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent), optimizer, 0))
  batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), "int32") for k in ("inputs", "targets")}
  cost = make_train_step(model, optimizer, learning_rate(t), 1).lower(state, batch).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"] / (t.batch_size * t.seq_len)


def test_latent_step_flops_follow_the_compiled_step():
  # The FLOPs model of the latent step (trunk once; the top block for the fitted z and z_0 in one pass, the inner
  # step, the encoder) against what XLA counts in the compiled step, both as a ratio to the plain step's. One inner
  # step: XLA counts the loop's body once. XLA also counts norms, softmaxes and the optimizer, which the model
  # leaves out, on both sides of the ratio. Within 1%: the inner step's z-only backward skips the top block's mixer
  # and query projection, which z does not reach; charging them puts the model 2% over.
  base = micro_config(layer_pattern="A", window=8, n_layers=3, d_model=64, n_heads=4)
  latent = dataclasses.replace(base.latent, enabled=True, n_per_layer=4, top_layers=1, inner_steps=1, encoder=True,
                               encoder_width=32, continuation_fraction=1.0)
  cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=64, batch_size=2), latent=latent)
  plain = dataclasses.replace(cfg, latent=dataclasses.replace(latent, enabled=False))
  compiled = _compiled_flops_per_token(cfg) / _compiled_flops_per_token(plain)
  modelled = model_info(cfg)["latent_train_flops_vs_plain"]
  assert 1.2 < modelled < 1.6  # The trunk (two of three blocks) is run once, so far below 2x a plain step.
  assert modelled == pytest.approx(compiled, rel=0.01)


def test_an_rwkv7_layers_state_products_are_counted():
  """The WKV-7 state's products (S a, S r and the two rank-one updates: 8 N d FLOPs a token and layer) are model
  FLOPs, as attention's QK^T and AV are. The parameters do not depend on the head size N: two head sizes isolate
  them."""
  infos = {n: model_info(micro_config(layer_pattern="W", rwkv7_head_size=n)) for n in (8, 16)}
  assert infos[8]["params"] == infos[16]["params"]
  m = micro_config().model
  difference = infos[16]["flops_per_token_forward"] - infos[8]["flops_per_token_forward"]
  assert difference == pytest.approx(m.n_layers * 8 * (16 - 8) * m.d_model)
