"""A latent model and its plain twin trained at equal tokens in pieces that each fit a time limit, then compared.

    ltm build-corpus --out runs/corpus-py                        # once: the Python-source corpus (~113 MB)
    python benchmarks/latent_recipe.py --deadline 540            # repeat until it reports "done"
    python benchmarks/latent_recipe.py --toy --deadline 300      # the whole recipe at toy sizes (CPU, minutes)

Every call continues both runs from their checkpoints in ROOT/{plain,ltm}: it trains whichever is behind to the next
boundary of --piece-steps (so the two never differ by more than one piece of tokens), and stops before a piece it
expects (from the pieces timed so far) to end past --deadline seconds. Each piece ends in a checkpoint and the
training loop's validation metrics, so the curve of continuation perplexity against tokens grows piece by piece.
Once both runs reach train.steps, both are evaluated by `ltm eval`'s full evaluation and the script writes
benchmarks/results/<name>-<device>.json (the table, tokens/s of each, their ratio, every validation curve) and the
plot <name>-<device>.png. The learning-rate schedule is that of train.steps throughout (`train(stop_at=...)`), so a
run trained in pieces is the run trained at once.

`--toy` shrinks both configs to a few seconds a piece (d_model 64, 2 layers, 2 x 128 tokens, window 32, 4 latent
vectors per layer, 2 inner steps) and trains on the embedded corpus: it proves the recipe end to end without a GPU.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import common  # First: puts the checkout on sys.path.
import jax
import latent_runs

LTM, PLAIN = "configs/ltm_paper.py", "configs/ltm_paper_plain.py"
TOY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.window=32", "model.max_seq_len=128",
       "model.dtype=float32", "data.source=embedded", "train.batch_size=2", "train.seq_len=128", "train.steps=12",
       "train.warmup_steps=2", "train.eval_every=4", "train.eval_batches=1", "train.checkpoint_every=4",
       "train.log_every=4"]
TOY_LATENT = ["latent.n_per_layer=4", "latent.inner_steps=2"]
COLUMNS = ("model", "steps", "train_tokens", "train_s", "tokens_per_s", "continuation_ppl", "vs_plain", "nll", "kl",
           "prior_nll", "shuffled_nll")


def tokens_per_second(workdir: pathlib.Path) -> float | None:
  """The median training throughput logged in the workdir's metrics.jsonl (compilation and evaluations excluded)."""
  rates = sorted(row["tokens_per_sec"] for row in latent_runs.metrics_rows(workdir) if "tokens_per_sec" in row)
  return rates[len(rates) // 2] if rates else None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ltm", default=LTM, help="the latent config")
  parser.add_argument("--plain", default=PLAIN, help="its twin without latents")
  parser.add_argument("--root", default=str(common.ROOT / "runs" / "latent-recipe"))
  parser.add_argument("--piece-steps", type=int, default=None, help="steps per piece (default: train.eval_every)")
  parser.add_argument("--deadline", type=float, default=540.0, help="seconds this call may run")
  parser.add_argument("--eval-batches", type=int, default=16, help="validation batches of the final evaluation")
  parser.add_argument("--toy", action="store_true", help="both configs at toy sizes on the embedded corpus")
  parser.add_argument("--name", default=None, help="results file (default latent-recipe, latent-recipe-toy with --toy)")
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to both configs")
  args = parser.parse_args()
  started = time.time()
  root = pathlib.Path(args.root)
  root.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(root / "jax-cache"))  # Later pieces skip recompiling.
  overrides = (TOY if args.toy else []) + list(args.overrides)
  configs = {"plain": latent_runs.load_config(args.plain, overrides),
             "ltm": latent_runs.load_config(args.ltm, overrides + (TOY_LATENT if args.toy else []))}
  steps = configs["ltm"].train.steps
  if configs["plain"].train.steps != steps or any(
      (c.train.batch_size, c.train.seq_len) != (configs["ltm"].train.batch_size, configs["ltm"].train.seq_len)
      for c in configs.values()):
    raise SystemExit("the two configs must train the same steps of the same batch shape (equal tokens)")
  piece = args.piece_steps or configs["ltm"].train.eval_every
  done = {name: latent_runs.trained(root / name) for name in configs}
  step_seconds: dict[str, float] = {}  # Per step, from this call's pieces (the first includes compiling).
  while min(info["steps"] for info in done.values()) < steps:
    name = min(done, key=lambda n: (done[n]["steps"], n != "plain"))  # The run behind; plain first on a tie.
    before = done[name]["steps"]
    target = min(steps, (before // piece + 1) * piece)
    expected = step_seconds.get(name, 0.0) * (target - before)
    if time.time() - started + expected > args.deadline:
      print(f"stopping before {name} steps {before}->{target} (expected {expected:.0f} s; "
            f"{time.time() - started:.0f} of {args.deadline:.0f} s used): run again to continue")
      return
    begun = time.time()
    done[name] = latent_runs.train_variant(name, configs[name], root, stop_at=target)
    step_seconds[name] = (time.time() - begun) / (target - before)
    print(f"{name}: step {done[name]['steps']}/{steps} ({time.time() - begun:.0f} s this piece)", flush=True)
  rows, curves = [], {}
  for name, cfg in configs.items():
    metrics = latent_runs.evaluate_variant(root / name, args.eval_batches, curve_steps=())
    rows.append({"model": name, "config": args.ltm if name == "ltm" else args.plain, "overrides": overrides,
                 **done[name], "tokens_per_s": tokens_per_second(root / name), **metrics})
    curves[name] = latent_runs.validation_curve(root / name)
  plain_ppl = rows[0]["continuation_ppl"]
  for row in rows:
    row["vs_plain"] = row["continuation_ppl"] / plain_ppl
  common.print_table(rows, COLUMNS)
  speed = {row["model"]: row["tokens_per_s"] for row in rows}
  ratio = speed["plain"] / speed["ltm"] if speed["plain"] and speed["ltm"] else math.nan
  print(f"latent step cost: {ratio:.2f}x a plain step (tokens/s {speed['plain']:.0f} plain, {speed['ltm']:.0f} ltm)")
  name = args.name or ("latent-recipe-toy" if args.toy else "latent-recipe")
  out = common.write_results(name, rows, overrides=overrides, piece_steps=piece, step_cost_ratio=ratio,
                             curves=curves)
  latent_runs.plot(curves, out.with_suffix(".png"), "Continuation perplexity at equal tokens (second halves)")
  print(f"done: wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
