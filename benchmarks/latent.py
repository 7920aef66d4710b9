"""Trains the tiny config with and without latent thought vectors for the same steps and tokens, then evaluates both
with `ltm eval`'s full evaluation on the same validation windows, and prints one row per model.

  python benchmarks/latent.py                  # 300 steps each (about 15 minutes on 2 CPU cores)
  python benchmarks/latent.py --steps 900      # the demo's length

Writes benchmarks/results/latent-<device>.json.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import common  # First: puts the checkout on sys.path.

from ltm_jax import config as config_lib
from ltm_jax import data as data_lib
from ltm_jax.api import load
from ltm_jax.train import train
from ltm_jax.train.evaluation import full_evaluation

CONFIGS = {"plain decoder": "configs/tiny.py", "latent thoughts": "configs/tiny_ltm.py"}
COLUMNS = ("model", "params", "train_s", "tok_per_s", "nll", "kl", "elbo_ppl", "continuation_ppl", "prior_nll",
           "shuffled_nll", "active_units", "eval_s")


def run(name: str, path: str, steps: int, eval_batches: int, workdir: pathlib.Path) -> dict:
  overrides = [f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
               f"train.warmup_steps={min(100, steps // 5)}"]
  cfg = config_lib.load_config(common.ROOT / path, overrides)
  result = train(cfg, workdir, progress=False)
  lm = load(workdir)
  splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
  batches = data_lib.eval_batches(splits.val, cfg.train.batch_size, cfg.train.seq_len, eval_batches)
  started = time.time()
  metrics = full_evaluation(lm.model, lm.params, batches, seed=0, bytes_per_token=lm.tokenizer.bytes_per_token)
  return {"model": name, "config": path, "params": lm.num_params, "train_s": result.seconds,
          "tok_per_s": steps * cfg.train.batch_size * cfg.train.seq_len / result.seconds,
          "eval_s": time.time() - started, **metrics}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--eval-batches", type=int, default=4)
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for i, (name, path) in enumerate(CONFIGS.items()):
      rows.append(run(name, path, args.steps, args.eval_batches, pathlib.Path(tmp) / str(i)))
  common.print_table(rows, COLUMNS)
  print("elbo_ppl is an upper bound for the latent model and exact for the plain decoder; continuation_ppl (z "
        "fitted on the first half, second half scored) is the number comparable between them.")
  print(f"wrote {common.write_results('latent', rows, steps=args.steps, eval_batches=args.eval_batches)}")


if __name__ == "__main__":
  main()
