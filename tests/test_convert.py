"""`ltm convert-rwkv`: tiny random checkpoints in the official RWKV-7 (x070) and RWKV-4 layouts, run by the official
implementation (the `rwkv` pip package, 'cpu fp32', in a subprocess because it reads its switches from the
environment at import) and by the converted model, on the same tokens, whole and continued from a carried state.

Needs the `convert` extra (torch CPU build + rwkv); skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ltm_jax.convert.synthetic import rwkv4_weights, save, x070_weights

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("rwkv") is None,
    reason="needs the convert extra: torch (CPU build) and rwkv")

# float32 on both sides, summed in different orders (torch's per-token loop vs our chunked WKV and XLA matmuls)
# through 3 layers and a LayerNorm'd head: logits agree to ~1e-6 of their largest magnitude (measured 9e-7 with
# x070, 4e-7 with RWKV-4). Allow 1e-5 of the largest logit; swapping two per-channel vectors of one layer moves the
# logits by ~0.4 of it.
LOGIT_RTOL = 1e-5
TOKENS = [5, 17, 250, 3, 3, 99, 120, 7, 64, 201, 13, 0, 42, 180, 2, 77]
SEGMENTS = [(0, 7), (7, 8), (8, 16)]  # A prompt, one decoding step, and a longer continuation.

OFFICIAL = r"""
import json, sys
import numpy as np
import torch
path, version, out = sys.argv[1], sys.argv[2], sys.argv[5]
tokens, segments = json.loads(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(1)
from rwkv import model as official
if version == "x070":
    model = official.RWKV_x070(path[:-len(".pth")], "cpu fp32")  # It appends ".pth" itself.
else:
    model = official.RWKV(path, "cpu fp32", verbose=False)
def run(ids, state):
    logits, state = model.forward(ids, state, full_output=True)
    return logits.float().numpy().reshape(len(ids), -1), state
whole, _ = run(tokens, None)
state, pieces = None, []
for start, stop in segments:
    logits, state = run(tokens[start:stop], state)
    pieces.append(logits)
np.savez(out, whole=whole, segments=np.concatenate(pieces))
"""


def _official_logits(path, version, tmp_path):
  out = tmp_path / f"official-{version}.npz"
  env = {**os.environ, "RWKV_JIT_ON": "0", "RWKV_CUDA_ON": "0", "RWKV_V7_ON": "1" if version == "x070" else "0"}
  done = subprocess.run([sys.executable, "-c", OFFICIAL, str(path), version, json.dumps(TOKENS), json.dumps(SEGMENTS),
                         str(out)], env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  result = np.load(out)
  return result["whole"], result["segments"]


def _ours(workdir):
  import ltm_jax
  lm = ltm_jax.load(workdir)
  tokens = np.asarray(TOKENS, np.int32)[None]
  whole = np.asarray(lm.forward(tokens))[0]
  state, pieces = lm.init_state(1), []
  for start, stop in SEGMENTS:
    logits, state = lm.step(state, tokens[:, start:stop])
    pieces.append(np.asarray(logits)[0])
  return lm, whole, np.concatenate(pieces)


@pytest.mark.parametrize("version", ["x070", "rwkv4"])
def test_converted_logits_match_the_official_implementation(version, tmp_path):
  from ltm_jax.convert import convert_rwkv
  rng = np.random.default_rng(0 if version == "x070" else 1)
  weights = x070_weights(rng) if version == "x070" else rwkv4_weights(rng)
  path = save(weights, tmp_path / f"{version}.pth")
  cfg = convert_rwkv(path, tmp_path / "work")
  m = cfg.model
  assert m.layer_pattern == ("W" if version == "x070" else "R") and m.ln0 and m.norm == "layernorm"
  assert (m.vocab_size, m.n_layers, m.mlp_dim) == ((300, 3, 352) if version == "x070" else (300, 3, 256))
  if version == "x070":
    assert (m.d_model, m.rwkv7_head_size) == (128, 64)
    assert (m.rwkv7_decay_lora, m.rwkv7_iclr_lora, m.rwkv7_value_lora, m.rwkv7_gate_lora) == (16, 8, 12, 24)
  official_whole, official_segments = _official_logits(path, version, tmp_path)
  lm, whole, segments = _ours(tmp_path / "work")
  assert lm.config.data.tokenizer == "byte" and lm.trained_steps == 0
  scale = np.abs(official_whole).max()
  assert scale > 1 and official_whole.std() > 0.3  # Informative logits, not a near-constant output.
  np.testing.assert_allclose(whole, official_whole, atol=LOGIT_RTOL * scale, rtol=0)
  np.testing.assert_allclose(segments, official_segments, atol=LOGIT_RTOL * scale, rtol=0)
  np.testing.assert_allclose(official_segments, official_whole, atol=LOGIT_RTOL * scale, rtol=0)  # Sanity.


def test_cli_converts_a_world_model_that_eval_and_generate_accept_and_never_overwrites(tmp_path, capsys):
  from ltm_jax import cli
  path = save(x070_weights(np.random.default_rng(2), vocab=65536, d=64, head_size=32, n_layers=2, hidden=128,
                            lora=(32, 32, 32, 32)), tmp_path / "world.pth")
  out = tmp_path / "world"
  assert cli.main(["convert-rwkv", "--checkpoint", str(path), "--out", str(out), "--step", "7"]) == 0
  assert json.loads((out / "config.json").read_text())["data"]["tokenizer"] == "rwkv_world"
  capsys.readouterr()
  assert cli.main(["generate", "--workdir", str(out), "--prompt", "Hello", "--max-new-tokens", "4",
                   "--temperature", "0"]) == 0
  assert capsys.readouterr().out.startswith("Hello")
  assert cli.main(["eval", "--workdir", str(out), "--batches", "1", "--batch-size", "1"]) == 0
  evaluation = json.loads((out / "eval.json").read_text())
  assert evaluation["step"] == 7 and np.isfinite(evaluation["val_loss"])
  before = sorted(p.name for p in out.rglob("*"))
  assert cli.main(["convert-rwkv", "--checkpoint", str(path), "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error:") and "already holds a workdir" in err and "\n" not in err
  assert sorted(p.name for p in out.rglob("*")) == before


def test_unsupported_layouts_are_named(tmp_path):
  from ltm_jax.convert import ConversionError, convert_rwkv, detect_version
  v6 = {"emb.weight": np.zeros((4, 4)), "blocks.0.att.time_maa_x": np.zeros((1, 1, 4)),
        "blocks.0.att.time_faaaa": np.zeros((1, 4))}
  with pytest.raises(ConversionError, match="RWKV-6"):
    detect_version(v6)
  with pytest.raises(ConversionError, match="not an RWKV-7"):
    detect_version({"model.embed_tokens.weight": np.zeros((4, 4))})
  weights = x070_weights(np.random.default_rng(3), vocab=260, d=32, head_size=16, n_layers=1, hidden=64,
                         lora=(8, 8, 8, 8))
  del weights["blocks.0.att.k_a"]
  with pytest.raises(ConversionError, match="blocks.0.att.k_a"):
    convert_rwkv(save(weights, tmp_path / "broken.pth"), tmp_path / "out")
  assert not (tmp_path / "out").exists()
  weights["blocks.0.att.k_a"] = np.ones((1, 1, 32))
  weights["blocks.0.ffn.s_emb.weight"] = np.ones((260, 1024))  # A DeepEmbed x070 variant: refused, not dropped.
  with pytest.raises(ConversionError, match="s_emb"):
    convert_rwkv(save(weights, tmp_path / "deepembed.pth"), tmp_path / "out")
  (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
  with pytest.raises(ConversionError, match="could not read"):
    convert_rwkv(tmp_path / "junk.pth", tmp_path / "out")
