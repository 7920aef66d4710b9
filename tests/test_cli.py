"""The `ltm` command: a full train -> eval -> generate -> info round, and one-line errors for bad input."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
import pytest

from conftest import ROOT
from ltm_jax import cli
from ltm_jax.api import load
from ltm_jax.errors import CheckpointError
from ltm_jax.train import checkpoint as ckpt_lib

TINY = str(ROOT / "configs" / "tiny.py")
# The tiny config shrunk so the round trip compiles and runs in seconds.
SMALL = ["model.d_model=32", "model.n_layers=2", "train.batch_size=4", "train.seq_len=32", "train.eval_batches=2",
         "train.log_every=5", "data.worker_threads=1"]


def _run(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("cli")
  code = cli.main(["train", "--config", TINY, "--workdir", str(path), *SMALL, "train.steps=10",
                   "train.eval_every=5", "train.checkpoint_every=5"])
  assert code == 0
  return path


def test_train_resumes_where_it_stopped(workdir, capsys):
  code, out, _ = _run(capsys, "train", "--config", TINY, "--workdir", workdir, *SMALL, "train.steps=15",
                      "train.eval_every=5", "train.checkpoint_every=5")
  assert code == 0 and "resuming from step 10" in out
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [5, 10, 15]
  assert out.splitlines()[-1].startswith("done: step 15 in ") and "; val_loss " in out.splitlines()[-1]
  # Run again: nothing to train, no metrics to list after the time.
  code, out, _ = _run(capsys, "train", "--config", TINY, "--workdir", workdir, *SMALL, "train.steps=15",
                      "train.eval_every=5", "train.checkpoint_every=5")
  assert code == 0 and re.fullmatch(r"done: step 15 in \d+s", out.splitlines()[-1]), out


def test_train_resumes_from_the_workdirs_own_config_with_overrides_on_top(workdir, tmp_path, capsys):
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  steps = json.loads((copy / "config.json").read_text())["train"]["steps"]
  code, out, _ = _run(capsys, "train", "--workdir", copy, f"train.steps={steps + 5}")
  assert code == 0 and f"resuming from step {steps}" in out and f"done: step {steps + 5} in " in out
  assert json.loads((copy / "config.json").read_text())["train"]["steps"] == steps + 5
  code, out, _ = _run(capsys, "train", "--workdir", copy)  # The extended length holds without repeating it.
  assert code == 0 and out.splitlines()[-1].startswith(f"done: step {steps + 5} in ")
  before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
  _fails(capsys, "train", "--workdir", copy, "train.steps=100", "model.d_model=64",
         match=f"error: model.d_model=64 would change the model trained in {copy} (model.d_model=32); train a new "
               "model in another workdir (with --config)")
  assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before
  _fails(capsys, "train", "--workdir", tmp_path / "new", "train.steps=5",
         match=f"error: --config is required: {tmp_path / 'new'} holds no config.json to resume from")
  assert not (tmp_path / "new").exists()


def test_eval_writes_eval_json(workdir, capsys):
  code, out, _ = _run(capsys, "eval", "--workdir", workdir, "--batches", 3)
  assert code == 0
  result = json.loads((workdir / "eval.json").read_text())
  assert result["step"] == load(workdir).trained_steps and 0 < result["val_bpb"] < 9
  assert result["tokens"] == 3 * 4 * 32 and result["kl"] == 0 and result["elbo_ppl_is_upper_bound"] is False
  assert "val_bpb" in out


def test_eval_results_are_keyed_by_what_was_evaluated(workdir, tmp_path, capsys):
  """eval.json is the newest checkpoint as trained; another step, overrides, quantisation or a fallback from a damaged
  newest checkpoint each get their own file, and --out names one."""
  copy = tmp_path / "copy"
  shutil.copytree(workdir, copy)
  kept = ckpt_lib.Checkpointer(copy, read_only=True).all_steps()
  newest, older = kept[-1], kept[-2]

  def evaluate(*argv) -> pathlib.Path:
    code, out, err = _run(capsys, "eval", "--workdir", copy, "--batches", 1, *argv)
    assert code == 0, err
    return pathlib.Path(out.splitlines()[-1].removeprefix("wrote "))

  assert evaluate() == copy / "eval.json"
  newest_result = (copy / "eval.json").read_bytes()
  assert json.loads(newest_result)["step"] == newest
  assert evaluate("--step", older) == copy / f"eval-step{older}.json"
  assert evaluate("--step", newest, "train.seq_len=16", "--quantize", "int8") == copy / "eval-int8-train.seq_len=16.json"
  assert json.loads((copy / "eval-int8-train.seq_len=16.json").read_text())["overrides"] == ["train.seq_len=16"]
  state = copy / "checkpoints" / str(newest) / "state"
  largest = max((f for f in state.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:10])
  assert evaluate() == copy / f"eval-step{older}.json"  # The fallback: beside the newest one's result, not over it.
  assert (copy / "eval.json").read_bytes() == newest_result
  assert evaluate("--out", tmp_path / "mine.json") == tmp_path / "mine.json"
  before = sorted(tmp_path.rglob("*"))
  _fails(capsys, "eval", "--workdir", copy, "--out", tmp_path / "absent" / "x.json",
         match=f"error: --out {tmp_path / 'absent' / 'x.json'}: the folder {tmp_path / 'absent'} does not exist")
  assert sorted(tmp_path.rglob("*")) == before


def test_generate_prints_prompt_and_continuation(workdir, capsys):
  code, out, _ = _run(capsys, "generate", "--workdir", workdir, "--prompt", "The ", "--max-new-tokens", 20,
                      "--temperature", 0.8, "--top-k", 40, "--top-p", 0.95, "--seed", 3)
  assert code == 0 and out.startswith("The ")
  # The streamed pieces make up exactly the API's text for the same seed.
  text = load(workdir).generate("The ", 20, temperature=0.8, top_k=40, top_p=0.95, seed=3)
  assert out == "The " + text + "\n"


def test_generate_batches_prompts_and_quantizes(workdir, capsys):
  code, out, err = _run(capsys, "generate", "--workdir", workdir, "--prompt", "The list", "--prompt", "a",
                        "--max-new-tokens", 8, "--quantize", "int8", "--temperature", 0)
  assert code == 0 and "--- 0\nThe list" in out and "--- 1\na" in out
  assert "int8 weights: parameters" in err


def test_info_reports_size_flops_memory(capsys):
  code, out, _ = _run(capsys, "info", "--config", TINY, "--json", "model.d_model=64")
  info = json.loads(out)
  assert code == 0 and info["params"] > 0 and info["flops_per_token_train"] == 3 * info["flops_per_token_forward"]
  assert info["memory_bytes_estimate"] > info["train_state_bytes"] == 16 * info["params"]
  assert "parameters" in _run(capsys, "info", "--config", TINY)[1]


def _fails(capsys, *argv, match: str) -> str:
  code, out, err = _run(capsys, *argv)
  assert code == 2, (out, err)
  assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and match in err, err
  return err


def test_bad_input_gives_one_line_errors(capsys, tmp_path):
  _fails(capsys, "info", "--config", TINY, "model.d_modle=64", match="did you mean model.d_model")
  _fails(capsys, "info", "--config", TINY, "model.d_model=abc", match="expects int")
  _fails(capsys, "info", "--config", TINY, "model.n_heads=5", match="not divisible by model.n_heads=5")
  _fails(capsys, "info", "--config", TINY, "model.layer_pattern=RQ", match="unknown letter(s) 'Q'")
  _fails(capsys, "info", "--config", tmp_path / "missing.py", match="config file not found")
  _fails(capsys, "train", "--config", TINY, "--workdir", tmp_path / "w", "data.source=" + str(tmp_path / "none.txt"),
         match="none.txt")
  (tmp_path / "empty.txt").write_text("")
  _fails(capsys, "train", "--config", TINY, "--workdir", tmp_path / "w", "data.source=" + str(tmp_path / "empty.txt"),
         match="empty")
  tokens = np.random.default_rng(0).integers(0, 259, 5000).astype(np.uint16)
  tokens[4321] = 300
  tokens.tofile(tmp_path / "tokens.bin")
  _fails(capsys, "train", "--config", TINY, "--workdir", tmp_path / "w", "data.source=" + str(tmp_path / "tokens.bin"),
         match="4,321")
  ltm_window = ROOT / "configs" / "ltm_window.py"
  _fails(capsys, "train", "--config", ltm_window, "--workdir", tmp_path / "w", "model.window=0",
         match="model.window must be positive")
  _fails(capsys, "train", "--config", ltm_window, "--workdir", tmp_path / "w", "model.window=600",
         match="model.window=600 is longer than train.seq_len=512")
  _fails(capsys, "train", "--config", ltm_window, "--workdir", tmp_path / "w", "latent.decoder_objective=mean",
         match="latent.decoder_objective='mean' is not one of final, iterates")
  assert not (tmp_path / "w").exists()  # Bad data and configs fail before the workdir is created.
  _fails(capsys, "eval", "--workdir", tmp_path, match="not an ltm_jax workdir")
  _fails(capsys, "generate", "--workdir", tmp_path, match="not an ltm_jax workdir")


def test_load_accepts_runtime_overrides_only(workdir):
  lm = load(workdir, overrides=["model.wkv_impl=associative", "model.dtype=bfloat16"])
  assert lm.config.model.wkv_impl == "associative"
  with pytest.raises(CheckpointError, match="model.d_model"):
    load(workdir, overrides=["model.d_model=64"])


def test_mismatched_model_is_refused_without_changes(workdir, capsys):
  before = {p: p.stat().st_mtime_ns for p in pathlib.Path(workdir).rglob("*")}
  _fails(capsys, "train", "--config", TINY, "--workdir", workdir, *SMALL, "model.d_model=64",
         match="model.d_model: checkpoint 32, config 64")
  assert {p: p.stat().st_mtime_ns for p in pathlib.Path(workdir).rglob("*")} == before


def test_a_default_written_out_is_no_model_change():
  """n_kv_heads, mlp_dim and the RWKV-7 LoRA widths default to None, which stands for a size: that size given
  explicitly reads the same checkpoint; another size does not."""
  from ltm_jax import config as config_lib
  shape = ["model.d_model=64", "model.n_heads=4", "model.rwkv7_head_size=16", "model.layer_pattern=AW"]
  load_cfg = lambda *o: config_lib.load_config(TINY, [*SMALL, *shape, *o])
  saved = load_cfg()
  lora = saved.model.rwkv7_lora_dims()
  same = load_cfg("model.n_kv_heads=4", f"model.rwkv7_decay_lora={lora['decay']}",
                  f"model.rwkv7_gate_lora={lora['gate']}")
  assert ckpt_lib.model_differences(saved, same) == []
  other = load_cfg("model.n_kv_heads=2", f"model.rwkv7_value_lora={lora['value'] + 32}")
  assert [key for key, _, _ in ckpt_lib.model_differences(saved, other)] == ["model.n_kv_heads",
                                                                             "model.rwkv7_value_lora"]
  # mlp_dim=None is 4 d_model (256) for the RWKV-7 layer's channel mix and 8/3 d_model rounded up to 64 (192) for
  # attention's SwiGLU here, so no one width equals it; in an attention-only model 192 does.
  assert [k for k, _, _ in ckpt_lib.model_differences(saved, load_cfg("model.mlp_dim=256"))] == ["model.mlp_dim"]
  attention = load_cfg("model.layer_pattern=A")
  width = attention.model.ffn_dim("swiglu")
  assert ckpt_lib.model_differences(attention, load_cfg("model.layer_pattern=A", f"model.mlp_dim={width}")) == []
