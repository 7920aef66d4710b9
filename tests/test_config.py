"""Config files, overrides and validation."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import ROOT
from ltm_jax import config as config_lib
from ltm_jax.errors import ConfigError


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")))
def test_shipped_configs_load_and_round_trip(name):
  cfg = config_lib.load_config(ROOT / "configs" / f"{name}.py")
  assert cfg.name == name
  assert config_lib.from_dict(cfg.to_dict()) == cfg


def test_overrides_parse_by_annotated_type():
  cfg = config_lib.apply_overrides(config_lib.Config(), [
      "model.d_model=256", "train.lr=1e-3", "model.tie_embeddings=true", "model.window=none", "model.window=64",
      "model.n_kv_heads=2", "model.layer_pattern=RRA", "name=x", "train.steps=1_000"])
  assert (cfg.model.d_model, cfg.train.lr, cfg.model.tie_embeddings) == (256, 1e-3, True)
  assert (cfg.model.window, cfg.model.n_kv_heads, cfg.model.layer_pattern) == (64, 2, "RRA")
  assert (cfg.name, cfg.train.steps) == ("x", 1000)
  assert config_lib.apply_overrides(cfg, ["model.window=null"]).model.window is None


def test_overrides_never_evaluate():
  with pytest.raises(ConfigError, match="expects int"):
    config_lib.apply_overrides(config_lib.Config(), ["model.d_model=__import__('os').getpid()"])
  cfg = config_lib.apply_overrides(config_lib.Config(), ["data.source=__import__('os')"])
  assert cfg.data.source == "__import__('os')"  # Strings stay strings.


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=3", r"unknown config key 'model.d_modle'; did you mean model.d_model"),
    ("train.setps=3", r"did you mean train.steps"),
    ("steps=3", r"did you mean train.steps"),
    ("model.d_model=12.5", r"'model.d_model' expects int, got '12.5'"),
    ("model.tie_embeddings=maybe", r"expects bool"),
    ("model.d_model", r"not of the form key=value"),
    ("train.lr=inf", r"'train.lr' expects float, got 'inf'"),
    ("train.lr=nan", r"expects float"),
])
def test_bad_overrides_name_the_problem(override, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.apply_overrides(config_lib.Config(), [override])


@pytest.mark.parametrize("overrides, message", [
    (["model.d_model=100", "model.n_heads=3"], r"d_model=100 is not divisible by model.n_heads=3"),
    (["model.layer_pattern=RAX"], r"unknown letter\(s\) 'X'"),
    (["model.n_kv_heads=3"], r"n_heads=4 is not divisible by model.n_kv_heads=3"),
    (["model.n_layers=3", "model.layer_pattern=RA"], r"not a multiple of len\(model.layer_pattern\)"),
    (["train.batch_size=10", "train.grad_accum=4"], r"batch_size=10 is not divisible by train.grad_accum=4"),
    (["model.vocab_size=100"], r"smaller than the byte tokenizer"),
    (["model.dtype=float64"], r"model.dtype='float64' is not one of"),
    (["train.lr=-1"], r"train.lr must be positive"),
    (["model.n_kv_heads=0"], r"not divisible by model.n_kv_heads=0"),
    (["train.seq_len=4096"], r"exceeds model.max_seq_len"),
    (["timeseries.enabled=true", "timeseries.source=x.npz", "latent.enabled=true"],
     r"a time-series model has none: set latent.enabled=false"),
    (["model.dtype=float16", "model.fp8=true"], r"use model.dtype=bfloat16 with model.fp8"),
    (["prior.seed=-1"], r"prior.seed must be in \[0, 2\*\*32\) \(grain's shuffle takes no other\), got -1"),
    ([f"train.seed={2**32}"], r"train.seed must be in \[0, 2\*\*32\) \(jax's 32-bit keys repeat larger seeds\)"),
    (["model.memory_chunk=0"], r"model.memory_chunk must be >= 1, got 0"),
    (["model.memory_depth=0"], r"model.memory_depth must be >= 1, got 0"),
    (["model.memory_max_lr=1.5"], r"model.memory_max_lr must be in \(0, 1\], got 1.5"),
    (["model.memory_impl=pallas"], r"model.memory_impl='pallas' is not one of auto, scan, chunked"),
    (["model.layer_pattern=G", "model.d_model=12", "model.n_heads=4"], r"d_model/n_heads=3 must be even for RoPE"),
    (["data.markov_symbols=1"], r"data.markov_symbols must be in \[2, 62\], got 1"),
    (["data.markov_symbols=63"], r"data.markov_symbols must be in \[2, 62\], got 63"),
    (["data.markov_concentration=0"], r"data.markov_concentration must be positive, got 0.0"),
    (["data.source=markov", "data.tokenizer=rwkv_world", "model.vocab_size=65536"], r"set data.tokenizer=byte"),
])
def test_validation_rejects_inconsistent_values(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(config_lib.apply_overrides(config_lib.Config(), overrides))


def test_validation_checks_types_of_python_values():
  bad = dataclasses.replace(config_lib.Config(), model=dataclasses.replace(config_lib.ModelConfig(), d_model="128"))
  with pytest.raises(ConfigError, match="'model.d_model' expects int"):
    config_lib.validate(bad)


def test_from_dict_rejects_unknown_keys():
  d = config_lib.Config().to_dict()
  d["model"]["d_modl"] = 3
  with pytest.raises(ConfigError, match="unknown config key 'model.d_modl'"):
    config_lib.from_dict(d)


def test_config_file_errors(tmp_path):
  with pytest.raises(ConfigError, match="config file not found"):
    config_lib.load_config(tmp_path / "nope.py")
  (tmp_path / "empty.py").write_text("x = 1\n")
  with pytest.raises(ConfigError, match="does not define get_config"):
    config_lib.load_config(tmp_path / "empty.py")
  (tmp_path / "broken.py").write_text("def get_config(:\n")
  with pytest.raises(ConfigError, match="could not execute config file"):
    config_lib.load_config(tmp_path / "broken.py")


def test_model_derived_sizes():
  m = config_lib.ModelConfig(vocab_size=259, d_model=96, n_layers=6, n_heads=6, layer_pattern="RRA")
  assert m.padded_vocab_size == 384 and m.head_dim == 16 and m.kv_heads == 6
  assert m.mixers == ("rwkv4", "rwkv4", "attention") * 2
  assert m.ffn_kind("rwkv4") == "channel_mix" and m.ffn_kind("attention") == "swiglu"
  assert m.ffn_dim("channel_mix") == 384 and m.ffn_dim("swiglu") % 64 == 0 and m.ffn_dim("swiglu") >= 8 * 96 / 3
