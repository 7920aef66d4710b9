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
import pathlib

import common  # First: puts the checkout on sys.path.
import latent_runs

from ltm_jax.train.evaluation import CURVE_STEPS

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
    "ltm_amortized_500": (LTM, ["latent.continuation_fraction=1.0", "latent.encoder=true", "latent.inner_steps=2",
                                "latent.inner_lr=0.1", "train.steps=500"],
                          "continuation training, twice as long, z from an encoder's proposal refined by 2 inner "
                          "steps"),
    "ltm_logvar1": (LTM, ["latent.init_logvar=-1"], "initial posterior variance e^-1 (tiny_ltm's)"),
    "plain_full_attention": (PLAIN, ["model.window=none"],
                             "the plain decoder with full attention over the 512 bytes: what unlimited context gives"),
    "ltm_full_attention": (LTM, ["model.window=none"],
                           "latents over a full-attention decoder (no window): z has nothing to carry"),
}
COLUMNS = ("model", "train_s", "train_tokens", "nll", "kl", "elbo_ppl", "continuation_ppl", "prior_nll", "shuffled_nll",
           "active_units", "mu_abs")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run (default: all)")
  parser.add_argument("--stop-at", type=int, default=None,
                      help="stop every variant's training at this step of its schedule (a run already past it stays)")
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
  curve_steps = () if args.no_curve else CURVE_STEPS

  def train_variant(name, steps=None):
    path, overrides, _ = VARIANTS[name]
    return latent_runs.train_variant(name, latent_runs.load_config(path, overrides, steps), root, args.stop_at)

  for name in names:
    steps = None
    if name == "plain_wallclock":  # As many plain steps as fit in the latent model's training time.
      plain, ltm = trained.get("plain") or train_variant("plain"), trained.get("ltm") or train_variant("ltm")
      steps = round(plain["steps"] * ltm["train_s"] / plain["train_s"])
    trained[name] = train_variant(name, steps)
    metrics = latent_runs.evaluated(root / name, trained[name]["steps"], args.eval_batches, curve_steps)
    rows.append({"model": name, "config": VARIANTS[name][0], "overrides": VARIANTS[name][1], **trained[name],
                 **metrics})
    curves[name] = latent_runs.validation_curve(root / name)
    common.print_table(rows[-1:], COLUMNS)
    for steps_at_eval in args.inner_steps if VARIANTS[name][0] == LTM else []:
      metrics = latent_runs.evaluate_variant(root / name, args.eval_batches,
                                             overrides=[f"latent.inner_steps={steps_at_eval}"])
      rows.append({"model": f"{name}@{steps_at_eval}", "config": VARIANTS[name][0], "overrides": VARIANTS[name][1],
                   "eval_inner_steps": steps_at_eval, **trained[name], **metrics})
      common.print_table(rows[-1:], COLUMNS)
  common.print_table(rows, COLUMNS)
  print("elbo_ppl is an upper bound for latent models and exact for the plain decoder; continuation_ppl (z fitted "
        "on the first half, second half scored) is the number comparable between them.")
  out = common.write_results(args.name, rows, eval_batches=args.eval_batches, curves=curves)
  latent_runs.plot(curves, out.with_suffix(".png"),
                   "Second half of 512-byte windows, z fitted on the first half (window 32)")
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
