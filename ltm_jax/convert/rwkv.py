"""Official RWKV checkpoints (.pth) -> ltm_jax workdirs.

Two families are read: RWKV-7 "x070" (RWKV-LM's RWKV-v7, the `rwkv` package's RWKV_x070) and RWKV-4 ("Pile" /
"v4neo", also RWKV-4 World). The version is told from the key names, the model shape from the tensor shapes; the
weights are mapped onto the parameter tree of `ltm_jax.model.LM` and saved at step `step` with a fresh optimizer
state, so `ltm eval`, `ltm generate` and `ltm_jax.load` open the result like any trained workdir.

PyTorch is needed only here, to read the .pth file (`torch.load(..., weights_only=True)` on the CPU; no code in the
file is run). The official layout, per block i (`blocks.{i}.`), and where each tensor goes:

  both        ln1 -> mixer_norm, ln2 -> ffn_norm, blocks.0.ln0 -> embed_norm (model.ln0), ln_out -> final_norm,
              emb -> embed (rows padded to a multiple of 128), head [V, C] -> head.kernel [C, V] (padded)
              {att,ffn}.{receptance,key,value,output}.weight [out, in] -> .kernel [in, out]
  x070 att    x_r x_w x_k x_v x_a x_g -> shift_*;  w0 w1 w2 -> decay_base/_down/_up;  a0 a1 a2 -> iclr_*;
              v0 v1 v2 -> value_residual_* (absent in layer 0, which makes v_first);  g1 g2 -> gate_down/_up;
              k_k -> key_norm_scale;  k_a -> key_iclr_mix;  r_k [H, N] -> bonus [C];  ln_x -> out_norm_scale/_bias
  x070 ffn    x_k -> shift_k (no receptance in x070)
  RWKV-4 att  time_mix_k/v/r -> mix_k/v/r;  time_decay, time_first as they are (the layer takes -exp(time_decay))
  RWKV-4 ffn  time_mix_k/r -> mix_k/r
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any

import jax
import numpy as np

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.errors import LtmError

X070, RWKV4 = "x070", "rwkv4"
WORLD_VOCAB_SIZE = 65536


class ConversionError(LtmError):
  """A checkpoint that cannot be converted (unknown layout, missing tensors) or an output folder already in use."""


# ---------------------------------------------------------------------------------------------------------- reading


def read_checkpoint(path: str | pathlib.Path) -> dict[str, np.ndarray]:
  """The tensors of an official .pth file as float32 numpy arrays, keyed by their official names."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConversionError(f"checkpoint not found: {path}")
  try:
    import torch  # Optional: only conversion needs it.
  except ImportError:
    raise ConversionError("reading .pth checkpoints needs PyTorch; the CPU build is enough: pip install torch "
                          "--index-url https://download.pytorch.org/whl/cpu") from None
  try:
    try:
      state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # Files in the legacy (pre-zip) format cannot be memory-mapped.
      state = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # A truncated or foreign file is the user's input: one line.
    raise ConversionError(f"could not read {path} as a PyTorch checkpoint: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from e
  if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
    state = state["state_dict"]
  if not isinstance(state, dict) or not state:
    raise ConversionError(f"{path} does not hold a dictionary of tensors")
  weights = {}
  for name, tensor in state.items():
    if not isinstance(tensor, torch.Tensor):
      raise ConversionError(f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
    weights[name] = tensor.detach().to(torch.float32).numpy()
  return weights


def detect_version(weights: dict[str, np.ndarray]) -> str:
  """'x070' or 'rwkv4' from the key names; ConversionError names the family of anything else."""
  keys = set(weights)
  if "blocks.0.att.r_k" in keys and "blocks.0.att.x_r" in keys:
    return X070
  if any(k.endswith(("att.time_maa_x", "att.time_faaaa")) for k in keys):
    raise ConversionError("this is an RWKV-6 or RWKV-5 checkpoint; only RWKV-7 (x070) and RWKV-4 are supported")
  if any(".ln_x." in k for k in keys):
    raise ConversionError("this is an RWKV-5 checkpoint (it has ln_x); only RWKV-7 (x070) and RWKV-4 are supported")
  if "blocks.0.att.time_first" in keys and "blocks.0.att.time_mix_k" in keys:
    return RWKV4
  sample = ", ".join(sorted(keys)[:6])
  raise ConversionError(f"not an RWKV-7 (x070) or RWKV-4 checkpoint: no blocks.0.att.r_k or blocks.0.att.time_first "
                        f"(keys start {sample})")


def _need(weights, name: str) -> np.ndarray:
  if name not in weights:
    raise ConversionError(f"the checkpoint has no tensor {name!r}")
  return weights[name]


def _n_layers(weights) -> int:
  layers = {int(m.group(1)) for k in weights if (m := re.match(r"blocks\.(\d+)\.", k))}
  if not layers or layers != set(range(max(layers) + 1)):
    raise ConversionError(f"blocks are not numbered 0..n-1: {sorted(layers)[:10]}")
  return max(layers) + 1


# ----------------------------------------------------------------------------------------------------------- config


def model_config(weights: dict[str, np.ndarray], version: str) -> config_lib.ModelConfig:
  """The ModelConfig whose parameters have exactly the checkpoint's shapes."""
  vocab, d = _need(weights, "emb.weight").shape
  n_layers = _n_layers(weights)
  hidden, d_in = _need(weights, "blocks.0.ffn.key.weight").shape
  d_att = _need(weights, "blocks.0.att.key.weight").shape[0]
  if d_in != d or d_att != d:
    raise ConversionError(f"attention width {d_att} or FFN input {d_in} differs from the embedding width {d}; "
                          "ltm_jax's RWKV layers need them equal")
  if "head.weight" not in weights:
    raise ConversionError("the checkpoint has no head.weight (tied embeddings are not an official RWKV layout)")
  common = dict(vocab_size=int(vocab), d_model=int(d), n_layers=n_layers, mlp_dim=int(hidden), norm="layernorm",
                norm_eps=1e-5, tie_embeddings=False, ln0="blocks.0.ln0.weight" in weights, ffn="auto")
  if version == X070:
    heads, head_size = _need(weights, "blocks.0.att.r_k").shape
    if heads * head_size != d:
      raise ConversionError(f"r_k is [{heads}, {head_size}] but d_model is {d}")
    lora = lambda name, default: int(weights[name].shape[1]) if name in weights else default
    later = "blocks.1.att." if n_layers > 1 else "blocks.0.att."  # Layer 0's value-residual LoRA is unused.
    return config_lib.ModelConfig(
        **common, layer_pattern="W", n_heads=int(heads), rwkv7_head_size=int(head_size),
        rwkv7_decay_lora=lora("blocks.0.att.w1", None), rwkv7_iclr_lora=lora("blocks.0.att.a1", None),
        rwkv7_value_lora=lora(later + "v1", None), rwkv7_gate_lora=lora("blocks.0.att.g1", None))
  return config_lib.ModelConfig(**common, layer_pattern="R", n_heads=d // 64 if d % 64 == 0 else 1)


def full_config(model: config_lib.ModelConfig, version: str, tokenizer: str, name: str) -> config_lib.Config:
  if tokenizer == "auto":
    tokenizer = "rwkv_world" if model.vocab_size == WORLD_VOCAB_SIZE else "byte"
  data = config_lib.DataConfig(tokenizer=tokenizer)
  try:
    return config_lib.validate(config_lib.Config(name=name, model=model, data=data))
  except LtmError as e:
    raise ConversionError(f"the converted {version} model does not make a valid config: {e}") from e


# ----------------------------------------------------------------------------------------------------------- params


def _vector(x: np.ndarray) -> np.ndarray:
  return np.asarray(x, np.float32).reshape(-1)


def _kernel(x: np.ndarray) -> dict[str, np.ndarray]:
  return {"kernel": np.ascontiguousarray(np.asarray(x, np.float32).T)}


def _layernorm(weights, prefix: str) -> dict[str, np.ndarray]:
  return {"scale": _vector(_need(weights, prefix + ".weight")), "bias": _vector(_need(weights, prefix + ".bias"))}


def _x070_block(weights, i: int) -> dict[str, Any]:
  att = lambda name: _need(weights, f"blocks.{i}.att.{name}")
  mixer = {f"shift_{c}": _vector(att(f"x_{c}")) for c in "rwkvag"}
  mixer.update({name: _kernel(att(f"{name}.weight")) for name in ("receptance", "key", "value", "output")})
  lora = {"decay": "w", "iclr": "a", "gate": "g"} | ({"value_residual": "v"} if i > 0 else {})
  for ours, theirs in lora.items():
    mixer[f"{ours}_down"] = np.asarray(att(f"{theirs}1"), np.float32)
    mixer[f"{ours}_up"] = np.asarray(att(f"{theirs}2"), np.float32)
    if theirs != "g":
      mixer[f"{ours}_base"] = _vector(att(f"{theirs}0"))
  mixer.update(key_norm_scale=_vector(att("k_k")), key_iclr_mix=_vector(att("k_a")), bonus=_vector(att("r_k")),
               out_norm_scale=_vector(att("ln_x.weight")), out_norm_bias=_vector(att("ln_x.bias")))
  ffn = {"shift_k": _vector(_need(weights, f"blocks.{i}.ffn.x_k")),
         "key": _kernel(_need(weights, f"blocks.{i}.ffn.key.weight")),
         "value": _kernel(_need(weights, f"blocks.{i}.ffn.value.weight"))}
  return {"mixer": mixer, "ffn": ffn}


def _rwkv4_block(weights, i: int) -> dict[str, Any]:
  att = lambda name: _need(weights, f"blocks.{i}.att.{name}")
  ffn = lambda name: _need(weights, f"blocks.{i}.ffn.{name}")
  mixer = {f"mix_{c}": _vector(att(f"time_mix_{c}")) for c in "kvr"}
  mixer.update(time_decay=_vector(att("time_decay")), time_first=_vector(att("time_first")))
  mixer.update({name: _kernel(att(f"{name}.weight")) for name in ("key", "value", "receptance", "output")})
  channel = {f"mix_{c}": _vector(ffn(f"time_mix_{c}")) for c in "kr"}
  channel.update({name: _kernel(ffn(f"{name}.weight")) for name in ("key", "value", "receptance")})
  return {"mixer": mixer, "ffn": channel}


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)]) if rows > x.shape[0] else x


class _Tracked(dict):
  """A dict that remembers which keys were read, so tensors no mapping reads are reported instead of dropped."""

  def __init__(self, *args):
    super().__init__(*args)
    self.read: set[str] = set()

  def __getitem__(self, key):
    self.read.add(key)
    return super().__getitem__(key)


def to_params(weights: dict[str, np.ndarray], version: str, model: config_lib.ModelConfig) -> dict[str, Any]:
  """The parameter tree of `LM(model)` (float32 numpy), checked leaf by leaf against the model's own shapes.

  Every tensor of the checkpoint must be used: an unknown extra (another variant, e.g. DeepEmbed's ffn.s_emb) would
  change the official model's output, so it is refused rather than silently dropped."""
  weights = _Tracked(weights)
  block = _x070_block if version == X070 else _rwkv4_block
  padded = model.padded_vocab_size
  params: dict[str, Any] = {"embed": {"embedding": _pad_rows(np.asarray(weights["emb.weight"], np.float32), padded)}}
  if model.ln0:
    params["embed_norm"] = _layernorm(weights, "blocks.0.ln0")
  for i in range(model.n_layers):
    params[f"block_{i}"] = {"mixer_norm": _layernorm(weights, f"blocks.{i}.ln1"),
                            "ffn_norm": _layernorm(weights, f"blocks.{i}.ln2"), **block(weights, i)}
  params["final_norm"] = _layernorm(weights, "ln_out")
  params["head"] = {"kernel": _pad_rows(np.asarray(weights["head.weight"], np.float32), padded).T.copy()}
  unused_by_official = {f"blocks.0.att.v{j}" for j in range(3)} if version == X070 else set()
  unused = sorted(set(weights) - weights.read - unused_by_official)
  if unused:
    raise ConversionError(f"the checkpoint has tensors that no {version} mapping reads (another variant?): "
                          f"{', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''}")
  _check_against_model(params, model)
  return params


def _check_against_model(params, model: config_lib.ModelConfig) -> None:
  expected = jax.eval_shape(lambda: model_lib.init_params(model, jax.random.key(0)))
  want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
  have = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
  wrong = [f"{k}: checkpoint {have[k]}, model {want[k]}" for k in sorted(set(want) & set(have)) if have[k] != want[k]]
  if missing or extra or wrong:
    raise ConversionError("the mapped weights do not fit the model: "
                          + "; ".join(filter(None, [missing and f"missing {missing[:4]}",
                                                    extra and f"unexpected {extra[:4]}", wrong and wrong[0]])))


# ---------------------------------------------------------------------------------------------------------- writing


def _check_out(out: pathlib.Path) -> None:
  if (out / "config.json").exists() or ((out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())):
    raise ConversionError(f"{out} already holds a workdir; convert into a new folder")
  if out.exists() and not out.is_dir():
    raise ConversionError(f"{out} exists and is not a folder")


def convert_rwkv(checkpoint: str | pathlib.Path, out: str | pathlib.Path, *, step: int = 0, tokenizer: str = "auto",
                 name: str | None = None) -> config_lib.Config:
  """Converts an official RWKV-7 (x070) or RWKV-4 .pth file into a workdir at `out` and returns its Config.

  tokenizer: "auto" (the RWKV World tokenizer for 65,536-id vocabularies, else "byte", with which a larger
  vocabulary is used through token ids), "rwkv_world" or "byte". Nothing is written when anything is refused.
  """
  from ltm_jax.train import checkpoint as ckpt_lib  # Imported here: orbax is slow to import.

  out, checkpoint = pathlib.Path(out), pathlib.Path(checkpoint)
  if step < 0:
    raise ConversionError(f"step must be >= 0, got {step}")
  if tokenizer not in ("auto", *config_lib.TOKENIZERS):
    raise ConversionError(f"tokenizer {tokenizer!r} is not one of auto, {', '.join(config_lib.TOKENIZERS)}")
  _check_out(out)
  weights = read_checkpoint(checkpoint)
  version = detect_version(weights)
  cfg = full_config(model_config(weights, version), version, tokenizer,
                    name or f"rwkv-{version}-{checkpoint.stem}")
  params = jax.tree.map(jax.numpy.asarray, to_params(weights, version, cfg.model))
  del weights
  # No data-stream position: a converted model has not been trained here.
  ckpt_lib.save_params(out, cfg, params, step=step,
                       data_state={"converted_from": str(checkpoint.absolute()), "version": version})
  (out / "conversion.json").write_text(json.dumps(
      {"checkpoint": str(checkpoint.absolute()), "version": version, "step": step,
       "model": dataclasses.asdict(cfg.model), "tokenizer": cfg.data.tokenizer}, indent=2) + "\n")
  return cfg
