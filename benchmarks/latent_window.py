"""Latent thoughts in the windowed regime: configs/ltm_window.py (and variants) against its twin without latents,
trained on the same tokens, evaluated by `ltm eval`'s full evaluation on the same validation windows.

  python benchmarks/latent_window.py                         # every variant (hours on 2 CPU cores)
  python benchmarks/latent_window.py --only plain ltm        # some of them
  python benchmarks/latent_window.py --list                  # the variants and what each changes
  python benchmarks/latent_window.py --only ltm_cont100 --inner-steps 16 32 --no-curve --name latent-window-inner
                                                             # + rows evaluated with more inner steps than trained

Each variant trains in runs/latent-window/<name> (an interrupted or finished run resumes; a finished one is only
evaluated). `plain_wallclock` trains the plain twin for as long as the `ltm` variant took. Prints one row per
variant, writes benchmarks/results/latent-window-<device>.json with the rows and every run's validation curve, and
plots validation continuation perplexity against training tokens (latent-window-<device>.png).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import common  # First: puts the checkout on sys.path.

from ltm_jax import config as config_lib
from ltm_jax import data as data_lib
from ltm_jax.api import load
from ltm_jax.train import train
from ltm_jax.train.evaluation import CURVE_STEPS, full_evaluation

LTM, PLAIN = "configs/ltm_window.py", "configs/ltm_window_plain.py"
# name -> (config, overrides, what it is). Every variant trains the same steps on the same batches.
VARIANTS = {
    "plain": (PLAIN, [], "the windowed decoder without latents"),
    "plain_wallclock": (PLAIN, [], "the same, trained for the wall-clock time of `ltm` (more steps)"),
    "ltm": (LTM, [], "latents, decoder trained on z from the posterior fitted on the whole sequence"),
    "ltm_iterates": (LTM, ["latent.decoder_objective=iterates"], "... on the mean over the inner iterates"),
    "ltm_cont50": (LTM, ["latent.continuation_fraction=0.5"],
                   "half of each batch trained on continuation (z fitted on a prefix, the rest scored)"),
    "ltm_cont100": (LTM, ["latent.continuation_fraction=1.0"], "every sequence trained on continuation"),
    "ltm_cont100_8latents": (LTM, ["latent.continuation_fraction=1.0", "latent.n_per_layer=8"],
                             "continuation training with 8 latent vectors per layer (the reference's count)"),
    "plain_500": (PLAIN, ["train.steps=500"], "the plain decoder trained twice as long (4.1 M tokens)"),
    "ltm_cont100_500": (LTM, ["latent.continuation_fraction=1.0", "train.steps=500"],
                        "continuation training, twice as long"),
    "ltm_logvar1": (LTM, ["latent.init_logvar=-1"], "initial posterior variance e^-1 (tiny_ltm's)"),
    "plain_full_attention": (PLAIN, ["model.window=none"],
                             "the plain decoder with full attention over the 512 bytes: what unlimited context gives"),
    "ltm_full_attention": (LTM, ["model.window=none"],
                           "latents over a full-attention decoder (no window): z has nothing to carry"),
}
COLUMNS = ("model", "train_s", "train_tokens", "nll", "kl", "elbo_ppl", "continuation_ppl", "prior_nll", "shuffled_nll",
           "active_units", "mu_abs")


def train_variant(name: str, root: pathlib.Path, steps: int | None = None) -> dict:
  path, overrides, _ = VARIANTS[name]
  overrides = list(overrides) + ([f"train.steps={steps}"] if steps else [])
  cfg = config_lib.load_config(common.ROOT / path, overrides)
  workdir = root / name
  record = workdir / "bench-train.json"
  if record.exists() and json.loads(record.read_text())["steps"] == cfg.train.steps:
    return json.loads(record.read_text())
  result = train(cfg, workdir, progress=False)
  if result.step < cfg.train.steps:
    raise SystemExit(f"{name}: training stopped at step {result.step} (signal {result.interrupted_by}); rerun to resume")
  info = {"steps": cfg.train.steps, "train_s": result.seconds,
          "train_tokens": cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len}
  record.write_text(json.dumps(info) + "\n")
  return info


def evaluate_variant(name: str, root: pathlib.Path, eval_batches: int, curve: bool,
                     inner_steps: int | None = None) -> dict:
  lm = load(root / name, overrides=[f"latent.inner_steps={inner_steps}"] if inner_steps else [])
  t = lm.config.train
  splits = data_lib.load_splits(lm.config.data, lm.config.model.vocab_size, t.seq_len)
  batches = data_lib.eval_batches(splits.val, t.batch_size, t.seq_len, eval_batches)
  return full_evaluation(lm.model, lm.params, batches, seed=0, bytes_per_token=lm.tokenizer.bytes_per_token,
                         curve_steps=CURVE_STEPS if curve else ())


def validation_curve(workdir: pathlib.Path) -> list[dict]:
  """(tokens, val_continuation_ppl, val_nll, val_shuffled_nll, val_prior_nll, val_kl) at every training eval."""
  keys = ("tokens", "val_continuation_ppl", "val_nll", "val_shuffled_nll", "val_prior_nll", "val_kl")
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  return [{k: row[k] for k in keys if k in row} for row in rows if "val_continuation_ppl" in row]


def plot(curves: dict[str, list[dict]], out: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, points in curves.items():
    ax.plot([p["tokens"] / 1e6 for p in points], [p["val_continuation_ppl"] for p in points], marker="o",
            label=name, linestyle="--" if name.startswith("plain") else "-")
  ax.set_xlabel("training tokens (M)")
  ax.set_ylabel("validation continuation perplexity")
  ax.set_title("Second half of 512-byte windows, z fitted on the first half (window 32)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run (default: all)")
  parser.add_argument("--eval-batches", type=int, default=8, help="validation batches of 16 x 512 bytes")
  parser.add_argument("--no-curve", action="store_true", help="skip the ELBO-vs-inner-steps curve")
  parser.add_argument("--root", default=str(common.ROOT / "runs" / "latent-window"))
  parser.add_argument("--name", default="latent-window", help="results file: benchmarks/results/NAME-<device>.json")
  parser.add_argument("--inner-steps", type=int, nargs="*", default=[],
                      help="also evaluate each latent variant with these inner steps (latent.inner_steps at eval only)")
  parser.add_argument("--list", action="store_true")
  args = parser.parse_args()
  if args.list:
    for name, (path, overrides, what) in VARIANTS.items():
      print(f"{name:20s} {path} {' '.join(overrides)}\n{'':20s} {what}")
    return
  root = pathlib.Path(args.root)
  root.mkdir(parents=True, exist_ok=True)
  names = args.only or list(VARIANTS)
  rows, curves, trained = [], {}, {}
  for name in names:
    steps = None
    if name == "plain_wallclock":  # As many plain steps as fit in the latent model's training time.
      plain, ltm = trained.get("plain") or train_variant("plain", root), trained.get("ltm") or train_variant("ltm", root)
      steps = round(plain["steps"] * ltm["train_s"] / plain["train_s"])
    trained[name] = train_variant(name, root, steps)
    metrics = evaluate_variant(name, root, args.eval_batches, curve=not args.no_curve)
    rows.append({"model": name, "config": VARIANTS[name][0], "overrides": VARIANTS[name][1], **trained[name],
                 **metrics})
    curves[name] = validation_curve(root / name)
    common.print_table(rows[-1:], COLUMNS)
    for steps_at_eval in args.inner_steps if VARIANTS[name][0] == LTM else []:
      metrics = evaluate_variant(name, root, args.eval_batches, curve=False, inner_steps=steps_at_eval)
      rows.append({"model": f"{name}@{steps_at_eval}", "config": VARIANTS[name][0], "overrides": VARIANTS[name][1],
                   "eval_inner_steps": steps_at_eval, **trained[name], **metrics})
      common.print_table(rows[-1:], COLUMNS)
  common.print_table(rows, COLUMNS)
  print("elbo_ppl is an upper bound for latent models and exact for the plain decoder; continuation_ppl (z fitted "
        "on the first half, second half scored) is the number comparable between them.")
  out = common.write_results(args.name, rows, eval_batches=args.eval_batches, curves=curves)
  plot(curves, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
