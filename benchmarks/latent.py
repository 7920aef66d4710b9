"""Latent thoughts against the plain decoder: every latent benchmark, one subcommand each.

  python benchmarks/latent.py twins                   # configs/tiny.py against tiny_ltm.py, full attention (15 min)
  python benchmarks/latent.py window --only plain ltm # the windowed regime, byte-level text (configs/ltm_window.py)
  python benchmarks/latent.py markov                  # Markov documents against closed-form references
  python benchmarks/latent.py code                    # the Python-source corpus (configs/ltm_code.py)
  python benchmarks/latent.py code --only ltm_equal_flops --plain-from benchmarks/results/latent-code-cpu.json \\
      --name latent-code-equal-flops                  # the latent model at the plain twin's training FLOPs
  python benchmarks/latent.py cost                    # a latent train step's time against a plain step's
  python benchmarks/latent.py prior --workdir runs/latent-window/ltm_cont100_500   # the learned prior against N(0, I)
  python benchmarks/latent.py recipe --deadline 540   # twins at equal tokens in pieces that fit a time limit
  python benchmarks/latent.py gpu --deadline 540 --corpus-archive .gpu/corpus-py.tar.xz --out $OUT  # one GPU session
  python benchmarks/latent.py gpu --toy --deadline 300                                              # its CPU proof
  python benchmarks/latent.py SUBCOMMAND --help       # every option; `--list` prints a comparison's variants

twins, window, markov and code are comparisons: each variant (config, overrides) trains in ROOT/<name> on the same
batches (resumable; a finished run is only evaluated), then `ltm eval`'s full evaluation scores it on the same
validation windows. continuation_ppl (z fitted on the first half of each window, the second half scored) is the number
comparable between a latent model and a plain decoder; elbo_ppl is an upper bound for latent models and exact for
plain ones. `vs_plain` divides final continuation perplexities by the plain variant's; `vs_plain_equal_tokens` divides
the training-time validation curves at the last token count both runs reached, which stays fair when a run was
stopped early with --stop-at. `--eval-inner-steps N ...` adds a row per latent variant evaluated with z fitted by N
inner steps. Each writes benchmarks/results/<name>-<device>.json (rows, validation curves) and <name>-<device>.png
(continuation perplexity against training tokens).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import pathlib

import common  # First: puts the checkout on sys.path.
import latent_probes
import latent_runs
import latent_sessions

from ltm_jax.train.evaluation import CURVE_STEPS

NOTE = ("continuation_ppl (z fitted on the first half, second half scored) is the number comparable between latent "
        "and plain models; elbo_ppl is an upper bound for latent models and exact for plain ones.")

# name -> (config, overrides, what it is), for each comparison.
TINY, TINY_LTM = "configs/tiny.py", "configs/tiny_ltm.py"
TWINS = {
    "plain": (TINY, [], "the tiny decoder, full attention over 128 bytes"),
    "ltm": (TINY_LTM, [], "the same plus cross-attention to 2 latent vectors per layer, 8 inner steps"),
}

WINDOW, WINDOW_PLAIN = "configs/ltm_window.py", "configs/ltm_window_plain.py"
WINDOW_VARIANTS = {
    "plain": (WINDOW_PLAIN, [], "the windowed decoder without latents"),
    "plain_wallclock": (WINDOW_PLAIN, [], "the same, trained for the wall-clock time of `ltm` (more steps)"),
    "ltm": (WINDOW, [], "latents, decoder trained on z from the posterior fitted on the whole sequence"),
    "ltm_iterates": (WINDOW, ["latent.decoder_objective=iterates"], "... on the mean over the inner iterates"),
    "ltm_cont50": (WINDOW, ["latent.continuation_fraction=0.5"],
                   "half of each batch trained on continuation (z fitted on a prefix, the rest scored)"),
    "ltm_cont100": (WINDOW, ["latent.continuation_fraction=1.0"], "every sequence trained on continuation"),
    "ltm_cont100_8latents": (WINDOW, ["latent.continuation_fraction=1.0", "latent.n_per_layer=8"],
                             "continuation training with 8 latent vectors per layer (the reference's count)"),
    "plain_500": (WINDOW_PLAIN, ["train.steps=500"], "the plain decoder trained twice as long (4.1 M tokens)"),
    "ltm_cont100_500": (WINDOW, ["latent.continuation_fraction=1.0", "train.steps=500"],
                        "continuation training, twice as long"),
    "ltm_amortized_500": (WINDOW, ["latent.continuation_fraction=1.0", "latent.encoder=true", "latent.inner_steps=2",
                                   "latent.inner_lr=0.1", "train.steps=500"],
                          "continuation training, twice as long, z from an encoder's proposal refined by 2 inner "
                          "steps"),
    "ltm_logvar1": (WINDOW, ["latent.init_logvar=-1"], "initial posterior variance e^-1 (tiny_ltm's)"),
    "plain_full_attention": (WINDOW_PLAIN, ["model.window=none"],
                             "the plain decoder with full attention over the 512 bytes: what unlimited context gives"),
    "ltm_full_attention": (WINDOW, ["model.window=none"],
                           "latents over a full-attention decoder (no window): z has nothing to carry"),
}

MARKOV, MARKOV_PLAIN = "configs/ltm_markov.py", "configs/ltm_markov_plain.py"
MARKOV_VARIANTS = {
    "plain": (MARKOV_PLAIN, [], "the windowed decoder (receptive field 61) without latents"),
    "plain_full_attention": (MARKOV_PLAIN, ["model.window=none"], "the same decoder with full attention over 256 "
                             "symbols"),
    "ltm": (MARKOV, [], "latents (16 per layer): the encoder's mean + 2 inner steps, continuation training"),
    "ltm_4latents": (MARKOV, ["latent.n_per_layer=4"], "the same with 4 latent vectors per layer"),
    "ltm_loop8": (MARKOV, ["latent.encoder=false", "latent.inner_steps=8", "latent.inner_lr=0.3"],
                  "latents inferred by 8 inner steps from the prior-like start, no encoder"),
    "ltm_then8": (MARKOV, ["latent.inner_steps=8", "train.steps=2500"],
                  "ltm's 2000 steps, then 500 more with 8 inner steps (the count that scored best at evaluation)"),
}
MARKOV_START_FROM = {"ltm_then8": "ltm"}  # Variants that continue another's training from its last checkpoint.

CODE, CODE_PLAIN = "configs/ltm_code.py", "configs/ltm_code_plain.py"
CODE_VARIANTS = {
    "plain": (CODE_PLAIN, [], "the windowed decoder (receptive field 125 bytes) without latents"),
    "ltm": (CODE, [], "latents: encoder proposal + 2 inner steps, continuation training"),
    # The plain decoder's 2500 steps (20.5 M tokens) cost the training FLOPs of 1670 latent steps (ltm_jax.flops).
    "ltm_equal_flops": (CODE, ["train.steps=1670"], "latents, trained for the plain decoder's training FLOPs"),
}

COLUMNS = {
    "twins": ("model", "params", "train_s", "tok_per_s", "nll", "kl", "elbo_ppl", "continuation_ppl", "prior_nll",
              "shuffled_nll", "active_units", "eval_s"),
    "window": ("model", "train_s", "train_tokens", "nll", "kl", "elbo_ppl", "continuation_ppl", "prior_nll",
               "shuffled_nll", "active_units", "mu_abs"),
    "markov": ("model", "train_s", "train_tokens", "continuation_nll", "closed", "vs_plain_equal_tokens", "nll", "kl",
               "prior_nll", "shuffled_nll", "active_units"),
    "code": ("model", "train_s", "train_tokens", "continuation_ppl", "vs_plain", "vs_plain_equal_tokens", "nll", "kl",
             "shuffled_cost", "prior_cost", "active_units"),
}


def compare(args, variants: dict, columns, title: str, *, row_fn=None, overrides=(), steps_of=None,
            start_from=None, earlier=None, references=None) -> tuple[pathlib.Path, dict]:
  """The comparison every subcommand of this module runs: trains and evaluates args.only of `variants` (plus the
  --eval-inner-steps rows), adds vs_plain and vs_plain_equal_tokens, prints the table, writes the results file and
  the plot. `steps_of` (name -> steps) replaces --steps for those variants; `earlier` is (rows, curves) of runs read
  from an earlier results file, compared as if run here; `references` (name -> perplexity) are drawn as horizontal
  lines. Returns (results path, curves)."""
  root = pathlib.Path(args.root)
  rows, curves = latent_runs.run_variants(variants, args.only or list(variants), root, eval_batches=args.eval_batches,
                                          curve_steps=args.curve, steps=args.steps, steps_of=steps_of,
                                          stop_at=args.stop_at, overrides=overrides, row_fn=row_fn, columns=columns,
                                          start_from=start_from)
  rows += latent_runs.inner_step_rows(rows, root, args.eval_inner_steps, eval_batches=args.eval_batches,
                                      row_fn=row_fn, columns=columns)
  if earlier:
    rows, curves = earlier[0] + rows, {**earlier[1], **curves}
  plain = next((r["continuation_ppl"] for r in rows if r["model"] == "plain"), None)
  for row in rows:  # vs_plain_equal_tokens is None for the extra inner-step rows: their curve is the trained count's.
    row["vs_plain"] = row["continuation_ppl"] / plain if plain else None
    row["vs_plain_equal_tokens"] = latent_runs.at_equal_tokens(curves, row["model"], "plain")
  common.print_table(rows, columns)
  print(NOTE)
  extra = {"references": references} if references else {}
  out = common.write_results(args.name, rows, eval_batches=args.eval_batches, curves=curves, **extra)
  lines = {k: math.exp(references[k]) for k in ("oracle", "bayes", "memory", "window")} if references else None
  latent_runs.plot({title: curves}, out.with_suffix(".png"), references=lines)
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return out, curves


def twins(args):
  """configs/tiny.py and tiny_ltm.py trained for the same --steps on the same tokens (full attention)."""
  overrides = [f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}",
               f"train.warmup_steps={min(100, args.steps // 5)}"]
  compare(args, TWINS, COLUMNS["twins"], "Full attention, 128 bytes", overrides=overrides)


def window(args):
  """configs/ltm_window.py and its variants against the windowed twin; `plain_wallclock` trains the plain twin for
  as long as `ltm` took."""
  steps_of = {}
  if "plain_wallclock" in (args.only or WINDOW_VARIANTS):  # As many plain steps as fit in `ltm`'s training time.
    root = pathlib.Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    plain, ltm = (latent_runs.train_variant(name, latent_runs.load_config(*WINDOW_VARIANTS[name][:2], args.steps),
                                            root, args.stop_at) for name in ("plain", "ltm"))
    steps_of["plain_wallclock"] = round(plain["steps"] * ltm["train_s"] / plain["train_s"])
  compare(args, WINDOW_VARIANTS, COLUMNS["window"],
          "Second half of 512-byte windows, z fitted on the first half (window 32)", steps_of=steps_of)


def markov(args):
  """Documents from per-document random Markov chains (configs/ltm_markov.py), scored on their second halves against
  closed-form predictors in nats per symbol: `oracle` knows each document's chain; `bayes` is the Bayes-optimal
  predictor from everything earlier in the document; `window` the Bayes predictor from the last R symbols only (R
  the decoder's receptive field: the best a windowed decoder without z can do); `memory` the same plus every
  transition of the first half. `closed` = (window - nll) / (window - bayes): the fraction of the window-to-Bayes gap
  a model closes (1 the Bayes optimum, 0 the best any windowed decoder can reach)."""
  refs = latent_runs.markov_references(latent_runs.load_config(MARKOV_PLAIN), args.eval_batches)
  print("references (nats/symbol, second halves): " + ", ".join(f"{k} {v:.4f}" for k, v in refs.items()
                                                                 if isinstance(v, float)))

  def closed(row):
    nll = math.log(row["continuation_ppl"])
    return {**row, "continuation_nll": nll, "closed": (refs["window"] - nll) / (refs["window"] - refs["bayes"])}

  compare(args, MARKOV_VARIANTS, COLUMNS["markov"], "Markov documents: second halves, z fitted on the first halves",
          row_fn=closed, start_from=MARKOV_START_FROM, references=refs)


def code(args):
  """The windowed decoder with and without latents on the Python-source corpus (`ltm build-corpus --out
  runs/corpus-py` first). `shuffled_cost` and `prior_cost` are what z fitted on another window, or drawn from the
  prior, costs against the window's own z (nats per byte): how much the decoder reads z. Also plots the curves
  against training FLOPs (<name>-<device>-flops.png)."""

  def costs(row):
    if row["shuffled_nll"] is None:
      return row
    return {**row, "shuffled_cost": row["shuffled_nll"] - row["nll"], "prior_cost": row["prior_nll"] - row["nll"]}

  earlier = None
  if args.plain_from and "plain" not in (args.only or CODE_VARIANTS):  # The plain twin of an earlier run.
    results = json.loads(pathlib.Path(args.plain_from).read_text())
    earlier = ([{**next(r for r in results["results"] if r["model"] == "plain"), "from": args.plain_from}],
               {"plain": results["config"]["curves"]["plain"]})
  out, curves = compare(args, CODE_VARIANTS, COLUMNS["code"],
                        "Python source: second halves of 512-byte windows (window 32)", row_fn=costs, earlier=earlier)
  per_token = {name: latent_runs.train_flops(latent_runs.load_config(*CODE_VARIANTS[name][:2])) for name in curves}
  flops_curves = {name: [{**p, "pflops": p["tokens"] * per_token[name] / 1e15} for p in points]
                  for name, points in curves.items()}
  flops_plot = out.with_name(out.stem + "-flops.png")
  latent_runs.plot({"Python source, equal tokens and equal training FLOPs": flops_curves}, flops_plot,
                   axes=("pflops", "tokens"))
  print(f"wrote {flops_plot}")


COMPARISONS = {  # name -> (run, variants, default validation batches, what one batch is, ELBO curve, default steps)
    "twins": (twins, TWINS, 4, "32 x 128 bytes", CURVE_STEPS, 300),
    "window": (window, WINDOW_VARIANTS, 8, "16 x 512 bytes", CURVE_STEPS, None),
    "markov": (markov, MARKOV_VARIANTS, 16, "16 documents", (0, 2, 8), None),
    "code": (code, CODE_VARIANTS, 16, "16 x 512 bytes", (0, 2, 8), None),
}
RESULTS_NAMES = {"twins": "latent", "window": "latent-window", "markov": "latent-markov", "code": "latent-code"}


def list_variants(variants: dict) -> None:
  for name, (path, overrides, what) in variants.items():
    print(f"{name:22s} {path} {' '.join(overrides)}\n{'':22s} {what}")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  for name, (run, variants, eval_batches, batch, curve, steps) in COMPARISONS.items():
    sub = commands.add_parser(name, help=run.__doc__.splitlines()[0], description=inspect.cleandoc(run.__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    latent_runs.add_comparison_args(sub, variants, RESULTS_NAMES[name], eval_batches, batch, curve, steps)
    sub.set_defaults(run=lambda args, run=run, variants=variants: list_variants(variants) if args.list else run(args))
  commands.choices["code"].add_argument(
      "--plain-from", default=None, help="without the plain variant: an earlier results file whose plain row and "
      "curve to compare against (trained on the same batches)")
  latent_probes.register(commands)
  latent_sessions.register(commands)
  args = parser.parse_args()
  args.run(args)


if __name__ == "__main__":
  main()
