"""`ltm generate --quantize int4 --quantize-group G`: the flags reach the quantiser, and bad choices are refused (one
line, exit 2, nothing on stdout)."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import api, cli
from ltm_jax import model as model_lib
from ltm_jax.inference.quantize import Int4Weight, Int8Weight
from ltm_jax.train import checkpoint as ckpt_lib

@functools.cache
def _sharpened() -> api.LanguageModel:
  """A micro model (d_model 32, MLP 128) whose head is scaled by 100: random init gives near-uniform logits, and
  greedy choices must not be decided by rounding. Initialised under jit (eager init compiles op by op)."""
  cfg = micro_config()
  params = jax.jit(model_lib.init_params, static_argnums=0)(cfg.model, jax.random.key(1))
  params["head"] = jax.tree.map(lambda w: w * 100.0, params["head"])
  return api.LanguageModel(cfg, params)


def test_generate_refuses_bad_quantization_choices(tmp_path, capsys, monkeypatch):
  """The workdir's model is the micro model (loading is not what is tested): a group that does not divide the MLP's
  fan-in of 128 is refused on one line naming the weight, as is a --quantize-keep-int8 name that matches no
  weight, and int3 and an empty name by argparse."""
  monkeypatch.setattr(api, "load", lambda *args, **kwargs: _sharpened())
  code = cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "Hi", "--quantize", "int4",
                   "--quantize-group", "48"])
  out = capsys.readouterr()
  assert code == 2 and out.out == "" and len(out.err.splitlines()) == 1
  assert out.err.startswith("error: cannot quantise block_0/") and "with group size 48: its fan-in 128" in out.err
  code = cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "Hi", "--quantize", "int4",
                   "--quantize-group", "8", "--quantize-keep-int8", "head,nope"])
  out = capsys.readouterr()
  assert code == 2 and out.out == "" and len(out.err.splitlines()) == 1
  assert out.err.startswith("error: keep_int8 name 'nope' matches no quantised weight; names: ")
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "Hi", "--quantize", "int3"])
  out = capsys.readouterr()
  assert exit_info.value.code == 2 and out.out == "" and "invalid choice: 'int3'" in out.err.splitlines()[-1]
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "Hi", "--quantize", "int4",
              "--quantize-keep-int8", "head,"])
  out = capsys.readouterr()
  assert exit_info.value.code == 2 and out.out == "" and "must be comma-separated names" in out.err.splitlines()[-1]


def test_generate_passes_the_group_and_the_int8_names_to_the_quantiser(tmp_path, capsys, monkeypatch):
  """--quantize int4 --quantize-group 8 --quantize-keep-int8 head: the model generate would decode with has an int8
  head and int4 kernels in groups of 8 (the run is stopped right after quantising)."""
  monkeypatch.setattr(api, "load", lambda *args, **kwargs: _sharpened())
  made = []
  original = api.LanguageModel.quantize

  def quantize_then_stop(self, *args):
    made.append(original(self, *args))
    raise ValueError("stopped after quantising")

  monkeypatch.setattr(api.LanguageModel, "quantize", quantize_then_stop)
  code = cli.main(["generate", "--workdir", str(tmp_path), "--prompt", "Hi", "--quantize", "int4",
                   "--quantize-group", "8", "--quantize-keep-int8", "head"])
  assert code == 2 and "stopped after quantising" in capsys.readouterr().err
  params = made[0].params
  assert isinstance(params["head"]["kernel"], Int8Weight)
  up = params["block_1"]["ffn"]["up"]["kernel"]
  assert isinstance(up, Int4Weight) and up.group_size == 8


@pytest.mark.parametrize("flags", [["--quantize", "int8", "--quantize-group", "48"], ["--quantize-group", "64"]])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_group_without_int4_is_refused_as_a_wrong_int4_group_is(tmp_path, capsys, monkeypatch, command, flags):
  """--quantize-group applies to int4 only: with int8 or without --quantize it is refused in one line, before the
  workdir is read, as --quantize-keep-int8 is."""
  monkeypatch.setattr(api, "load", lambda *args, **kwargs: pytest.fail("loaded a model"))
  code = cli.main([command, "--workdir", str(tmp_path), *flags])
  out = capsys.readouterr()
  assert code == 2 and out.out == ""
  assert out.err == "error: --quantize-group sets int4's inputs per scale; add --quantize int4\n"


def test_the_api_refuses_a_group_size_with_int8():
  with pytest.raises(ValueError, match="group_size sets int4's inputs per scale; it does not apply to int8"):
    _sharpened().quantize("int8", group_size=64)
  assert _sharpened().quantize("int4").params["block_1"]["ffn"]["up"]["kernel"].group_size == 128


def test_eval_measures_the_quantised_weights(tmp_path, capsys):
  """`ltm eval --quantize int4 --quantize-group 8` evaluates the int4 weights (their rounding costs bits per byte)
  and records the flags in eval-int4-g8.json; without --quantize, the float weights, with nothing recorded."""
  lm = _sharpened()
  ckpt_lib.save_params(tmp_path, lm.config, lm.params)
  results = []
  for flags, name in (([], "eval.json"), (["--quantize", "int4", "--quantize-group", "8"], "eval-int4-g8.json")):
    assert cli.main(["eval", "--workdir", str(tmp_path), "--batches", "1", *flags]) == 0, capsys.readouterr().err
    results.append(json.loads((tmp_path / name).read_text()))
  plain, int4 = results
  assert "quantize" not in plain
  assert (int4["quantize"], int4["quantize_group"], int4["quantize_keep_int8"]) == ("int4", 8, [])
  assert int4["tokens"] == plain["tokens"] and int4["val_bpb"] != pytest.approx(plain["val_bpb"], rel=1e-3)
  quantized = lm.quantize("int4", 8)
  leaf = quantized.float_params["block_1"]["ffn"]["up"]["kernel"]
  assert leaf.dtype == np.float32 and not np.allclose(leaf, lm.params["block_1"]["ffn"]["up"]["kernel"])
  assert lm.float_params is lm.params
