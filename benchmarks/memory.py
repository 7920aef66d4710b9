"""Compiled memory of the train step per remat policy, and compile time against depth with and without scanned layers.

Every number comes from `ltm info --config ... --json --compile`, run in a fresh process per row: the real train
step (ltm_jax.train.step) compiled for this machine's backend on abstract inputs, nothing run.

  python benchmarks/memory.py                 # both tables (about 25 minutes on 2 loaded CPU cores)
  python benchmarks/memory.py --only remat    # or --only depth

(a) remat: configs/base_125m.py at seq 2048, batch 1, without and with latents (inner_steps 4), unscanned and
    scanned; columns are XLA's temp bytes (activations kept for the backward pass, gradients, scratch) and the
    ratio to no remat. Rows use XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false (schedule for
    memory, as GPU compilers do); two extra rows show CPU's default scheduler, under which unscanned remat saves
    nothing because the recomputation is scheduled early.
(b) depth: base_125m with 4, 8, 12, 24 layers (no remat), unscanned and scanned: seconds to trace + lower and to
    compile, the better of two runs. Goal: 24 scanned layers within 1.5x of 4.

Writes benchmarks/results/memory-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common  # First: puts the checkout on sys.path.

CONFIG = "configs/base_125m.py"
SHAPE = ["train.batch_size=1", "train.seq_len=2048", "train.grad_accum=1"]
# Every block reads z, 4 vectors each, from whole rows: the form benchmarks/results/memory-cpu.json was measured in.
LATENTS = ["latent.enabled=true", "latent.top_layers=null", "latent.n_per_layer=4", "latent.encoder=false",
           "latent.continuation_fraction=0", "latent.inner_steps=4"]
POLICIES = ("none", "full", "minimal", "save_mixer", "save_ffn", "save_cross_attention", "save_mixer_ffn")
MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
DEPTHS = (4, 8, 12, 24)
MIB = 2**20


def info(overrides: list[str], memory_scheduler: bool = True) -> dict:
  """`ltm info --json --compile` in a fresh process (XLA flags apply per process)."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "concurrency_optimized_scheduler" not in f]
  env["XLA_FLAGS"] = " ".join(flags + ([MEMORY_SCHEDULER] if memory_scheduler else []))
  cmd = [sys.executable, "-m", "ltm_jax", "info", "--config", CONFIG, "--json", "--compile", *overrides]
  result = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout)


def _memory_row(out: dict, baseline: int, **labels) -> dict:
  """One printed table row from `ltm info --compile` output; vs_none is temp bytes over the group's first row."""
  row = {**labels, "temp_MiB": out["compiled_temp_bytes"] / MIB, "vs_none": out["compiled_temp_bytes"] / baseline,
         "args_MiB": out["compiled_argument_bytes"] / MIB, "total_MiB": out["compiled_total_bytes"] / MIB,
         "compile_s": out["lower_seconds"] + out["compile_seconds"]}
  print(row, flush=True)
  return row


def remat_rows() -> list[dict]:
  rows = []
  for latents in (False, True):
    for scan in (False, True):
      baseline = None
      for policy in POLICIES:
        if not latents and policy in ("save_cross_attention", "save_mixer_ffn"):
          continue  # Without cross-attention these equal full-minus-norms and none.
        out = info([*SHAPE, *(LATENTS if latents else []), f"model.remat={policy}", f"model.scan_layers={scan}"])
        baseline = baseline or out["compiled_temp_bytes"]
        rows.append(_memory_row(out, baseline, latents=latents, scan_layers=scan, remat=policy, scheduler="memory"))
  baseline = None
  for policy in ("none", "full"):  # CPU's default scheduler, for comparison.
    out = info([*SHAPE, f"model.remat={policy}"], memory_scheduler=False)
    baseline = baseline or out["compiled_temp_bytes"]
    rows.append(_memory_row(out, baseline, latents=False, scan_layers=False, remat=policy, scheduler="cpu-default"))
  return rows


def depth_rows(repeats: int = 2) -> list[dict]:
  rows = []
  for scan in (False, True):
    first = None
    for depth in DEPTHS:
      runs = [info([*SHAPE, f"model.n_layers={depth}", f"model.scan_layers={scan}"]) for _ in range(repeats)]
      best = min(runs, key=lambda r: r["lower_seconds"] + r["compile_seconds"])
      total = best["lower_seconds"] + best["compile_seconds"]
      first = first or total
      rows.append({"scan_layers": scan, "n_layers": depth, "params_M": best["params"] / 1e6,
                   "lower_s": best["lower_seconds"], "compile_s": best["compile_seconds"], "total_s": total,
                   "vs_4_layers": total / first, "temp_MiB": best["compiled_temp_bytes"] / MIB})
      print(rows[-1], flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", choices=("remat", "depth"), default=None)
  args = parser.parse_args()
  path = common.RESULTS / f"memory-{common.device_name()}.json"
  previous = json.loads(path.read_text())["results"] if path.exists() else {}
  results = {"remat": previous.get("remat", []), "depth": previous.get("depth", [])}
  if args.only in (None, "remat"):
    results["remat"] = remat_rows()
  if args.only in (None, "depth"):
    results["depth"] = depth_rows()
  print("\n(a) train step temp bytes per remat policy: base_125m, seq 2048, batch 1")
  common.print_table(results["remat"], ("latents", "scan_layers", "scheduler", "remat", "temp_MiB", "vs_none",
                                        "total_MiB", "compile_s"))
  print("\n(b) trace + lower + compile seconds against depth (base_125m, no remat; best of 2)")
  common.print_table(results["depth"], ("scan_layers", "n_layers", "params_M", "lower_s", "compile_s", "total_s",
                                        "vs_4_layers", "temp_MiB"))
  common.write_results("memory", results, config=CONFIG, overrides=SHAPE, latent_overrides=LATENTS,
                       memory_scheduler_flag=MEMORY_SCHEDULER)
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
