"""Decoding speed: the library's own on-device loop (`generation.prefill`, then `generation.decode(steps=N)`).

  python benchmarks/decode.py            # CPU: one RWKV-World-sized model per mixer, about 13 minutes on 2 cores
  python benchmarks/decode.py --quick    # tiny sizes, every section: proves the script end to end in seconds

Every time is one jitted `decode` call of N steps (one lax.while_loop: sample, feed the token back through every
layer) divided by N, block_until_ready, median over a few repeats after a warm-up; the loop is compiled ahead of time
from the library's jitted `decode` itself (so its buffer donation holds). Tokens are sampled at temperature 1, as
`LanguageModel.generate` does, and no stop token ends a loop early. Every model has the same size (`SIZES`).

Sections (the JSON tags each row with `section`):
  position  ms/token at batch 1 against the context position p, and t(p)/t(p0) (p0 the first position, 128). RWKV
            must stay flat: t(16k)/t(128) <= 1.05. A model is put at position p without feeding it p tokens: a real
            random prompt of `prompt` tokens is prefilled, then
              - attention (full): every cache is replaced by one of capacity p + N (how `generate` sizes it) holding
                random normal keys and values at positions 0..p-1 (next_position p, Decoding.positions p);
              - sliding window: the same with the ring of `window` slots holding positions p-window..p-1;
              - RWKV-4/-7: their state does not grow with p, so the state after the real prompt is kept and only
                the positions are set to p.
            The positions are timed round-robin, and t(p)/t(p0) is the median of each round's ratio, so load that
            comes and goes on a shared machine hits both sides of a ratio alike.
  batch     tokens/s against the batch at position 512 (RWKV-7 and full attention), after a real prompt of
            `batch_prompt` tokens per row, put at position 512 as above; timed round-robin over the batches, and
            vs_batch_1 (tokens/s over batch 1's) paired per round like the position ratios.
  dtype     batch 1 at the real prompt's end: float32, bfloat16 compute (model.dtype), int8 weights
            (`LanguageModel.quantize("int8")`) and int4 weights in groups of 128 (`quantize("int4")`), float32
            compute: ms/token, parameter bytes, and the largest |logit - float32 logit| over a random prompt
            (forward pass). Quantised weights are dequantised inside the jitted call, ahead of the token loop,
            except kernels of the kinds `kernels_read_quantized` names for the platform (none on CPU); "int8 read
            as stored" multiplies the int8 kernels as stored inside every step (`kernels_as_stored`, a GPU's
            default). --dtype-models rwkv7_scanned runs the same with model.scan_layers.
  forms     which XLA form of a quantised matmul reads fewer bytes in a decoding loop on this machine: a stack of
            the plan's MLPs (d_model -> 4 d_model -> d_model, n_layers of them, batch 1) run for `steps` tokens in
            one lax.fori_loop, one row per form: float32 and bfloat16 weights; int8 dequantised then multiplied
            (what `dequantize_params` gives the model), int8 converted in the product with the scale after it,
            the same with the int8 weights carried through the loop (loop-variant, so nothing can be hoisted),
            int8 x int8 -> int32 products with activations quantised per row (W8A8), and int4 in groups of 128
            through `ltm_jax.ops.quant_matmul` (scales after each group's product); then the same with the layers
            stacked and run by a lax.scan inside each token (as model.scan_layers does), where a layer's weights
            depend on the layer index and their dequantisation cannot be hoisted out of the token loop. Per row:
            ms/token, vs_float32, the stored weight bytes, XLA's cost analysis of the compiled loop divided by the
            steps (it counts a loop body once, so scanned rows count one layer), how many float32 weight-sized
            values the loop body computes (dequantisation inside the loop) or the program computes ahead of it
            (hoisted), and one matmul's max |y - y_float32| / max |y_float32|.
  floor     the dtype rows' ms/token over the weight-read floor: the bytes of every parameter a token must read
            (the embedding table counts one row) over `common.measure_ceilings()`'s copy rate (x + 1 into a
            donated buffer, bytes read + written per second).
  official  the official `rwkv` pip package on the same machine, same size, same weights: random official x070
            and RWKV-4 checkpoints (`ltm_jax.convert.synthetic`) are converted with `convert_rwkv`, loaded with
            `ltm_jax.load`, and timed at batch 1, float32; the package's `forward([token], state)` runs per token in
            a subprocess with RWKV_JIT_ON=1 and torch threads = the host's cores, greedily feeding back its argmax
            (no sampling: our loop's sampling is a small handicap to ours). Both read the same prompt first, and
            their last prompt logits are compared, so the two sides are known to run the same model.

Other jobs may share the machine: the load average at the start and the end is stored. Writes
benchmarks/results/decode-<device>.json (decode-quick-<device>.json with --quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import peers

import ltm_jax
from ltm_jax import model as model_lib
from ltm_jax.config import Config, ModelConfig
from ltm_jax.convert import convert_rwkv, synthetic
from ltm_jax.inference import generate as generation
from ltm_jax.layers.attention import EMPTY_POSITION, KVCache


class Plan(NamedTuple):
  """One run's sizes. size: the ModelConfig fields every model shares; steps: N, the tokens of one timed loop;
  repeats: timed runs per loop (position_repeats in the position section, whose ratios want more)."""
  size: dict[str, Any]
  positions: tuple[int, ...]
  batches: tuple[int, ...]
  batch_position: int
  prompt: int  # Tokens of the real prompt behind the position, dtype and official sections.
  batch_prompt: int  # Tokens per row behind the batch section (short: a 64-row prefill is the slow part).
  window: int
  steps: int
  repeats: int
  position_repeats: int
  batch_steps: int  # The batch section's loops are shorter: 64 rows make every step slow.
  batch_repeats: int
  batch_models: tuple[str, ...] = ("rwkv7", "attention")
  dtype_models: tuple[str, ...] = ("rwkv7", "attention")


# RWKV-World sized (vocabulary 65,536, as the official models), narrow and shallow enough for 2 CPU cores.
PLANS = {
    "cpu": Plan(size={"vocab_size": 65536, "d_model": 512, "n_layers": 8, "n_heads": 8, "rwkv7_head_size": 64},
                positions=(128, 512, 2048, 8192, 16384), batches=(1, 2, 4, 8, 16, 32, 64), batch_position=512,
                prompt=128, batch_prompt=32, window=1024, steps=64, repeats=5, position_repeats=15, batch_steps=32,
                batch_repeats=5),
    "quick": Plan(size={"vocab_size": 1024, "d_model": 64, "n_layers": 2, "n_heads": 2, "rwkv7_head_size": 32},
                  positions=(128, 512), batches=(1, 4), batch_position=128, prompt=16, batch_prompt=8, window=64,
                  steps=8, repeats=2, position_repeats=2, batch_steps=8, batch_repeats=2, batch_models=("rwkv7",),
                  dtype_models=("rwkv7",)),
}
MODELS = {"rwkv7": {"layer_pattern": "W"}, "rwkv4": {"layer_pattern": "R"}, "attention": {"layer_pattern": "A"},
          "sliding": {"layer_pattern": "A"}, "titans": {"layer_pattern": "MG"},  # sliding, titans: window=plan.window.
          "rwkv7_scanned": {"layer_pattern": "W", "scan_layers": True}}
POSITION_MODELS = ("rwkv7", "rwkv4", "attention", "sliding", "titans")
FLAT_MODELS = ("rwkv7", "rwkv4", "titans")  # States that do not grow: held to RWKV_FLAT.
SECTIONS = ("position", "batch", "dtype", "forms", "official")
RWKV_FLAT = 1.05  # The bound on t(16k) / t(128) for the RWKV models.
WARMUP = 1  # Untimed runs of every compiled loop before the timed ones.


# ------------------------------------------------------------------------------------------------------- the models


def make_config(plan: Plan, kind: str, dtype: str = "float32") -> Config:
  window = plan.window if kind in ("sliding", "titans") else None
  longest = max(plan.positions) + plan.steps
  return Config(name=f"decode-{kind}", model=ModelConfig(**plan.size, **MODELS[kind], window=window, dtype=dtype,
                                                         max_seq_len=longest))


def build(config: Config, seed: int = 0) -> ltm_jax.LanguageModel:
  """`ltm_jax.build(config, seed)`, with the initialisation jitted (Flax's eager init is the slow part of --quick)."""
  init = jax.jit(lambda key: model_lib.init_params(config.model, key, config.latent))
  return ltm_jax.LanguageModel(config, init(jax.random.key(seed)))


def decode_model(lm: ltm_jax.LanguageModel, capacity: int | None = None) -> model_lib.LM:
  """The LM that `stream_tokens` would decode with, full-attention caches of `capacity` slots."""
  return model_lib.LM(lm.config.model, lm.config.latent, cache_capacity=capacity)


def cache_capacity(lm: ltm_jax.LanguageModel, tokens: int) -> int | None:
  """`tokens` for a model with full-attention caches (which must hold every position), else None."""
  m = lm.config.model
  return tokens if "attention" in m.mixers and m.window is None else None


def random_prompt(batch: int, length: int, vocab: int, seed: int) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, jnp.int32)


def prefill(lm: ltm_jax.LanguageModel, model: model_lib.LM, tokens: jax.Array) -> generation.Decoding:
  lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
  return jax.block_until_ready(generation.prefill(model, lm.params, tokens, lengths))


def synthetic_cache(cache: KVCache, position: int, key: jax.Array) -> KVCache:
  """A cache after `position` tokens: k, v [B, C, Hkv, D] random normal in every slot (never zeros; empty slots are
  masked by their position), slot s holding the latest position q < `position` with q % C == s."""
  batch, capacity = cache.positions.shape
  slots = jnp.arange(capacity, dtype=jnp.int32)
  latest = slots + capacity * ((position - 1 - slots) // capacity)
  positions = jnp.where(slots < position, latest, EMPTY_POSITION)
  k_key, v_key = jax.random.split(key)
  normal = lambda key: jax.random.normal(key, cache.k.shape, jnp.float32).astype(cache.k.dtype)
  return KVCache(normal(k_key), normal(v_key), jnp.broadcast_to(positions, (batch, capacity)),
                 jnp.full((batch,), position, jnp.int32))


def at_position(decoding: generation.Decoding, position: int, seed: int = 0) -> generation.Decoding:
  """`decoding` moved to `position`: attention caches replaced by synthetic ones, recurrent states kept."""
  leaves, treedef = jax.tree.flatten(decoding.state, is_leaf=lambda x: isinstance(x, KVCache))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [synthetic_cache(leaf, position, k) if isinstance(leaf, KVCache) else leaf for leaf, k in zip(leaves, keys)]
  batch = decoding.positions.shape[0]
  return jax.block_until_ready(decoding._replace(state=jax.tree.unflatten(treedef, leaves),
                                                 positions=jnp.full((batch,), position, jnp.int32)))


def state_mib(decoding: generation.Decoding) -> float:
  return sum(x.nbytes for x in jax.tree.leaves(decoding.state)) / 2**20


# ------------------------------------------------------------------------------------------------------- the timing


@dataclasses.dataclass
class Loop:
  """One compiled `decode` of `steps` tokens and the Decoding it starts from (copied before every run, since decode
  donates it and a full-attention cache has room for exactly one run)."""
  name: Any
  compiled: Any
  params: Any
  decoding: generation.Decoding
  steps: int
  compile_s: float
  times: list[float] = dataclasses.field(default_factory=list)
  last: Any = None

  def run(self) -> float:
    start = jax.block_until_ready(jax.tree.map(jnp.copy, self.decoding))
    began = time.perf_counter()
    tokens, final = jax.block_until_ready(self.compiled(self.params, start, jax.random.key(0)))
    elapsed = time.perf_counter() - began
    self.last = (tokens, final.logits)  # Not the final state: a second set of caches would stay alive.
    return elapsed

  def result(self, batch: int) -> dict[str, Any]:
    tokens, logits = self.last
    ms = [t * 1e3 / self.steps for t in self.times]
    vocab = logits.shape[-1]
    return {"ms_per_token": statistics.median(ms), "min_ms_per_token": min(ms), "max_ms_per_token": max(ms),
            "tokens_per_s": batch * 1e3 / statistics.median(ms), "runs": len(ms), "steps": self.steps,
            "compile_s": self.compile_s,
            "sane": bool(jnp.all(jnp.isfinite(logits)) and jnp.all((tokens >= 0) & (tokens < vocab)))}


_COMPILED: dict[Any, tuple[Any, float]] = {}


def compile_decode(model: model_lib.LM, params, decoding: generation.Decoding, steps: int,
                   kernels_as_stored: tuple[str, ...] | None = None) -> tuple[Any, float]:
  """`generation.decode` lowered and compiled for these shapes (cached), and the seconds compiling took.

  Not `common.compile_fn`: a fresh jax.jit around decode would drop decode's donation of the Decoding."""
  signature = (model, steps, kernels_as_stored, jax.tree.structure((params, decoding)),
               tuple((x.shape, x.dtype) for x in jax.tree.leaves((params, decoding))))
  if signature not in _COMPILED:
    began = time.perf_counter()
    compiled = generation.decode.lower(model, params, decoding, jax.random.key(0), steps=steps,
                                       kernels_as_stored=kernels_as_stored).compile()
    _COMPILED[signature] = (compiled, time.perf_counter() - began)
  return _COMPILED[signature]


def make_loop(name, lm: ltm_jax.LanguageModel, model: model_lib.LM, decoding: generation.Decoding,
              steps: int, kernels_as_stored: tuple[str, ...] | None = None) -> Loop:
  compiled, compile_s = compile_decode(model, lm.params, decoding, steps, kernels_as_stored)
  return Loop(name, compiled, lm.params, decoding, steps, compile_s)


def time_round_robin(loops: list[Loop], repeats: int) -> None:
  """Runs every loop WARMUP times untimed, then `repeats` timed rounds, one run of each loop per round."""
  for i in range(WARMUP + repeats):
    for loop in loops:
      elapsed = loop.run()
      if i >= WARMUP:
        loop.times.append(elapsed)


# ----------------------------------------------------------------------------------------------------- the sections


def section_position(plan: Plan, models: dict[str, ltm_jax.LanguageModel]) -> list[dict]:
  """Batch 1 at every position of the plan, for every model: one row per (model, position)."""
  rows = []
  for kind, lm in models.items():
    prompt = random_prompt(1, plan.prompt, lm.config.model.vocab_size, seed=1)
    loops = []
    for position in plan.positions:
      model = decode_model(lm, cache_capacity(lm, position + plan.steps))
      decoding = at_position(prefill(lm, model, prompt), position, seed=position)
      loops.append(make_loop(position, lm, model, decoding, plan.steps))
    time_round_robin(loops, plan.position_repeats)
    first = loops[0]
    for loop in loops:
      row = {"section": "position", "model": kind, "batch": 1, "position": loop.name,
             "state_mib": state_mib(loop.decoding), **loop.result(1)}
      # Paired within each round (the positions ran back to back), so load that comes and goes cancels.
      row["vs_first"] = statistics.median(t / t0 for t, t0 in zip(loop.times, first.times))
      row["vs_first_min"] = min(loop.times) / min(first.times)
      if kind in FLAT_MODELS:
        row["flat"] = row["vs_first"] <= RWKV_FLAT
      rows.append(row)
      loop.decoding = None  # Frees the caches.
    common.print_table(rows[-len(loops):], POSITION_COLUMNS)
  return rows


def section_batch(plan: Plan, models: dict[str, ltm_jax.LanguageModel]) -> list[dict]:
  """Every batch of the plan at `batch_position`: one row per (model, batch)."""
  rows = []
  for kind in plan.batch_models:
    lm = models[kind]
    model = decode_model(lm, cache_capacity(lm, plan.batch_position + plan.batch_steps))
    loops = []
    for batch in plan.batches:
      prompt = random_prompt(batch, plan.batch_prompt, lm.config.model.vocab_size, seed=batch)
      decoding = at_position(prefill(lm, model, prompt), plan.batch_position, seed=batch)
      loops.append(make_loop(batch, lm, model, decoding, plan.batch_steps))
    time_round_robin(loops, plan.batch_repeats)
    for loop in loops:
      result = loop.result(loop.name)
      rows.append({"section": "batch", "model": kind, "batch": loop.name, "position": plan.batch_position,
                   "ms_per_step": result.pop("ms_per_token"), **result,
                   "vs_batch_1": loop.name * statistics.median(t0 / t for t, t0 in zip(loop.times, loops[0].times))})
      loop.decoding = None
    common.print_table(rows[-len(loops):], BATCH_COLUMNS)
  return rows


def weight_bytes_per_token(lm: ltm_jax.LanguageModel) -> int:
  """Bytes of the parameters one token must read: all of them, but one row of an untied embedding table (a gather).
  int8 weights count their int8 values and float32 scales."""
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(lm.params)[0]:
    lookup = "['embed']" in jax.tree_util.keystr(path) and not lm.config.model.tie_embeddings
    total += leaf.nbytes // leaf.shape[0] if lookup else leaf.nbytes
  return total


AS_STORED = "int8 read as stored"  # kernels_as_stored=("int8",): what a GPU does by default.


def section_dtype(plan: Plan, models: dict[str, ltm_jax.LanguageModel], bandwidths: dict[str, float]) -> list[dict]:
  """float32, bfloat16 compute and int8 weights at batch 1 after the prompt, with the floor columns (one row per
  (model, variant)); `bandwidths` {name: GB/s} each give a floor."""
  rows = []
  for kind in plan.dtype_models:
    base = models[kind]
    variants = {"float32": base,
                "bfloat16": ltm_jax.LanguageModel(make_config(plan, kind, "bfloat16"), base.params),
                "int8": base.quantize("int8"), "int4": base.quantize("int4")}
    variants[AS_STORED] = variants["int8"]
    prompt = random_prompt(1, plan.prompt, base.config.model.vocab_size, seed=2)
    reference = np.asarray(base.forward(prompt))
    loops = []
    for variant, lm in variants.items():
      model = decode_model(lm, cache_capacity(lm, plan.prompt + plan.steps))
      keep = ("int8",) if variant == AS_STORED else None
      loops.append(make_loop(variant, lm, model, prefill(lm, model, prompt), plan.steps, keep))
    time_round_robin(loops, plan.repeats)
    for loop, (variant, lm) in zip(loops, variants.items()):
      drift = float(np.max(np.abs(np.asarray(lm.forward(prompt)) - reference)))
      result = loop.result(1)
      weight_bytes = weight_bytes_per_token(lm)
      row = {"section": "dtype", "model": kind, "variant": variant, "position": plan.prompt, **result,
             "param_bytes": lm.param_bytes, "weight_bytes_per_token": weight_bytes, "logit_drift": drift,
             "logit_drift_rel": drift / float(np.max(np.abs(reference))),
             "weight_gbps": weight_bytes / result["ms_per_token"] / 1e6}
      for name, gbps in bandwidths.items():
        row[f"floor_ms_{name}"] = weight_bytes / gbps / 1e6
        row[f"x_floor_{name}"] = result["ms_per_token"] / row[f"floor_ms_{name}"]
      rows.append(row)
    common.print_table(rows[-len(loops):], DTYPE_COLUMNS)
  return rows


def _mlp_weights(d: int, layers: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(seed)
  return [(rng.normal(0, d ** -0.5, (d, 4 * d)), rng.normal(0, (4 * d) ** -0.5, (4 * d, d))) for _ in range(layers)]


def _int8(w: np.ndarray) -> tuple[jax.Array, jax.Array]:
  scale = np.abs(w).max(0, keepdims=True) / 127
  return jnp.asarray(np.round(w / scale), jnp.int8), jnp.asarray(scale, jnp.float32)


def _w8a8(x, w):
  """Activations quantised per row to int8 (absmax), an int8 x int8 -> int32 product, both scales after it."""
  sx = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-30) / 127
  acc = jax.lax.dot_general(jnp.round(x / sx).astype(jnp.int8), w[0], (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)
  return acc.astype(jnp.float32) * sx * w[1]


def _quant_op(x, w):
  from ltm_jax.ops.quant_matmul import quant_matmul  # pylint: disable=g-import-not-at-top
  return quant_matmul(x, w.packed, w.scale, packed=True)


_dequantise_dot = lambda x, w: x @ (w[0].astype(jnp.float32) * w[1])
_dot_scale = lambda x, w: (x @ w[0].astype(jnp.float32)) * w[1]
# name: (weight format, matmul(x [1, K], stored weight) -> [1, N], how the loop holds the weights): "invariant"
# (closed over), "carried" (passed through the loop carry unchanged), "scanned" (stacked [layers, ...] and read by a
# lax.scan over the layers inside each token, as model.scan_layers does: each layer's slice depends on the layer
# index, so its dequantisation cannot be hoisted out of the token loop).
FORMS = {
    "float32": ("float32", lambda x, w: x @ w, "invariant"),
    "bfloat16": ("bfloat16", lambda x, w: (x.astype(jnp.bfloat16) @ w).astype(jnp.float32), "invariant"),
    "int8 dequantise, dot": ("int8", _dequantise_dot, "invariant"),
    "int8 dot, scale after": ("int8", _dot_scale, "invariant"),
    "int8 carried, scale after": ("int8", _dot_scale, "carried"),
    "int8 W8A8": ("int8", _w8a8, "invariant"),
    "int4 g128 quant_matmul": ("int4", _quant_op, "invariant"),
    "float32 scanned": ("float32", lambda x, w: x @ w, "scanned"),
    "int8 scanned, dequantise, dot": ("int8", _dequantise_dot, "scanned"),
    "int8 scanned, scale after": ("int8", _dot_scale, "scanned"),
    "int4 g128 scanned quant_matmul": ("int4", _quant_op, "scanned"),
}


def _weight_shaped_f32(hlo: str, shapes: set[str]) -> tuple[int, int]:
  """(inside, outside): instructions computing a float32 value of a weight's shape in the while body, and in the
  rest of the program (a dequantisation hoisted ahead of the loop). Parameters and tuple plumbing do not count."""
  computations, current = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      computations[current] = []
    elif current is not None:
      computations[current].append(line)
  bodies = {name.lstrip("%") for name in __import__("re").findall(r"body=(%?[\w.\-]+)", hlo)}

  def count(lines):
    n = 0
    for line in lines:
      if " = " not in line:
        continue
      result, op = line.split(" = ", 1)[1].split(" ", 1) if " " in line.split(" = ", 1)[1] else ("", "")
      if any(result.startswith(f"f32[{shape}]") for shape in shapes) and not op.startswith(
          ("parameter(", "get-tuple-element(", "tuple(", "copy(", "bitcast(")):
        n += 1
    return n

  inside = sum(count(lines) for name, lines in computations.items() if name in bodies)
  return inside, sum(count(lines) for name, lines in computations.items() if name not in bodies)


def section_forms(plan: Plan) -> list[dict]:
  """See the module docstring (forms)."""
  from ltm_jax.inference.quantize import quantize_int4  # pylint: disable=g-import-not-at-top
  d, layers, steps = plan.size["d_model"], plan.size["n_layers"], plan.steps
  raw = _mlp_weights(d, layers, seed=3)
  stored = {"float32": [tuple(jnp.asarray(w, jnp.float32) for w in pair) for pair in raw],
            "bfloat16": [tuple(jnp.asarray(w, jnp.bfloat16) for w in pair) for pair in raw],
            "int8": [tuple(_int8(w) for w in pair) for pair in raw],
            "int4": [tuple(quantize_int4(jnp.asarray(w, jnp.float32), (0,), 128) for w in pair) for pair in raw]}
  # Weight-sized float32 values: the weights, and int4's unpacked [groups, 128, N] (stacked: [layers, ...]).
  shapes = {f"{d},{4 * d}", f"{4 * d},{d}", f"{max(1, d // 128)},{min(d, 128)},{4 * d}", f"{4 * d // 128},128,{d}"}
  shapes |= {f"{layers},{shape}" for shape in shapes}
  x0 = jnp.asarray(np.random.default_rng(4).normal(size=(1, d)), jnp.float32)
  reference = None
  loops, rows = [], []
  for name, (fmt, matmul, hold) in FORMS.items():
    def layer(x, pair, matmul=matmul):
      return x + matmul(jax.nn.gelu(matmul(x, pair[0])), pair[1])

    if hold == "scanned":
      weights = jax.tree.map(lambda *ws: jnp.stack(ws), *stored[fmt])
      token = lambda x, ws, layer=layer: jnp.tanh(jax.lax.scan(lambda y, pair: (layer(y, pair), None), x, ws)[0])
    else:
      weights = stored[fmt]
      token = lambda x, ws, layer=layer: jnp.tanh(functools.reduce(layer, ws, x))
    if hold == "carried":
      run = lambda ws, x, token=token: jax.lax.fori_loop(0, steps, lambda t, c: (token(c[0], c[1]), c[1]), (x, ws))[0]
    else:
      run = lambda ws, x, token=token: jax.lax.fori_loop(0, steps, lambda t, y: token(y, ws), x)
    # One matmul (the first layer's up-projection), against float32's: a stack of random MLPs amplifies any error
    # token over token, so a loop's output says nothing about the rounding.
    one = np.asarray(jax.jit(matmul)(x0, stored[fmt][0][0]), np.float64)
    reference = one if reference is None else reference
    began = time.perf_counter()
    compiled = jax.jit(run).lower(weights, x0).compile()
    compile_s = time.perf_counter() - began
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    inside, outside = _weight_shaped_f32(compiled.as_text(), shapes)
    loops.append((name, compiled, weights, [], []))
    rows.append({"section": "forms", "form": name, "weights": fmt, "held": hold, "compile_s": compile_s,
                 "weight_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(weights)),
                 "xla_bytes_per_step": float(cost.get("bytes accessed", 0.0)) / steps,
                 "f32_weights_in_loop": inside, "f32_weights_before_loop": outside,
                 "matmul_drift_rel": float(np.max(np.abs(one - reference)) / np.max(np.abs(reference)))})
  # Round robin, FORMS_REPEATS rounds: wall time, and the process's CPU time (all of XLA's threads), which other
  # jobs on a shared machine disturb less than the wall clock.
  for i in range(WARMUP + FORMS_REPEATS):
    for _, compiled, weights, times, cpu_times in loops:
      began, began_cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(compiled(weights, x0))
      if i >= WARMUP:
        times.append((time.perf_counter() - began) * 1e3 / steps)
        cpu_times.append((time.process_time() - began_cpu) * 1e3 / steps)
  base = base_cpu = None
  for row, (_, _, _, times, cpu_times) in zip(rows, loops):
    row["ms_per_token"], row["cpu_ms_per_token"] = statistics.median(times), statistics.median(cpu_times)
    base = row["ms_per_token"] if base is None else base
    base_cpu = row["cpu_ms_per_token"] if base_cpu is None else base_cpu
    row["vs_float32"], row["cpu_vs_float32"] = row["ms_per_token"] / base, row["cpu_ms_per_token"] / base_cpu
  common.print_table(rows, FORMS_COLUMNS)
  return rows


OFFICIAL = r"""
import json, os, statistics, sys, time
import numpy as np
import torch
path, version, strategy, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
prompt, steps, warmup = json.loads(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
torch.set_num_threads(os.cpu_count())
from rwkv import model as official
began = time.perf_counter()
if version == "x070":
    model = official.RWKV_x070(path[:-len(".pth")], strategy)  # It appends ".pth" itself.
else:
    model = official.RWKV(path, strategy, verbose=False)
load_s = time.perf_counter() - began
sync = torch.cuda.synchronize if strategy.startswith("cuda") else (lambda: None)
logits, state = model.forward(prompt, None)
prompt_logits = logits.float().cpu().numpy().reshape(-1)
token, times = int(logits.argmax()), []
for i in range(warmup + steps):
    sync()
    began = time.perf_counter()
    logits, state = model.forward([token], state)
    token = int(logits.argmax())  # The sync a user's loop needs to see its token.
    sync()
    if i >= warmup:
        times.append(time.perf_counter() - began)
np.save(out + ".npy", prompt_logits)
json.dump({"load_s": load_s, "ms": [t * 1e3 for t in times], "threads": torch.get_num_threads(),
           "torch": torch.__version__}, open(out, "w"))
"""


def official_checkpoint(plan: Plan, version: str, folder: pathlib.Path) -> pathlib.Path:
  """A random official-layout checkpoint of the plan's size (FFN 4x wide, LoRA widths as ltm_jax suggests)."""
  size, rng = plan.size, np.random.default_rng(0 if version == "x070" else 1)
  if version == "x070":
    lora = ModelConfig(d_model=size["d_model"]).rwkv7_lora_dims()
    weights = synthetic.x070_weights(rng, vocab=size["vocab_size"], d=size["d_model"],
                                     head_size=size["rwkv7_head_size"], n_layers=size["n_layers"],
                                     hidden=4 * size["d_model"],
                                     lora=(lora["decay"], lora["iclr"], lora["value"], lora["gate"]))
  else:
    weights = synthetic.rwkv4_weights(rng, vocab=size["vocab_size"], d=size["d_model"], n_layers=size["n_layers"],
                                      hidden=4 * size["d_model"])
  return synthetic.save(weights, folder / f"{version}.pth")


def run_official(path: pathlib.Path, version: str, prompt: list[int], plan: Plan, strategy: str) -> dict[str, Any]:
  out = path.with_suffix(".json")
  env = {**os.environ, "RWKV_JIT_ON": "1", "RWKV_CUDA_ON": "0", "RWKV_V7_ON": "1" if version == "x070" else "0"}
  steps = plan.steps * plan.repeats
  done = subprocess.run([sys.executable, "-c", OFFICIAL, str(path), version, strategy, str(out), json.dumps(prompt),
                         str(steps), str(plan.steps)], env=env, capture_output=True, text=True, timeout=1800,
                        check=False)
  if done.returncode != 0:
    raise RuntimeError(f"the official rwkv package failed on {version}: {done.stderr[-2000:]}")
  result = json.loads(out.read_text())
  result["prompt_logits"] = np.load(str(out) + ".npy")
  return result


def section_official(plan: Plan, strategy: str) -> list[dict]:
  """x070 and RWKV-4 at the plan's size, ours and the official package's, on the same weights: two rows each."""
  import importlib.util
  if importlib.util.find_spec("torch") is None or importlib.util.find_spec("rwkv") is None:
    print("official: skipped, needs torch and rwkv (the convert extra)")
    return [{"section": "official", "skipped": "needs torch and rwkv"}]
  rows = []
  with tempfile.TemporaryDirectory(prefix="ltm-decode-") as folder:
    folder = pathlib.Path(folder)
    for version in ("x070", "rwkv4"):
      path = official_checkpoint(plan, version, folder)
      began = time.perf_counter()
      convert_rwkv(path, folder / f"{version}-work")
      convert_s = time.perf_counter() - began
      lm = ltm_jax.load(folder / f"{version}-work")
      prompt = random_prompt(1, plan.prompt, lm.config.model.vocab_size, seed=3)
      model = decode_model(lm)
      decoding = prefill(lm, model, prompt)
      ours_logits = np.asarray(decoding.logits[0])
      loop = make_loop("ltm_jax", lm, model, decoding, plan.steps)
      time_round_robin([loop], plan.repeats)
      theirs = run_official(path, version, [int(t) for t in np.asarray(prompt[0])], plan, strategy)
      scale = float(np.max(np.abs(theirs["prompt_logits"])))
      diff = float(np.max(np.abs(ours_logits - theirs["prompt_logits"]))) / scale
      ms = statistics.median(theirs["ms"])
      model_name = {"x070": "rwkv7 (x070)", "rwkv4": "rwkv4"}[version]
      ours = {"section": "official", "model": model_name, "impl": "ltm_jax decode loop", **loop.result(1),
              "params": lm.num_params, "convert_s": convert_s, "prompt_logit_diff_rel": diff}
      official = {"section": "official", "model": model_name,
                  "impl": f"rwkv {peers.installed_version(('rwkv',))} forward ({strategy})",
                  "ms_per_token": ms, "min_ms_per_token": min(theirs["ms"]), "max_ms_per_token": max(theirs["ms"]),
                  "tokens_per_s": 1e3 / ms, "runs": len(theirs["ms"]), "steps": 1, "load_s": theirs["load_s"],
                  "torch": theirs["torch"], "torch_threads": theirs["threads"], "prompt_logit_diff_rel": diff}
      for row in (ours, official):
        row["vs_official"] = ms / row["ms_per_token"]
      rows += [ours, official]
      common.print_table(rows[-2:], OFFICIAL_COLUMNS)
  return rows


POSITION_COLUMNS = ("model", "position", "ms_per_token", "min_ms_per_token", "vs_first", "vs_first_min", "state_mib",
                    "compile_s", "sane")
BATCH_COLUMNS = ("model", "batch", "position", "ms_per_step", "tokens_per_s", "vs_batch_1", "compile_s", "sane")
DTYPE_COLUMNS = ("model", "variant", "ms_per_token", "param_bytes", "logit_drift", "logit_drift_rel", "sane")
FLOOR_COLUMNS = ("model", "variant", "ms_per_token", "weight_bytes_per_token", "weight_gbps", "floor_ms_copy",
                 "x_floor_copy")
FORMS_REPEATS = 15
FORMS_COLUMNS = ("form", "ms_per_token", "vs_float32", "cpu_ms_per_token", "cpu_vs_float32", "weight_bytes",
                 "xla_bytes_per_step", "f32_weights_in_loop", "f32_weights_before_loop", "matmul_drift_rel", "compile_s")
OFFICIAL_COLUMNS = ("model", "impl", "ms_per_token", "tokens_per_s", "vs_official", "prompt_logit_diff_rel")


def _lap(name: str, since: float) -> float:
  now = time.perf_counter()
  print(f"({name}: {now - since:.0f} s)")
  return now


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="the quick plan: tiny sizes, under a minute")
  parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                      help="dtype includes the floor table; a partial run writes decode[-quick]-<sections>-<device>")
  parser.add_argument("--official-strategy", default="cpu fp32", help="the rwkv package's strategy string")
  parser.add_argument("--models", nargs="+", default=list(POSITION_MODELS), choices=list(MODELS),
                      help="the position section's models; a subset adds their names to the results file's name")
  parser.add_argument("--dtype-models", nargs="+", default=None, choices=list(MODELS),
                      help="the dtype section's models (default: the plan's)")
  args = parser.parse_args()
  plan_name = "quick" if args.quick else "cpu"
  plan = PLANS[plan_name]
  if args.dtype_models:
    plan = plan._replace(dtype_models=tuple(args.dtype_models))
  load_start = os.getloadavg()
  began = time.perf_counter()

  ceilings = common.measure_ceilings()
  bandwidths = {"copy": ceilings["copy_gbps"]}
  print(f"ceilings: {ceilings}; load average {load_start[0]:.2f} on {os.cpu_count()} cores")
  needed = set(args.models if "position" in args.sections else ()) | set(
      plan.batch_models if "batch" in args.sections else ()) | set(
      plan.dtype_models if "dtype" in args.sections else ())
  built = {kind: build(make_config(plan, kind)) for kind in MODELS
           if kind in needed - {"sliding"} or (kind == "attention" and "sliding" in needed)}
  # The window changes no parameter: the sliding-window model is the attention model with a window.
  if "sliding" in needed:
    built["sliding"] = ltm_jax.LanguageModel(make_config(plan, "sliding"), built["attention"].params)
  models = {kind: built[kind] for kind in MODELS if kind in needed}
  print(f"model size: {plan.size}; params: " + ", ".join(f"{k} {m.num_params / 1e6:.1f}M" for k, m in models.items()))

  rows, clock = [], time.perf_counter()
  print(f"setup: {clock - began:.0f} s")
  if "position" in args.sections:
    print(f"\n== ms/token at batch 1 vs context position ({plan.steps} tokens per loop; RWKV must stay within "
          f"{RWKV_FLAT}x of position {plan.positions[0]})")
    rows += section_position(plan, {kind: models[kind] for kind in args.models})
    clock = _lap("position", clock)
  if "batch" in args.sections:
    print(f"\n== throughput vs batch at position {plan.batch_position}")
    rows += section_batch(plan, models)
    clock = _lap("batch", clock)
  if "dtype" in args.sections:
    print(f"\n== dtypes at batch 1, position {plan.prompt}; drift = max |logit - float32 logit| on a random prompt")
    dtype_rows = section_dtype(plan, models, bandwidths)
    print(f"\n== weight-read floor at batch 1: weight bytes / copy bandwidth ({bandwidths['copy']:.4g} GB/s)")
    common.print_table(dtype_rows, FLOOR_COLUMNS)
    rows += dtype_rows
    clock = _lap("dtype", clock)
  if "forms" in args.sections:
    print(f"\n== XLA forms of a quantised matmul in a decoding loop: {plan.size['n_layers']} MLPs of d_model "
          f"{plan.size['d_model']}, batch 1, {plan.steps} tokens per loop")
    rows += section_forms(plan)
    clock = _lap("forms", clock)
  if "official" in args.sections:
    print(f"\n== the official rwkv package vs ltm_jax, batch 1, float32, same weights (size {plan.size})")
    rows += section_official(plan, args.official_strategy)
    clock = _lap("official", clock)

  for title, section, columns in (("position", "position", POSITION_COLUMNS), ("batch", "batch", BATCH_COLUMNS),
                                  ("dtype", "dtype", DTYPE_COLUMNS), ("floor", "dtype", FLOOR_COLUMNS),
                                  ("forms", "forms", FORMS_COLUMNS),
                                  ("official", "official", OFFICIAL_COLUMNS)):
    chosen = [r for r in rows if r.get("section") == section and "skipped" not in r]
    if chosen:
      print(f"\n[{title}]")
      common.print_table(chosen, columns)
  flat = [r for r in rows if "flat" in r and r["position"] == plan.positions[-1]]
  for row in flat:
    print(f"{row['model']}: t({row['position']}) / t({plan.positions[0]}) = {row['vs_first']:.3f} "
          f"({'within' if row['flat'] else 'OVER'} {RWKV_FLAT})")
  load_end = os.getloadavg()
  # The quick run proves the script end to end, a partial run measures a part: neither overwrites the full table.
  name = "decode" + ("-quick" if args.quick else "")
  if sorted(args.sections) != sorted(SECTIONS):
    name += "-" + "-".join(s for s in SECTIONS if s in args.sections)
  if sorted(args.models) != sorted(POSITION_MODELS):
    name += "-" + "-".join(args.models)
  if args.dtype_models:
    name += "-" + "-".join(args.dtype_models)
  path = common.write_results(
      name, rows, plan=plan_name, sections=args.sections, size=plan.size,
      layer_patterns={k: v["layer_pattern"] for k, v in MODELS.items()}, window=plan.window,
      positions=list(plan.positions), batches=list(plan.batches), batch_position=plan.batch_position,
      prompt_tokens=plan.prompt, batch_prompt_tokens=plan.batch_prompt, steps_per_loop=plan.steps,
      repeats=plan.repeats, position_repeats=plan.position_repeats, batch_steps_per_loop=plan.batch_steps,
      batch_repeats=plan.batch_repeats, warmup_runs=WARMUP, ceilings=ceilings,
      load_average_start=list(load_start), load_average_end=list(load_end), seconds=time.perf_counter() - began,
      note=("ms_per_token = one jitted decode loop of steps_per_loop tokens / steps (median over repeats, after "
            "warm-up), temperature-1 sampling included. Positions are synthetic: a real random prompt of "
            "prompt_tokens is prefilled; full-attention caches are then replaced by caches of capacity position + "
            "steps holding random normal keys/values at positions 0..position-1 (sliding window: the last window "
            "positions), next_position = position; RWKV states (which do not grow) are kept and only the positions "
            "set. vs_first = t(position) / t(first position), the median over rounds that ran every position back "
            "to back; vs_first_min = the fastest runs' ratio. Batch rows: ms_per_step is one step for all rows, "
            "loops of batch_steps_per_loop. x_floor_* = ms_per_token / (weight_bytes_per_token / "
            "bandwidth), copy = common.measure_ceilings (x + 1 into a donated buffer, bytes read + written). The "
            "official rwkv package runs forward([token], state) per token in a "
            "subprocess (RWKV_JIT_ON=1, torch threads = host cores, argmax feedback); vs_official = official ms / "
            "ms. Other jobs may share the machine: see load_average_*."))
  print(f"wrote {path} in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
  main()
