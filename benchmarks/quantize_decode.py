"""Quantised weights for decoding: how far int4 moves the logits and what reduces it, and the decode program's memory.

  python benchmarks/quantize_decode.py           # the decode benchmark's RWKV-7 and attention models: 21 minutes on 2 loaded cores
  python benchmarks/quantize_decode.py --quick   # tiny sizes: proves the script end to end

The models are `benchmarks/decode.py`'s (vocabulary 65,536, d_model 512, 8 layers: ~93M parameters, untied head),
randomly initialised. Sections (the JSON tags each row with `section`):
  drift   logits of one random prompt (`prompt` tokens, forward pass) with quantised weights against float32: int8;
          int4 in groups of 128 / 64 / 32; int4 with `keep_int8` names stored as int8 (the head; the plan's most
          sensitive projections; both, with groups of 32); and, to find the sensitive ones, one class of weights at
          int4 and every other weight float32 (not for RWKV-7's initial weights, where only the head can move). Per row: drift_rel = max |logit - float32 logit| / max |float32 logit|
          (the decode benchmark's logit_drift_rel), rms_rel = RMS of the difference / the float32 logits' standard
          deviation, kl = mean over positions of KL(float32 || quantised) of the next-token distributions (nats),
          top1 = the share of positions whose argmax agrees, param_bytes. RWKV-7's output projections, FFN value and
          LoRA downs are zero at initialisation, so its blocks add nothing to the residual stream and only the head
          moves its logits; the "filled" rows give every all-zero weight matrix normal(0, init_std / sqrt(2 n_layers))
          entries (the attention output projection's init), so the blocks contribute.
  memory  `generation.decode` (the same call as decode.py's loops, batch 1, `steps` tokens after a `prompt`-token
          prefill) compiled for float32, int8 and int4 weights dequantised ahead of the loop (the CPU default) and
          int8 / int4 kernels read as stored (the GPU default): XLA's memory_analysis of the compiled program:
          argument bytes (weights + decoding state), temporaries (the float copies of dequantised weights live
          here), outputs, bytes aliased (the donated state), and peak_bytes = arguments + temporaries + outputs -
          aliased, the program's footprint while it runs.

Writes benchmarks/results/quantize-decode-<device>.json (quantize-decode-quick-<device>.json with --quick).
"""

from __future__ import annotations

import argparse
import os
import time

import common  # First: puts the checkout on sys.path.
import decode as decode_bench
import jax
import jax.numpy as jnp
import numpy as np

import ltm_jax
from ltm_jax import model as model_lib

PLANS = {
    "cpu": dict(decode_plan="cpu", prompt=128, steps=64, group=128, groups=(128, 64, 32), small_group=32),
    "quick": dict(decode_plan="quick", prompt=16, steps=8, group=32, groups=(32, 16), small_group=16),
}
# The weights kept at int8 beyond the head, per model (path components, as keep_int8 reads them), and the classes
# of weights put alone at int4 (name: path components any of which selects a weight).
SENSITIVE = {"attention": ("v", "out"), "rwkv7": ("value", "output")}
CLASSES = {
    "attention": {"head": ("head",), "q, k": ("q", "k"), "v, out": ("v", "out"), "ffn": ("ffn",)},
    "rwkv7": {"head": ("head",), "mixer key, value, receptance, output": ("key", "value", "receptance", "output"),
              "mixer LoRAs": ("decay_down", "decay_up", "gate_down", "gate_up", "iclr_down", "iclr_up",
                              "value_residual_down", "value_residual_up"), "ffn": ("ffn",)},
}
DRIFT_COLUMNS = ("model", "weights", "variant", "drift_rel", "rms_rel", "kl", "top1", "param_bytes")
MEMORY_COLUMNS = ("model", "variant", "param_bytes", "argument_bytes", "temp_bytes", "output_bytes", "alias_bytes",
                  "peak_bytes", "compile_s")


def _name(path) -> str:
  return "/".join(str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path)


def filled(lm: ltm_jax.LanguageModel, seed: int = 3) -> ltm_jax.LanguageModel:
  """`lm` with every all-zero weight matrix (2 or more non-layer axes) drawn from normal(0, out_std)."""
  m = lm.config.model
  std = m.init_std / np.sqrt(2 * m.n_layers)
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(lm.params))))

  def fill(path, leaf):
    key = next(keys)
    if leaf.ndim - model_lib.is_stacked(path) < 2 or bool(jnp.any(leaf != 0)):
      return leaf
    return std * jax.random.normal(key, leaf.shape, leaf.dtype)

  return ltm_jax.LanguageModel(lm.config, jax.tree_util.tree_map_with_path(fill, lm.params))


def only(base, quantized, names: tuple[str, ...]):
  """`base`'s leaves, except those of `quantized` whose path has a component in `names`."""
  pick = lambda path: bool(set(_name(path).split("/")) & set(names))
  return jax.tree_util.tree_map_with_path(lambda path, a, b: b if pick(path) else a, base, quantized,
                                          is_leaf=lambda x: not isinstance(x, dict))


def drift_metrics(reference: np.ndarray, logits) -> dict[str, float]:
  q = np.asarray(logits, np.float64)
  log_p = reference - np.logaddexp.reduce(reference, axis=-1, keepdims=True)
  log_q = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
  return {"drift_rel": float(np.max(np.abs(q - reference)) / np.max(np.abs(reference))),
          "rms_rel": float(np.sqrt(np.mean((q - reference) ** 2)) / np.std(reference)),
          "kl": float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1))),
          "top1": float(np.mean(np.argmax(reference, -1) == np.argmax(q, -1)))}


def section_drift(plan: dict, models: dict[str, ltm_jax.LanguageModel], began: float) -> list[dict]:
  rows = []
  for kind, base in models.items():
    weights = {"init": base}
    if kind == "rwkv7":
      weights["filled"] = filled(base)
    for label, lm in weights.items():
      cfg = lm.config
      prompt = decode_bench.random_prompt(1, plan["prompt"], cfg.model.vocab_size, seed=2)
      reference = np.asarray(lm.forward(prompt), np.float64)
      group, small, sensitive = plan["group"], plan["small_group"], SENSITIVE[kind]
      variants = {"int8": lambda: lm.quantize("int8")}
      for g in plan["groups"]:
        variants[f"int4 g{g}"] = lambda g=g: lm.quantize("int4", g)
      variants[f"int4 g{group}, head int8"] = lambda: lm.quantize("int4", group, ("head",))
      variants[f"int4 g{group}, {','.join(sensitive)} int8"] = lambda: lm.quantize("int4", group, sensitive)
      variants[f"int4 g{group}, head,{','.join(sensitive)} int8"] = (
          lambda: lm.quantize("int4", group, ("head",) + sensitive))
      variants[f"int4 g{small}, head,{','.join(sensitive)} int8"] = (
          lambda: lm.quantize("int4", small, ("head",) + sensitive))
      full = lm.quantize("int4", group)
      for name, names in CLASSES[kind].items() if (kind, label) != ("rwkv7", "init") else ():
        variants[f"only {name} int4 g{group}"] = (
            lambda names=names: ltm_jax.LanguageModel(cfg, only(lm.params, full.params, names)))
      for variant, make in variants.items():
        quantized = make()
        rows.append({"section": "drift", "model": kind, "weights": label, "variant": variant,
                     **drift_metrics(reference, quantized.forward(prompt)), "param_bytes": quantized.param_bytes})
        print(f"  {kind} {label} {variant}: drift {rows[-1]['drift_rel']:.4f} ({time.perf_counter() - began:.0f} s)",
              flush=True)
      common.print_table(rows[-len(variants):], DRIFT_COLUMNS)
  return rows


def section_memory(plan: dict, models: dict[str, ltm_jax.LanguageModel]) -> list[dict]:
  rows = []
  for kind, base in models.items():
    variants = [("float32", base, None), ("int8", base.quantize("int8"), None),
                ("int4", base.quantize("int4", plan["group"]), None)]
    variants += [("int8 read as stored", variants[1][1], ("int8",)),
                 ("int4 read as stored", variants[2][1], ("int4",))]
    prompt = decode_bench.random_prompt(1, plan["prompt"], base.config.model.vocab_size, seed=2)
    for variant, lm, keep in variants:
      model = decode_bench.decode_model(lm, decode_bench.cache_capacity(lm, plan["prompt"] + plan["steps"]))
      decoding = decode_bench.prefill(lm, model, prompt)
      compiled, compile_s = decode_bench.compile_decode(model, lm.params, decoding, plan["steps"], keep)
      stats = compiled.memory_analysis()
      row = {"section": "memory", "model": kind, "variant": variant, "param_bytes": lm.param_bytes,
             "argument_bytes": stats.argument_size_in_bytes, "temp_bytes": stats.temp_size_in_bytes,
             "output_bytes": stats.output_size_in_bytes, "alias_bytes": stats.alias_size_in_bytes,
             "compile_s": compile_s}
      row["peak_bytes"] = row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"] - row["alias_bytes"]
      rows.append(row)
    common.print_table(rows[-len(variants):], MEMORY_COLUMNS)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--sections", nargs="+", choices=("drift", "memory"), default=("drift", "memory"))
  args = parser.parse_args()
  plan = PLANS["quick" if args.quick else "cpu"]
  dplan = decode_bench.PLANS[plan["decode_plan"]]
  began = time.perf_counter()
  models = {kind: decode_bench.build(decode_bench.make_config(dplan, kind)) for kind in ("rwkv7", "attention")}
  rows = []
  if "drift" in args.sections:
    rows += section_drift(plan, models, began)
  if "memory" in args.sections:
    rows += section_memory(plan, models)
  path = common.write_results(
      "quantize-decode" + ("-quick" if args.quick else ""), rows, plan=plan, size=dplan.size,
      sections=list(args.sections), seconds=time.perf_counter() - began, load_average_end=list(os.getloadavg()),
      note=("randomly initialised models; drift: one random prompt's forward-pass logits against float32 "
            "(drift_rel = max|diff| / max|float32 logit|, rms_rel = RMS diff / std of float32 logits, kl = mean "
            "KL(float32 || quantised) in nats, top1 = argmax agreement); memory: XLA memory_analysis of the "
            "compiled decode program (peak_bytes = arguments + temporaries + outputs - aliased)"))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
