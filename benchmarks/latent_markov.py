"""Latent thoughts where the answer is known: documents from per-document random Markov chains
(configs/ltm_markov.py), scored on their second halves against three closed-form predictors.

  python benchmarks/latent_markov.py                    # every variant (hours on 2 CPU cores)
  python benchmarks/latent_markov.py --only plain ltm   # some of them
  python benchmarks/latent_markov.py --steps 200 --root /tmp/markov --name latent-markov-quick   # a short run
  python benchmarks/latent_markov.py --eval-inner-steps 8 32   # latent rows again, z fitted by 8 and 32 inner steps
  python benchmarks/latent_markov.py --only ltm ltm_then8       # ltm, then 500 more of its steps at 8 inner steps

The references, in nats per symbol over the same positions of the same validation documents:
  oracle   knows each document's chain;
  bayes    the Bayes-optimal predictor from everything earlier in the document (Dirichlet-multinomial counts);
  window   the Bayes predictor from only the last R symbols, R the windowed decoder's receptive field: the best a
           windowed decoder without z can do;
  memory   the same plus every transition of the first half: what a windowed decoder reading a z that holds the
           first half's statistics exactly can do.
`closed` is the fraction of the window-to-bayes gap a model closes: (window - nll) / (window - bayes); 1 is the
Bayes optimum, 0 the best any decoder limited to its window can reach, negative worse than that.
`vs_plain_equal_tokens` divides the training-time validation continuation perplexities of a variant and of the plain
decoder at the last token count both reached (fair to a run stopped early with --stop-at).

Each variant trains in ROOT/<name> (resumable) on the same stream of training documents (seed 0), then is evaluated
by `ltm eval`'s full evaluation (z fitted on the first half of each document, the second half scored). Prints one row
per variant, writes benchmarks/results/<name>-<device>.json with the rows, the references and every run's validation
curve, and plots continuation perplexity against training tokens (<name>-<device>.png).
"""

from __future__ import annotations

import math
import pathlib

import common  # First: puts the checkout on sys.path.
import latent_runs

from ltm_jax import data as data_lib
from ltm_jax.data import markov

LTM, PLAIN = "configs/ltm_markov.py", "configs/ltm_markov_plain.py"
# name -> (config, overrides, what it is).
VARIANTS = {
    "plain": (PLAIN, [], "the windowed decoder (receptive field 61) without latents"),
    "plain_full_attention": (PLAIN, ["model.window=none"], "the same decoder with full attention over 256 symbols"),
    "ltm": (LTM, [], "latents (16 per layer): the encoder's mean + 2 inner steps, continuation training"),
    "ltm_4latents": (LTM, ["latent.n_per_layer=4"], "the same with 4 latent vectors per layer"),
    "ltm_loop8": (LTM, ["latent.encoder=false", "latent.inner_steps=8", "latent.inner_lr=0.3"],
                  "latents inferred by 8 inner steps from the prior-like start, no encoder"),
    "ltm_then8": (LTM, ["latent.inner_steps=8", "train.steps=2500"],
                  "ltm's 2000 steps, then 500 more with 8 inner steps (the count that scored best at evaluation)"),
}
START_FROM = {"ltm_then8": "ltm"}  # Variants that continue another's training from its last checkpoint.
COLUMNS = ("model", "train_s", "train_tokens", "continuation_nll", "closed", "vs_plain_equal_tokens", "nll", "kl",
           "prior_nll", "shuffled_nll", "active_units")


def references(cfg, eval_batches: int) -> dict:
  """The closed-form losses over the positions `full_evaluation` scores for continuation (targets t >= T/2) of the
  validation documents it reads."""
  source = data_lib.open_source(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
  count = sum(len(b["targets"]) for b in source.validation_batches(cfg.train.batch_size, eval_batches))
  reach = cfg.model.receptive_field
  refs = markov.references(source.validation_documents(), range(count), window=reach,
                           score_from=cfg.train.seq_len // 2)
  return {**refs.as_dict(), "receptive_field": reach, "documents": count}


def main():
  parser = latent_runs.comparison_parser(__doc__.splitlines()[0], VARIANTS, "latent-markov", "16 documents")
  args = parser.parse_args()
  root = pathlib.Path(args.root)
  refs = references(latent_runs.load_config(PLAIN), args.eval_batches)
  print("references (nats/symbol, second halves): " + ", ".join(f"{k} {v:.4f}" for k, v in refs.items()
                                                                 if isinstance(v, float)))

  def closed(row):
    nll = math.log(row["continuation_ppl"])
    return {**row, "continuation_nll": nll, "closed": (refs["window"] - nll) / (refs["window"] - refs["bayes"])}

  rows, curves = latent_runs.run_variants(VARIANTS, args.only or list(VARIANTS), root, eval_batches=args.eval_batches,
                                          curve_steps=args.curve, steps=args.steps, stop_at=args.stop_at, row_fn=closed,
                                          columns=COLUMNS, start_from=START_FROM)
  rows += latent_runs.inner_step_rows(rows, root, args.eval_inner_steps, eval_batches=args.eval_batches,
                                      row_fn=closed, columns=COLUMNS)
  for row in rows:  # None for the rows of extra inner steps: their training curve is the trained count's.
    row["vs_plain_equal_tokens"] = latent_runs.at_equal_tokens(curves, row["model"], "plain")
  common.print_table(rows, COLUMNS)
  print("continuation_nll: nats/symbol on the second halves, z fitted on the first halves; references: " +
        ", ".join(f"{k} {refs[k]:.4f}" for k in ("oracle", "bayes", "memory", "window", "uniform")))
  out = common.write_results(args.name, rows, eval_batches=args.eval_batches, references=refs, curves=curves)
  latent_runs.plot(curves, out.with_suffix(".png"), "Markov documents: second halves, z fitted on the first halves",
                   references={k: math.exp(refs[k]) for k in ("oracle", "bayes", "memory", "window")})
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
