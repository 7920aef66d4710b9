"""GunPoint test accuracy of configs/ts_gunpoint.py (the dual-branch RWKV-7 time-series model), per variant.

  python benchmarks/gunpoint.py                              # every variant (about 2-3 minutes each on 2 quiet cores)
  python benchmarks/gunpoint.py --variants seed0 no_spectrum # some of them

Each variant is `ltm train --config configs/ts_gunpoint.py` with its overrides, in runs/gunpoint/<variant> (a finished
run is not repeated; an interrupted one resumes). The test split is scored once, at the last step; its row of the
run's metrics.jsonl is what the results file records. Writes benchmarks/results/gunpoint-<device>.json.
"""

from __future__ import annotations

import argparse
import pathlib

import common  # First: puts the checkout on sys.path.

from ltm_jax.config import load_config
from ltm_jax.train import train
from ltm_jax.train.metrics import read_metrics

VARIANTS = {  # name: overrides of configs/ts_gunpoint.py
    "seed0": [],
    "seed1": ["train.seed=1"],
    "seed2": ["train.seed=2"],
    "no_spectrum": ["timeseries.branch=none"],
}


def run(name: str, runs: pathlib.Path) -> dict:
  overrides = VARIANTS[name]
  cfg = load_config(str(common.ROOT / "configs" / "ts_gunpoint.py"), overrides)
  workdir = runs / name
  train(cfg, workdir, progress=False)  # A finished run only returns.
  rows = read_metrics(workdir)
  final = [row for row in rows if "test_accuracy" in row][-1]
  # Seconds in train steps (the logged per-step time over each logging interval), so a resumed run counts the same.
  timed = [row for row in rows if "step_seconds" in row]
  seconds = sum(row["step_seconds"] * (row["step"] - previous["step"])
                for previous, row in zip([{"step": 0}] + timed, timed))
  keys = ("step", "test_accuracy", "test_errors", "test_series", "test_loss", "accuracy", "loss")
  return {"variant": name, "overrides": overrides, **{k: final[k] for k in keys if k in final},
          "train_seconds": round(seconds)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--runs", default="runs/gunpoint")
  parser.add_argument("--name", default="gunpoint")
  args = parser.parse_args()
  rows = []
  for name in args.variants:
    rows.append(run(name, pathlib.Path(args.runs)))
    common.print_table(rows, ["variant", "test_accuracy", "test_errors", "train_seconds"])
  path = common.write_results(args.name, rows, config="configs/ts_gunpoint.py", runs=args.runs)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
