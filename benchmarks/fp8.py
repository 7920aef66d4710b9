"""FP8 training (model.fp8): does it track bfloat16, and does XLA compile it to FP8 GEMMs on an H100?

  python benchmarks/fp8.py --section curve          # tiny LM, bfloat16 vs bfloat16 + FP8, CPU emulation (~5 min)
  .venv-aot/bin/python benchmarks/fp8.py --section aot   # deviceless H100 (sm_90a) compile (~1 min)
  python benchmarks/fp8.py --quick --section curve  # tiny sizes: proves the script end to end

curve: a byte-level RWKV-4 + attention LM (d_model 64, 2 layers) trained from the same initial parameters on the
  same batches (AdamW, warmup then cosine) with model.dtype bfloat16, without and with model.fp8; the training loss
  every `log_every` steps and the final validation bits/byte (mean next-byte cross-entropy / ln 2). On a CPU the FP8
  rounding is emulated (values rounded to e4m3/e5m2, products in bfloat16), so only the numbers, not the speed,
  mean anything.
aot: compiles for an H100 without a GPU (`benchmarks/gpu_aot.py`'s target and topology) one projection's forward
  and backward (bfloat16 x [4096, 1024] @ [1024, 4096], under model.fp8's product) and the whole `small_rwkv7`
  train step with model.fp8 (bfloat16), each in a subprocess per XLA flag setting, and counts in the compiled
  program the FP8 cuBLASLt GEMMs (`__cublas$lt$matmul$f8` custom calls) and the other GEMMs (cuBLAS calls and
  Triton GEMM fusions).

Writes benchmarks/results/fp8-<device>.json (curve) and fp8-aot-h100.json (aot); -quick- in the name with --quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import common  # First: puts the checkout on sys.path.

PLANS = {
    "cpu": dict(model=dict(d_model=64, n_layers=2, n_heads=2, layer_pattern="RA", max_seq_len=256), steps=400,
                batch=16, seq_len=128, lr=4e-3, eval_batches=16, log_every=25),
    "quick": dict(model=dict(d_model=32, n_layers=2, n_heads=2, layer_pattern="RA", max_seq_len=64), steps=20,
                  batch=8, seq_len=32, lr=4e-3, eval_batches=2, log_every=5),
}
# Flag settings the aot section compiles under: XLA's defaults, and with Triton's GEMM fusion off, which leaves the
# products to the cuBLAS rewriter (the pass that turns convert-from-FP8-times-scale into an FP8 GEMM).
FLAG_SETTINGS = {"default": "", "triton_gemm_off": "--xla_gpu_enable_triton_gemm=false"}
RESULT_TAG = "@@FP8-AOT@@"


def section_curve(quick: bool) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from ltm_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from ltm_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig  # pylint: disable=g-import-not-at-top
  from ltm_jax.train.optimizer import make_optimizer  # pylint: disable=g-import-not-at-top

  plan = PLANS["quick" if quick else "cpu"]
  began = time.perf_counter()
  base = ModelConfig(**plan["model"], dtype="bfloat16")
  t = TrainConfig(steps=plan["steps"], batch_size=plan["batch"], seq_len=plan["seq_len"], lr=plan["lr"],
                  warmup_steps=max(1, plan["steps"] // 10))
  data = DataConfig(source="embedded")
  splits = data_lib.load_splits(data, base.vocab_size, t.seq_len)
  loader = iter(data_lib.TrainLoader(splits.train, t.batch_size, t.seq_len, seed=0, worker_threads=1, prefetch=2))
  batches = [next(loader) for _ in range(t.steps)]
  val = data_lib.eval_batches(splits.val, t.batch_size, t.seq_len, plan["eval_batches"])
  optimizer = make_optimizer(t)
  initial = jax.jit(model_lib.init_params, static_argnums=(0, 2))(base, jax.random.key(0), None)
  rows = []
  for name, fp8 in (("bfloat16", False), ("bfloat16 + fp8", True)):
    model = model_lib.LM(dataclasses.replace(base, fp8=fp8))

    def nll(params, batch, model=model):
      logits = model.apply({"params": params}, batch["inputs"])[0]
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

    @jax.jit
    def step(params, opt_state, batch, nll=nll):
      loss, grads = jax.value_and_grad(nll)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(nll)
    params, opt_state, curve, window = initial, optimizer.init(initial), [], []
    for i, batch in enumerate(batches):
      params, opt_state, loss = step(params, opt_state, batch)
      window.append(float(loss))
      if (i + 1) % plan["log_every"] == 0:
        curve.append(float(np.mean(window)) / math.log(2))
        window = []
    bpb = float(np.mean([float(evaluate(params, b)) for b in val])) / math.log(2)
    rows.append({"variant": name, "steps": t.steps, "val_bpb": bpb, "train_bpb_curve": curve,
                 "final_train_bpb": curve[-1]})
    print(f"{name}: val {bpb:.4f} bits/byte ({time.perf_counter() - began:.0f} s)")
  gaps = [abs(a - b) for a, b in zip(rows[0]["train_bpb_curve"], rows[1]["train_bpb_curve"])]
  for row in rows:
    row["max_curve_gap_bpb"] = max(gaps)
  common.print_table(rows, ("variant", "steps", "final_train_bpb", "val_bpb", "max_curve_gap_bpb"))
  print("train bits/byte every", plan["log_every"], "steps:")
  for row in rows:
    print(f"  {row['variant']:>15}: " + " ".join(f"{v:.3f}" for v in row["train_bpb_curve"]))
  path = common.write_results(
      "fp8" + ("-quick" if quick else ""), rows, plan=plan, seconds=time.perf_counter() - began,
      note=("same initial parameters and batches; model.dtype bfloat16 without and with model.fp8 (FP8 emulated on "
            "this device: e4m3/e5m2 rounding, bfloat16 products); train_bpb_curve = mean training loss / ln 2 over "
            "each log_every steps; val_bpb on the same validation windows"))
  print(f"wrote {path}")


def _programs():
  """name -> (function, abstract arguments builder): what the aot section compiles."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from ltm_jax.ops import fp8  # pylint: disable=g-import-not-at-top
  import aot_cases  # pylint: disable=g-import-not-at-top

  def projection(abstract):
    def run(x, w, g):
      y, pullback = jax.vjp(lambda x, w: fp8.dot_general(x, w, (((1,), (0,)), ((), ()))), x, w)
      return y, pullback(g)
    return run, (abstract((4096, 1024), jnp.bfloat16), abstract((1024, 4096), jnp.bfloat16),
                 abstract((4096, 4096), jnp.bfloat16))

  return {"projection_4096x1024x4096": projection,
          "train_small_rwkv7_fp8": aot_cases.train_step("small_rwkv7", ("model.fp8=true",))}


def _worker(name: str) -> None:
  """Compiles one program for the H100 target in this process and prints its GEMM counts."""
  import contextlib  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from gpu_aot import H100_TARGET_CONFIG  # pylint: disable=g-import-not-at-top

  topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  sharding = NamedSharding(mesh, PartitionSpec())
  abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  fn, args = _programs()[name](abstract)
  use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
  began = time.perf_counter()
  with use_mesh(mesh.abstract_mesh) if use_mesh else contextlib.nullcontext():
    hlo = jax.jit(fn).trace(*args).lower().compile().as_text()
  calls = [line for line in hlo.splitlines() if " custom-call(" in line]
  result = {
      "fp8_gemms": sum('custom_call_target="__cublas$lt$matmul$f8"' in line for line in calls),
      "cublas_gemms": sum(re.search(r'custom_call_target="__cublas\$(gemm|lt\$matmul)"', line) is not None
                          for line in calls),
      "triton_gemm_fusions": len(re.findall(r"= \S+ fusion\([^)]*\), kind=kCustom, calls=%gemm_fusion", hlo)),
      "compile_s": round(time.perf_counter() - began, 1)}
  print(RESULT_TAG + json.dumps(result), flush=True)


def section_aot(quick: bool) -> None:
  began = time.perf_counter()
  rows = []
  for program in _programs():
    for setting, flags in FLAG_SETTINGS.items():
      env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
                 XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", program], env=env,
                            capture_output=True, text=True, timeout=900)
      tagged = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_TAG)]
      if not tagged:
        raise SystemExit(f"{program} ({setting}) did not compile: {(proc.stdout + proc.stderr)[-2000:]}")
      rows.append({"program": program, "xla_flags": flags or "(defaults)", **json.loads(tagged[-1][len(RESULT_TAG):])})
      print(rows[-1], flush=True)
  common.print_table(rows, ("program", "xla_flags", "fp8_gemms", "cublas_gemms", "triton_gemm_fusions", "compile_s"))
  import jax  # pylint: disable=g-import-not-at-top
  path = common.ROOT / "benchmarks" / "results" / f"fp8-aot{'-quick' if quick else ''}-h100.json"
  path.write_text(json.dumps({
      "benchmark": "fp8-aot", "target": "H100 (sm_90a), deviceless", "jax": jax.__version__,
      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.perf_counter() - began, 1),
      "note": ("GEMMs in the compiled program: fp8_gemms = __cublas$lt$matmul$f8 custom calls; cublas_gemms = other "
               "cuBLAS GEMM calls; triton_gemm_fusions = GEMMs XLA emits with Triton (operands upcast before the "
               "product, so no FP8 tensor cores)"),
      "results": rows}, indent=2) + "\n")
  print(f"wrote {path}")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--section", choices=("curve", "aot"), default="curve")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _worker(args.worker)
  elif args.section == "curve":
    section_curve(args.quick)
  else:
    section_aot(args.quick)


if __name__ == "__main__":
  main()
