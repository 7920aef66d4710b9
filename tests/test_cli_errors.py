"""The `ltm` command's refusals: one line `error: ...` (or argparse's usage and error) with exit status 2, before
anything is printed or written."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import ROOT, micro_config
from ltm_jax import cli
from ltm_jax import model as model_lib
from ltm_jax.train import checkpoint as ckpt_lib

TINY = str(ROOT / "configs" / "tiny.py")


def _run(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def _fails(capsys, *argv, match: str) -> str:
  code, out, err = _run(capsys, *argv)
  assert code == 2 and out == "", (out, err)
  assert len(err.splitlines()) == 1 and err.startswith("error: ") and match in err, err
  return err


def _argparse_fails(capsys, *argv, match: str) -> None:
  with pytest.raises(SystemExit) as exit_info:
    cli.main([str(a) for a in argv])
  out = capsys.readouterr()
  assert exit_info.value.code == 2 and out.out == ""
  assert out.err.startswith("usage: ") and out.err.splitlines()[-1].endswith(match), out.err


def _snapshot(folder) -> dict:
  return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_workdir_that_is_a_file_is_refused(tmp_path, capsys):
  path = tmp_path / "notes.txt"
  path.write_text("keep me")
  for command in (["train", "--config", TINY], ["eval"], ["generate", "--prompt", "a"]):
    _fails(capsys, *command, "--workdir", path, match=f"error: --workdir {path} is a file, not a directory")
  assert _snapshot(tmp_path) == {path: b"keep me"}
  _fails(capsys, "train", "--config", TINY, "--workdir", path / "run",
         match=f"error: cannot create {path / 'run'}: Not a directory")
  assert _snapshot(tmp_path) == {path: b"keep me"}


def test_a_config_file_that_fails_is_named_on_one_line(tmp_path, capsys):
  raising = tmp_path / "raising.py"
  raising.write_text("def get_config():\n  raise KeyError('no size called huge')\n")
  broken = tmp_path / "broken.py"
  broken.write_text("raise RuntimeError('first line\\nsecond line')\n")
  for command in (["info"], ["train", "--workdir", tmp_path / "w"]):
    _fails(capsys, *command, "--config", raising,
           match=f"get_config() in {raising} raised KeyError: 'no size called huge'")
    err = _fails(capsys, *command, "--config", broken, match=f"could not execute config file {broken}")
    assert err.endswith("RuntimeError: first line\n")
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("seed", [2**70, 2**63, -2**63 - 1])
def test_seeds_jax_cannot_take_are_refused_by_argparse(tmp_path, capsys, seed):
  _argparse_fails(capsys, "generate", "--workdir", tmp_path, "--seed", seed,
                  match=f"argument --seed: must be in [-2**63, 2**63), got {seed}")


def test_seeds_jax_takes_are_accepted():
  for seed in (0, -1, -2**63, 2**63 - 1):
    assert cli.parser().parse_args(["generate", "--workdir", "w", "--seed", str(seed)]).seed == seed


@pytest.mark.parametrize("option, value, match", [
    ("--temperature", "nan", "argument --temperature: must be a finite number >= 0, got nan"),
    ("--temperature", "inf", "argument --temperature: must be a finite number >= 0, got inf"),
    ("--temperature", "-1", "argument --temperature: must be a finite number >= 0, got -1.0"),
    ("--top-p", "nan", "argument --top-p: must be in (0, 1], got nan"),
    ("--top-p", "inf", "argument --top-p: must be in (0, 1], got inf"),
])
def test_non_finite_sampling_options_are_refused_by_argparse(tmp_path, capsys, option, value, match):
  _argparse_fails(capsys, "generate", "--workdir", tmp_path, option, value, match=match)


@pytest.fixture(scope="module")
def foreign_vocabulary(tmp_path_factory):
  """A workdir whose model reads 300 ids but whose config names the byte tokenizer (259 ids), as a converted RWKV-4
  model with its 50,277-id vocabulary does: its ids are another tokenizer's."""
  path = tmp_path_factory.mktemp("foreign")
  cfg = micro_config(vocab_size=300)
  params = model_lib.init_params(cfg.model, jax.random.key(0))
  ckpt_lib.save_params(path, cfg, params)
  return path


def test_eval_refuses_text_the_model_cannot_read_but_reads_its_token_ids(foreign_vocabulary, tmp_path, capsys):
  before = _snapshot(foreign_vocabulary)
  _fails(capsys, "eval", "--workdir", foreign_vocabulary,
         match="the model's vocabulary (300 ids) is not the byte tokenizer's (259 ids), so it cannot read the text "
               "of data.source='embedded'")
  text = tmp_path / "corpus.txt"
  text.write_text("some text " * 100)
  _fails(capsys, "eval", "--workdir", foreign_vocabulary, f"data.source={text}", match="cannot read the text")
  assert _snapshot(foreign_vocabulary) == before  # No eval.json.

  tokens = tmp_path / "tokens.bin"
  ids = np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16)
  ids[-10] = 299  # The model's last id, which no byte-level text holds.
  ids.tofile(tokens)
  code, out, _ = _run(capsys, "eval", "--workdir", foreign_vocabulary, "--batches", 1, "--batch-size", 1,
                      f"data.source={tokens}")
  written = out.splitlines()[-1].removeprefix("wrote ")
  assert code == 0 and written.startswith(str(foreign_vocabulary / "eval-data.source="))
  assert np.isfinite(json.loads(open(written).read())["val_loss"])


def test_generate_refuses_before_printing_anything(foreign_vocabulary, capsys):
  message = "the model's vocabulary (300 ids) is larger than the byte tokenizer's (259)"
  _fails(capsys, "generate", "--workdir", foreign_vocabulary, "--prompt", "Hello", match=message)
  _fails(capsys, "generate", "--workdir", foreign_vocabulary, "--prompt", "Hello", "--quantize", "int8", match=message)
  _fails(capsys, "generate", "--workdir", foreign_vocabulary, "--prompt", "a", "--prompt", "b", match=message)


def test_keep_int8_without_int4_is_refused_before_loading(tmp_path, capsys):
  for command in (["generate", "--prompt", "a"], ["serve", "--port", "0"]):
    for quantize in ([], ["--quantize", "int8"]):
      _fails(capsys, *command, "--workdir", tmp_path / "absent", *quantize, "--quantize-keep-int8", "head",
             match="--quantize-keep-int8 keeps some int4 weights at int8; add --quantize int4")


def test_build_corpus_refuses_a_missing_package_and_an_occupied_folder(tmp_path, capsys):
  _fails(capsys, "build-corpus", "--out", tmp_path / "corpus", "no-such-package-xyz", match="'no-such-package-xyz'")
  assert not (tmp_path / "corpus").exists()
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "mine.txt").write_text("keep me")
  _fails(capsys, "build-corpus", "--out", tmp_path / "busy", "absl-py", match="not empty")
  assert [p.name for p in (tmp_path / "busy").iterdir()] == ["mine.txt"]
  _argparse_fails(capsys, "eval", "--workdir", tmp_path, "--curve-batches", "-1", match="must be >= 0, got -1")
