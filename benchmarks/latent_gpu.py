"""Latent thoughts against the plain decoder at equal compute, in one command that fits one lent GPU session.

    python benchmarks/latent_gpu.py --deadline 540 --corpus-archive .gpu/corpus-py.tar.xz --out $OUT   # a GPU
    python benchmarks/latent_gpu.py --toy --deadline 300                                                # CPU proof

Parts, run in order, each given its share of what is left of the deadline (--parts picks and orders them):
  code      the Python-source corpus at the CPU benchmarks' scale (configs/ltm_code.py and its plain twin: 4 attention
            layers, d_model 128, 32-byte window): the numbers the CPU runs can be checked against.
  markov    Markov documents (configs/ltm_markov.py and twin) with 4x the CPU batch: continuation against the closed-form
            window and Bayes references (`closed`, the fraction of the window-to-Bayes gap closed).
  code_gpu  the Python-source corpus at GPU scale (configs/ltm_paper.py and twin: 8 layers, d_model 512, bfloat16).

Within a part the latent model trains first, for at most its share of the part's time (the runs' shares follow their
expected costs); where the deadline cuts it, it stops after the step it is on (a checkpoint, its validation) at a
fraction f of its schedule. Then the plain twin trains for
the same training FLOPs (`ltm_jax.flops`: the latent step's measured structure, what `ltm info` prints), its own
schedule scaled by the FLOPs ratio and stopped at the same fraction f; and (code, markov) a plain twin at the latent
model's tokens. Every run is evaluated by `ltm eval`'s full evaluation on the same validation windows. A part whose
runs are all done is only re-read, so a second call resumes.

Writes benchmarks/results/<name>-<device>.json (every run's row, FLOPs and tokens, the equal-FLOPs and equal-token
ratios, the validation curves) and <name>-<device>.png (continuation perplexity against training FLOPs and tokens),
copied into --out after every part, with each run's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import tarfile
import threading
import time

import common  # First: puts the checkout on sys.path.
import jax
import latent_runs
import latent_markov

from ltm_jax import flops
from ltm_jax.data import pycorpus


@dataclasses.dataclass(frozen=True)
class Part:
  ltm: str
  plain: str
  overrides: tuple[str, ...]  # Applied to both configs.
  ltm_overrides: tuple[str, ...] = ()
  share: float = 1.0  # Of the time left when the part starts (the last part takes all of it).
  equal_tokens: bool = True  # Also train the plain twin at the latent model's tokens.
  corpus: bool = True


# Steps are a plan: the deadline stops a run that would not end in time (see the module docstring).
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
TOY = ("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.window=8", "model.max_seq_len=64",
       "model.dtype=float32", "train.batch_size=4", "train.seq_len=64", "train.steps=16", "train.warmup_steps=2",
       "train.eval_every=8", "train.eval_batches=1", "train.checkpoint_every=100000", "train.log_every=8")
TOY_DATA = ("data.source=embedded",)
EVAL_SHARE = 0.25  # Of a part's time, kept for the final evaluations.
EVAL_INNER_STEPS = 8
COLUMNS = ("part", "model", "steps", "of_steps", "train_tokens", "train_pflops", "train_s", "continuation_ppl",
           "continuation_nll", "closed", "nll", "kl", "shuffled_nll", "prior_nll")


class Deadline:
  """Stops a training run at a wall-clock time: a SIGINT, which `ltm_jax.train` turns into a stop after the current
  step (a checkpoint, its metrics). Outside training a SIGINT from the timer is ignored."""

  def __init__(self):
    signal.signal(signal.SIGINT, lambda *_: None)

  def train(self, cfg, workdir: pathlib.Path, until: float, stop_at: int | None = None):
    timer = threading.Timer(max(until - time.time(), 0.0), os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
      return latent_runs.train_variant(workdir.name, cfg, workdir.parent, stop_at, allow_stop=True)
    finally:
      timer.cancel()


def corpus_ready(root: pathlib.Path, archive: str | None) -> None:
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


def train_flops(cfg) -> float:
  """Training FLOPs per token of `cfg`'s train step."""
  return flops.flops_per_token(cfg.model, cfg.latent, cfg.train.seq_len)[1]


def run_part(name: str, part: Part, root: pathlib.Path, until: float, deadline: Deadline, toy: bool,
             eval_batches: int) -> tuple[list[dict], dict]:
  overrides = list(part.overrides) + (list(TOY) + (list(TOY_DATA) if part.corpus else []) if toy else [])
  ltm_cfg = latent_runs.load_config(part.ltm, overrides + list(part.ltm_overrides))
  plain_cfg = latent_runs.load_config(part.plain, overrides)
  ratio = train_flops(ltm_cfg) / train_flops(plain_cfg)
  tokens_per_step = ltm_cfg.train.batch_size * ltm_cfg.train.seq_len
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
  refs = latent_markov.references(plain_cfg, eval_batches) if not part.corpus else None
  rows, curves = [], {}
  # The latent model is evaluated again with z fitted by EVAL_INNER_STEPS inner steps: inference compute at
  # evaluation, which training does not pay for.
  evaluations = [(run, run, ()) for run in runs] + [("ltm", f"ltm_eval{EVAL_INNER_STEPS}",
                                                      (f"latent.inner_steps={EVAL_INNER_STEPS}",))]
  for run, label, eval_overrides in evaluations:
    cfg, info = runs[run]
    per_token = train_flops(cfg)
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
      curves[run] = [{**p, "pflops": p["tokens"] * per_token / 1e15}
                     for p in latent_runs.validation_curve(root / run)]
  summary = {"flops_ratio": ratio, "tokens_per_step": tokens_per_step, "ltm_schedule_fraction": fraction,
             "seconds": time.time() - started, "references": refs}
  ppl = {row["model"]: row["continuation_ppl"] for row in rows}
  summary["ltm_vs_plain_equal_flops"] = ppl["ltm"] / ppl["plain_flops"]
  summary[f"ltm_eval{EVAL_INNER_STEPS}_vs_plain_equal_flops"] = ppl[f"ltm_eval{EVAL_INNER_STEPS}"] / ppl["plain_flops"]
  if "plain" in ppl:
    summary["ltm_vs_plain_equal_tokens"] = ppl["ltm"] / ppl["plain"]
  summary["ltm_vs_plain_flops_curve_equal_tokens"] = latent_runs.at_equal_tokens(curves, "ltm", "plain_flops")
  return rows, {"summary": summary, "curves": curves}


def plot(parts: dict, out: pathlib.Path) -> None:
  """Per part, continuation perplexity against training FLOPs (left) and tokens (right)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(len(parts), 2, figsize=(11, 3.8 * len(parts)), squeeze=False)
  for (name, part), row_axes in zip(parts.items(), axes):
    for ax, key, label in zip(row_axes, ("pflops", "tokens"), ("training PFLOPs", "training tokens")):
      for run, points in part["curves"].items():
        ax.plot([p[key] for p in points], [p["val_continuation_ppl"] for p in points], marker="o", label=run,
                linestyle="--" if run.startswith("plain") else "-")
      ax.set_xlabel(label)
      ax.set_ylabel("validation continuation perplexity")
      ax.set_title(name)
      ax.grid(alpha=0.3)
      ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=110)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--deadline", type=float, default=540.0, help="seconds the whole command may take")
  parser.add_argument("--parts", nargs="*", choices=sorted(PARTS), default=list(PARTS))
  parser.add_argument("--corpus-archive", default=None,
                      help="a .tar.xz of runs/corpus-py to unpack when it is missing (else it is built)")
  parser.add_argument("--eval-batches", type=int, default=16, help="validation batches of every full evaluation")
  parser.add_argument("--toy", action="store_true", help="every part at toy sizes (the code parts on the embedded "
                      "corpus): the whole command in minutes on a CPU")
  parser.add_argument("--root", default=None, help="training workdirs (default runs/latent-gpu[-toy])")
  parser.add_argument("--out", default=None, help="a folder to copy the results and logs into after every part")
  parser.add_argument("--name", default=None, help="results file (default latent-gpu, latent-gpu-toy with --toy)")
  args = parser.parse_args()
  started = time.time()
  until = started + args.deadline
  name = args.name or ("latent-gpu-toy" if args.toy else "latent-gpu")
  root = pathlib.Path(args.root or common.ROOT / "runs" / name)
  root.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(root / "jax-cache"))  # Twins share their evaluation programs.
  deadline = Deadline()
  eval_batches = 1 if args.toy else args.eval_batches
  rows, parts = [], {}
  for index, part_name in enumerate(args.parts):
    part = PARTS[part_name]
    if part.corpus and not args.toy:
      corpus_ready(root, args.corpus_archive)
    last = index == len(args.parts) - 1
    part_until = until if last else time.time() + part.share * (until - time.time())
    print(f"== {part_name}: {part_until - time.time():.0f} s", flush=True)
    part_rows, parts[part_name] = run_part(part_name, part, root / part_name, part_until, deadline, args.toy,
                                           eval_batches)
    rows += part_rows
    common.print_table(part_rows, COLUMNS)
    print(json.dumps(parts[part_name]["summary"]), flush=True)
    out = common.write_results(name, rows, parts=parts, deadline=args.deadline, seconds=time.time() - started)
    plot(parts, out.with_suffix(".png"))
    if args.out:
      for path in (out, out.with_suffix(".png")):
        shutil.copy(path, args.out)
  print(f"done in {time.time() - started:.0f} s: wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
