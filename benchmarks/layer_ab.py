"""A layer file against an earlier commit's version of it, in one process: the same config's train step timed with
each, in alternating rounds, so that both see the same machine load.

    python benchmarks/layer_ab.py --config configs/small_rwkv7.py --against HEAD~1 \
        --layer ltm_jax/layers/rwkv7.py --class TimeMix7 --into ltm_jax.sublayers \
        model.dtype=float32 train.batch_size=1 train.seq_len=512

`--against` names the commit whose `--layer` file is loaded beside the checkout's; `--class` is the class swapped
into the module `--into` (where the model looks it up). Each round compiles the step anew with each version and
times it (benchmarks/train.py's measure), the versions taking turns to go first; writes
benchmarks/results/<name>-<device>.json with every round and each version's median step.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile

import common
from train import measure

from ltm_jax import config as config_lib


def load_version(path: str, commit: str):
  """The module at `path` as it was at `commit`, imported under its own name."""
  source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=common.ROOT, check=True, capture_output=True,
                          text=True).stdout
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(source)
  name = f"against_{commit.replace('~', '_').replace('^', '_')}"
  spec = importlib.util.spec_from_file_location(name, f.name)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Flax's dataclass transform looks the module up.
  try:
    spec.loader.exec_module(module)
  finally:
    os.unlink(f.name)
  return module


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--against", required=True, help="the commit whose --layer file is compared")
  parser.add_argument("--layer", required=True, help="the layer file, relative to the checkout")
  parser.add_argument("--class", dest="cls", required=True)
  parser.add_argument("--into", required=True, help="the module whose attribute --class the model uses")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--name", default="layer-ab")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  cfg = config_lib.load_config(args.config, args.overrides)
  target = importlib.import_module(args.into)
  versions = {"checkout": getattr(target, args.cls),
              args.against: getattr(load_version(args.layer, args.against), args.cls)}
  rows = []
  for round_ in range(args.rounds):
    order = list(versions.items())
    for version, cls in order if round_ % 2 == 0 else order[::-1]:  # Neither version always runs first.
      setattr(target, args.cls, cls)
      row = {"round": round_, "version": version, **measure(cfg, args.steps)}
      rows.append(row)
      print(f"round {round_} {version}: {row['step_ms']:.1f} ms", flush=True)
  setattr(target, args.cls, versions["checkout"])
  medians = {v: statistics.median(r["step_ms"] for r in rows if r["version"] == v) for v in versions}
  ratio = medians["checkout"] / medians[args.against]
  print(f"median step ms: {medians}; checkout / {args.against} = {ratio:.3f}")
  common.print_table(rows, ["round", "version", "batch", "compile_s", "step_ms", "step_ms_min", "loss"])
  path = common.write_results(args.name, rows, config_file=args.config, overrides=args.overrides,
                              against=args.against, layer=args.layer, steps=args.steps, median_step_ms=medians,
                              ratio=ratio)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
