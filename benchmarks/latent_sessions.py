"""The subcommands of benchmarks/latent.py bounded by a time limit: `recipe` (twins at equal tokens in resumable
pieces) and `gpu` (latent model and plain twins at equal compute, in one lent GPU session)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import pathlib
import shutil
import tarfile
import time

import common  # First: puts the checkout on sys.path.
import jax
import latent_runs

from ltm_jax.data import pycorpus

# A model of a few seconds a piece on the CPU (both configs; the latent one adds RECIPE_TOY_LATENT).
RECIPE_TOY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.window=32", "model.max_seq_len=128",
              "model.dtype=float32", "data.source=embedded", "train.batch_size=2", "train.seq_len=128",
              "train.steps=12", "train.warmup_steps=2", "train.eval_every=4", "train.eval_batches=1",
              "train.checkpoint_every=4", "train.log_every=4"]
RECIPE_TOY_LATENT = ["latent.n_per_layer=4", "latent.inner_steps=2"]
RECIPE_COLUMNS = ("model", "steps", "train_tokens", "train_s", "tokens_per_s", "continuation_ppl", "vs_plain", "nll",
                  "kl", "prior_nll", "shuffled_nll")


def recipe(args):
  """A latent model and its plain twin trained at equal tokens in pieces that each fit a time limit, then compared.

  Every call continues both runs from their checkpoints in ROOT/{plain,ltm}: it trains whichever is behind to the
  next boundary of --piece-steps (so the two never differ by more than one piece of tokens), and stops before a piece
  it expects (from the pieces timed so far) to end past --deadline seconds; repeat until it reports "done". The
  learning-rate schedule is that of train.steps throughout (`train(stop_at=...)`), so a run trained in pieces is the
  run trained at once. Once both reach train.steps, both are evaluated by `ltm eval`'s full evaluation and the
  results file holds the table, tokens/s of each, their ratio and every validation curve.

  `--toy` shrinks both configs to a few seconds a piece (d_model 64, 2 layers, 2 x 128 tokens, window 32, 4 latent
  vectors per layer, 2 inner steps) on the embedded corpus: the recipe end to end without a GPU."""
  started = time.time()
  root = pathlib.Path(args.root)
  root.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(root / "jax-cache"))  # Later pieces skip recompiling.
  overrides = (RECIPE_TOY if args.toy else []) + list(args.overrides)
  configs = {"plain": latent_runs.load_config(args.plain, overrides),
             "ltm": latent_runs.load_config(args.ltm, overrides + (RECIPE_TOY_LATENT if args.toy else []))}
  steps = configs["ltm"].train.steps
  if len({(c.train.steps, c.train.batch_size, c.train.seq_len) for c in configs.values()}) > 1:
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
  for name in configs:
    metrics = latent_runs.evaluate_variant(root / name, args.eval_batches)
    rows.append({"model": name, "config": args.ltm if name == "ltm" else args.plain, "overrides": overrides,
                 **done[name], "tokens_per_s": latent_runs.tokens_per_second(root / name), **metrics})
    curves[name] = latent_runs.validation_curve(root / name)
  for row in rows:
    row["vs_plain"] = row["continuation_ppl"] / rows[0]["continuation_ppl"]
  common.print_table(rows, RECIPE_COLUMNS)
  speed = {row["model"]: row["tokens_per_s"] for row in rows}
  ratio = speed["plain"] / speed["ltm"] if speed["plain"] and speed["ltm"] else math.nan
  print(f"latent step cost: {ratio:.2f}x a plain step (tokens/s {speed['plain']:.0f} plain, {speed['ltm']:.0f} ltm)")
  out = common.write_results(args.name or ("latent-recipe-toy" if args.toy else "latent-recipe"), rows,
                             overrides=overrides, piece_steps=piece, step_cost_ratio=ratio, curves=curves)
  latent_runs.plot({"Continuation perplexity at equal tokens (second halves)": curves}, out.with_suffix(".png"))
  print(f"done: wrote {out} and {out.with_suffix('.png')}")


@dataclasses.dataclass(frozen=True)
class Part:
  ltm: str
  plain: str
  overrides: tuple[str, ...]  # Applied to both configs.
  share: float = 1.0  # Of the time left when the part starts (the last part takes all of it).
  equal_tokens: bool = True  # Also train the plain twin at the latent model's tokens.
  corpus: bool = True


# Steps are a plan: the deadline stops a run that would not end in time (see `gpu`).
PARTS = {
    "code": Part("configs/ltm_code.py", "configs/ltm_code_plain.py",
                 ("train.steps=2500", "train.eval_every=250", "train.checkpoint_every=100000", "train.log_every=250"),
                 share=0.45, equal_tokens=False),  # The CPU record holds the plain twin at these tokens.
    "markov": Part("configs/ltm_markov.py", "configs/ltm_markov_plain.py",
                   ("train.batch_size=64", "train.steps=4000", "train.warmup_steps=200", "train.eval_every=500",
                    "train.checkpoint_every=100000", "train.log_every=500"), share=0.55, corpus=False),
    "code_gpu": Part("configs/ltm_paper.py", "configs/ltm_paper_plain.py",
                     ("train.steps=2000", "train.warmup_steps=200", "train.eval_every=250",
                      "train.checkpoint_every=100000", "train.log_every=250"), equal_tokens=False),
}
GPU_TOY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.window=8", "model.max_seq_len=64",
           "model.dtype=float32", "train.batch_size=4", "train.seq_len=64", "train.steps=16", "train.warmup_steps=2",
           "train.eval_every=8", "train.eval_batches=1", "train.checkpoint_every=100000", "train.log_every=8")
EVAL_SHARE = 0.25  # Of a part's time, kept for the final evaluations.
EVAL_INNER_STEPS = 8
GPU_COLUMNS = ("part", "model", "steps", "of_steps", "train_tokens", "train_pflops", "train_s", "continuation_ppl",
               "continuation_nll", "closed", "nll", "kl", "shuffled_nll", "prior_nll")


def corpus_ready(archive: str | None) -> None:
  """runs/corpus-py as the configs name it: there already, unpacked from `archive`, or built from the installed
  packages at the versions pycorpus pins."""
  target = common.ROOT / "runs" / "corpus-py"
  if (target / pycorpus.MANIFEST_FILE).exists():
    return
  if archive:
    with tarfile.open(archive) as tar:
      tar.extractall(target.parent, filter="data")
  else:
    pycorpus.build(pycorpus.DEFAULT_PACKAGES, target)
  manifest = json.loads((target / pycorpus.MANIFEST_FILE).read_text())
  print(f"corpus {target}: sha256 {manifest['corpus_sha256'][:12]}", flush=True)


def run_part(name: str, part: Part, root: pathlib.Path, until: float, deadline: latent_runs.Deadline, toy: bool,
             eval_batches: int) -> tuple[list[dict], dict]:
  """One part of `gpu`: the latent model, then its plain twins, trained by `until`, evaluated; (rows, summary and
  curves)."""
  overrides = list(part.overrides) + (list(GPU_TOY) + (["data.source=embedded"] if part.corpus else []) if toy else [])
  ltm_cfg = latent_runs.load_config(part.ltm, overrides)
  plain_cfg = latent_runs.load_config(part.plain, overrides)
  ratio = latent_runs.train_flops(ltm_cfg) / latent_runs.train_flops(plain_cfg)
  started = time.time()
  until = started + (1 - EVAL_SHARE) * (until - started)  # The rest is left to the evaluations.
  # Each run's share of the training time, as its expected cost: the plain twin at equal FLOPs costs what the latent
  # model does (at equal speed per FLOP), the one at equal tokens 1 / ratio of it.
  weights = {"ltm": 1.0, "plain_flops": 1.0, **({"plain": 1 / ratio} if part.equal_tokens else {})}
  share = lambda run: weights[run] / sum(w for name, w in weights.items() if name not in runs)
  runs = {}
  ltm = deadline.train(ltm_cfg, root / "ltm", started + share("ltm") * (until - started))
  runs["ltm"] = (ltm_cfg, ltm)
  fraction = ltm["steps"] / ltm_cfg.train.steps
  plans = {"plain_flops": round(ltm_cfg.train.steps * ratio)}
  if part.equal_tokens:
    plans["plain"] = ltm_cfg.train.steps
  for run, steps in plans.items():
    cfg = dataclasses.replace(plain_cfg, train=dataclasses.replace(plain_cfg.train, steps=steps))
    info = deadline.train(cfg, root / run, time.time() + share(run) * (until - time.time()),
                          max(1, round(fraction * steps)))
    runs[run] = (cfg, info)
  refs = latent_runs.markov_references(plain_cfg, eval_batches) if not part.corpus else None
  rows, curves = [], {}
  # The latent model is evaluated again with z fitted by EVAL_INNER_STEPS inner steps: inference compute at
  # evaluation, which training does not pay for.
  evaluations = [(run, run, ()) for run in runs] + [("ltm", f"ltm_eval{EVAL_INNER_STEPS}",
                                                      (f"latent.inner_steps={EVAL_INNER_STEPS}",))]
  for run, label, eval_overrides in evaluations:
    cfg, info = runs[run]
    per_token = latent_runs.train_flops(cfg)
    metrics = latent_runs.evaluated(root / run, info["steps"], eval_batches, overrides=eval_overrides)
    nll = math.log(metrics["continuation_ppl"])
    row = {"part": name, "model": label, "config": part.ltm if run == "ltm" else part.plain, "overrides": overrides,
           "eval_overrides": list(eval_overrides), **info, "of_steps": cfg.train.steps,
           "train_flops_per_token": per_token, "train_pflops": info["train_tokens"] * per_token / 1e15,
           "continuation_nll": nll, **metrics}
    if refs is not None:
      row["closed"] = (refs["window"] - nll) / (refs["window"] - refs["bayes"])
    rows.append(row)
    if label == run:
      curves[run] = latent_runs.validation_curve(root / run, per_token)
  summary = {"flops_ratio": ratio, "tokens_per_step": ltm_cfg.train.batch_size * ltm_cfg.train.seq_len,
             "ltm_schedule_fraction": fraction, "seconds": time.time() - started, "references": refs}
  ppl = {row["model"]: row["continuation_ppl"] for row in rows}
  summary["ltm_vs_plain_equal_flops"] = ppl["ltm"] / ppl["plain_flops"]
  summary[f"ltm_eval{EVAL_INNER_STEPS}_vs_plain_equal_flops"] = ppl[f"ltm_eval{EVAL_INNER_STEPS}"] / ppl["plain_flops"]
  if "plain" in ppl:
    summary["ltm_vs_plain_equal_tokens"] = ppl["ltm"] / ppl["plain"]
  summary["ltm_vs_plain_flops_curve_equal_tokens"] = latent_runs.at_equal_tokens(curves, "ltm", "plain_flops")
  return rows, {"summary": summary, "curves": curves}


def gpu(args):
  """Latent thoughts against the plain decoder at equal compute, in one command that fits one lent GPU session.

  Parts, run in order, each given its share of what is left of the deadline (--parts picks and orders them):
    code      the Python-source corpus at the CPU benchmarks' scale (configs/ltm_code.py and its plain twin: 4
              attention layers, d_model 128, 32-byte window): the numbers the CPU runs can be checked against.
    markov    Markov documents (configs/ltm_markov.py and twin) with 4x the CPU batch: continuation against the
              closed-form window and Bayes references (`closed`, the fraction of the window-to-Bayes gap closed).
    code_gpu  the Python-source corpus at GPU scale (configs/ltm_paper.py and twin: 8 layers, d_model 512, bfloat16).

  Within a part the latent model trains first, for at most its share of the part's time (the runs' shares follow
  their expected costs); where the deadline cuts it, it stops after the step it is on (a checkpoint, its validation)
  at a fraction f of its schedule. Then the plain twin trains for the same training FLOPs (`ltm_jax.flops`, what `ltm
  info` prints), its own schedule scaled by the FLOPs ratio and stopped at the same fraction f; and (code, markov) a
  plain twin at the latent model's tokens. Every run is evaluated by `ltm eval`'s full evaluation on the same
  validation windows, the latent model also with z fitted by 8 inner steps. A part whose runs are all done is only
  re-read, so a second call resumes. The results file (every run's row, FLOPs and tokens, the equal-FLOPs and
  equal-token ratios, the validation curves) and its plot (continuation perplexity against training FLOPs and
  tokens) are copied into --out after every part."""
  started = time.time()
  until = started + args.deadline
  name = args.name or ("latent-gpu-toy" if args.toy else "latent-gpu")
  root = pathlib.Path(args.root or common.ROOT / "runs" / name)
  root.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(root / "jax-cache"))  # Twins share their evaluation programs.
  deadline = latent_runs.Deadline()
  eval_batches = 1 if args.toy else args.eval_batches
  rows, parts = [], {}
  for index, part_name in enumerate(args.parts):
    part = PARTS[part_name]
    if part.corpus and not args.toy:
      corpus_ready(args.corpus_archive)
    last = index == len(args.parts) - 1
    part_until = until if last else time.time() + part.share * (until - time.time())
    print(f"== {part_name}: {part_until - time.time():.0f} s", flush=True)
    part_rows, parts[part_name] = run_part(part_name, part, root / part_name, part_until, deadline, args.toy,
                                           eval_batches)
    rows += part_rows
    common.print_table(part_rows, GPU_COLUMNS)
    print(json.dumps(parts[part_name]["summary"]), flush=True)
    out = common.write_results(name, rows, parts=parts, deadline=args.deadline, seconds=time.time() - started)
    latent_runs.plot({n: p["curves"] for n, p in parts.items()}, out.with_suffix(".png"), axes=("pflops", "tokens"))
    if args.out:
      for path in (out, out.with_suffix(".png")):
        shutil.copy(path, args.out)
  print(f"done in {time.time() - started:.0f} s: wrote {out} and {out.with_suffix('.png')}")


def register(commands) -> None:
  """Adds the `recipe` and `gpu` subcommands to benchmarks/latent.py's parser."""
  raw = argparse.RawDescriptionHelpFormatter
  sub = commands.add_parser("recipe", help="twins at equal tokens in pieces that each fit a time limit",
                            description=inspect.cleandoc(recipe.__doc__), formatter_class=raw)
  sub.add_argument("--ltm", default="configs/ltm_paper.py", help="the latent config")
  sub.add_argument("--plain", default="configs/ltm_paper_plain.py", help="its twin without latents")
  sub.add_argument("--root", default=str(common.ROOT / "runs" / "latent-recipe"))
  sub.add_argument("--piece-steps", type=int, default=None, help="steps per piece (default: train.eval_every)")
  sub.add_argument("--deadline", type=float, default=540.0, help="seconds this call may run")
  sub.add_argument("--eval-batches", type=int, default=16, help="validation batches of the final evaluation")
  sub.add_argument("--toy", action="store_true", help="both configs at toy sizes on the embedded corpus")
  sub.add_argument("--name", default=None, help="results file (default latent-recipe, latent-recipe-toy with --toy)")
  sub.add_argument("overrides", nargs="*", metavar="key=value", help="applied to both configs")
  sub.set_defaults(run=recipe)
  sub = commands.add_parser("gpu", help="latent model and plain twins at equal compute, in one lent GPU session",
                            description=inspect.cleandoc(gpu.__doc__), formatter_class=raw)
  sub.add_argument("--deadline", type=float, default=540.0, help="seconds the whole command may take")
  sub.add_argument("--parts", nargs="*", choices=list(PARTS), default=list(PARTS))
  sub.add_argument("--corpus-archive", default=None,
                   help="a .tar.xz of runs/corpus-py to unpack when it is missing (else it is built)")
  sub.add_argument("--eval-batches", type=int, default=16, help="validation batches of every full evaluation")
  sub.add_argument("--toy", action="store_true", help="every part at toy sizes (the code parts on the embedded "
                   "corpus): the whole command in minutes on a CPU")
  sub.add_argument("--root", default=None, help="training workdirs (default runs/latent-gpu[-toy])")
  sub.add_argument("--out", default=None, help="a folder to copy the results and logs into after every part")
  sub.add_argument("--name", default=None, help="results file (default latent-gpu, latent-gpu-toy with --toy)")
  sub.set_defaults(run=gpu)
