"""Latent thoughts on real text big enough to matter: the windowed decoder with and without latents on the
Python-source corpus (configs/ltm_code.py, configs/ltm_code_plain.py), at equal tokens.

  ltm build-corpus --out runs/corpus-py                 # once (seconds)
  python benchmarks/latent_code.py                      # every variant (hours on 2 CPU cores)
  python benchmarks/latent_code.py --only plain ltm
  python benchmarks/latent_code.py --only ltm_equal_flops --plain-from benchmarks/results/latent-code-cpu.json \
      --name latent-code-equal-flops                    # the latent model at the plain twin's training FLOPs

Each variant trains in ROOT/<name> (resumable) on the same batches, then is evaluated by `ltm eval`'s full
evaluation on the same validation windows: continuation_ppl (z fitted on the first half of each 512-byte window,
the second half scored) is the number comparable between the latent and the plain decoder; `shuffled_cost` and
`prior_cost` are what z fitted on another window, or drawn from the prior, costs against the window's own z (nats
per byte over whole windows): how much the decoder reads z. `vs_plain` divides the final continuation perplexities;
`vs_plain_equal_tokens` divides the training-time validation curves at the last token count both runs reached, which
stays fair when a run was stopped early with --stop-at. Writes benchmarks/results/<name>-<device>.json and a
plot of continuation perplexity against training tokens (<name>-<device>.png).
"""

from __future__ import annotations

import json
import pathlib

import common  # First: puts the checkout on sys.path.
import latent_gpu
import latent_runs

from ltm_jax import flops

LTM, PLAIN = "configs/ltm_code.py", "configs/ltm_code_plain.py"
VARIANTS = {
    "plain": (PLAIN, [], "the windowed decoder (receptive field 125 bytes) without latents"),
    "ltm": (LTM, [], "latents: encoder proposal + 2 inner steps, continuation training"),
    # The plain decoder's 2500 steps (20.5 M tokens) cost the training FLOPs of 1670 latent steps (ltm_jax.flops).
    "ltm_equal_flops": (LTM, ["train.steps=1670"], "latents, trained for the plain decoder's training FLOPs"),
}
COLUMNS = ("model", "train_s", "train_tokens", "continuation_ppl", "vs_plain", "vs_plain_equal_tokens", "nll", "kl",
           "shuffled_cost", "prior_cost", "active_units")


def main():
  parser = latent_runs.comparison_parser(__doc__.splitlines()[0], VARIANTS, "latent-code", "16 x 512 bytes")
  parser.add_argument("--plain-from", default=None,
                      help="without the plain variant: an earlier results file whose plain row and curve to compare "
                           "against (trained on the same batches)")
  args = parser.parse_args()

  def costs(row):
    if row["shuffled_nll"] is None:
      return row
    return {**row, "shuffled_cost": row["shuffled_nll"] - row["nll"], "prior_cost": row["prior_nll"] - row["nll"]}

  rows, curves = latent_runs.run_variants(VARIANTS, args.only or list(VARIANTS), pathlib.Path(args.root),
                                          eval_batches=args.eval_batches, curve_steps=args.curve, steps=args.steps,
                                          stop_at=args.stop_at, row_fn=costs, columns=COLUMNS)
  if "plain" not in curves and args.plain_from:  # The plain twin of an earlier run, on the same batches.
    earlier = json.loads(pathlib.Path(args.plain_from).read_text())
    rows.insert(0, {**next(r for r in earlier["results"] if r["model"] == "plain"), "from": args.plain_from})
    curves = {"plain": earlier["config"]["curves"]["plain"], **curves}
  plain = next((r["continuation_ppl"] for r in rows if r["model"] == "plain"), None)
  for row in rows:
    row["vs_plain"] = row["continuation_ppl"] / plain if plain else None
    row["vs_plain_equal_tokens"] = latent_runs.at_equal_tokens(curves, row["model"], "plain")
  common.print_table(rows, COLUMNS)
  out = common.write_results(args.name, rows, eval_batches=args.eval_batches, curves=curves)
  latent_runs.plot(curves, out.with_suffix(".png"), "Python source: second halves of 512-byte windows (window 32)")
  # The same curves against training FLOPs (ltm_jax.flops, what `ltm info` prints) as well as tokens.
  per_token = {name: flops.flops_per_token(cfg.model, cfg.latent, cfg.train.seq_len)[1] for name, cfg in
               ((name, latent_runs.load_config(VARIANTS[name][0], VARIANTS[name][1])) for name in curves)}
  latent_gpu.plot({"Python source, equal tokens and equal training FLOPs": {"curves": {
      name: [{**p, "pflops": p["tokens"] * per_token[name] / 1e15} for p in points]
      for name, points in curves.items()}}}, out.with_name(out.stem + "-flops.png"))
  print(f"wrote {out}, {out.with_suffix('.png')} and {out.with_name(out.stem + '-flops.png')}")


if __name__ == "__main__":
  main()
