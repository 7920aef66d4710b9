"""The runner behind every subcommand of benchmarks/latent.py that trains models: variants of a latent-versus-plain
comparison trained, evaluated and tabled, their validation curves plotted.

A variant is (config file, overrides, what it is); it trains in ROOT/<name> (an interrupted or finished run resumes;
a finished one is only evaluated), and its `bench-train.json` records the steps, seconds and tokens of its training.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import threading
import time

import common

from ltm_jax import config as config_lib
from ltm_jax import data as data_lib
from ltm_jax import flops
from ltm_jax.api import load
from ltm_jax.data import markov
from ltm_jax.train import train
from ltm_jax.train.evaluation import full_evaluation


def load_config(path: str, overrides=(), steps: int | None = None) -> config_lib.Config:
  overrides = list(overrides) + ([f"train.steps={steps}"] if steps else [])
  return config_lib.load_config(common.ROOT / path if not pathlib.Path(path).is_absolute() else path, overrides)


def train_flops(cfg: config_lib.Config) -> float:
  """Training FLOPs per token of `cfg`'s train step (`ltm_jax.flops`, what `ltm info` prints)."""
  return flops.flops_per_token(cfg.model, cfg.latent, cfg.train.seq_len)[1]


def trained(workdir: pathlib.Path) -> dict:
  """{steps, train_s} of the training `train_variant` recorded in `workdir` (zeros before any)."""
  record = workdir / "bench-train.json"
  return json.loads(record.read_text()) if record.exists() else {"steps": 0, "train_s": 0.0}


def train_variant(name: str, cfg: config_lib.Config, root: pathlib.Path, stop_at: int | None = None,
                  start_from: str | None = None, allow_stop: bool = False) -> dict:
  """Trains `cfg` in root/name up to train.steps (or `stop_at`); returns {steps, train_s, train_tokens} of what the
  workdir holds, train_s summed over every call that trained it. With `start_from` (another variant's name), a new
  workdir begins as a copy of root/start_from, whose training (steps, seconds, metrics) it then continues. A signal
  that stops the training early ends the script, unless `allow_stop`: then what was trained is recorded."""
  workdir = root / name
  if start_from and not workdir.exists():
    source = root / start_from
    if not trained(source)["steps"]:
      raise SystemExit(f"{name} starts from {start_from}, which is not trained yet: run --only {start_from} first")
    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("bench-eval.json", "eval.json", "*.lock"))
  record = workdir / "bench-train.json"
  info = trained(workdir)
  target = cfg.train.steps if stop_at is None else min(stop_at, cfg.train.steps)
  if info["steps"] < target:
    started = time.time()
    result = train(cfg, workdir, progress=False, stop_at=target)
    if result.step < target and not allow_stop:
      raise SystemExit(f"{name}: training stopped at step {result.step} (signal {result.interrupted_by}); rerun to "
                       "resume")
    info = {"steps": result.step, "train_s": info["train_s"] + time.time() - started}
  info["train_tokens"] = info["steps"] * cfg.train.batch_size * cfg.train.seq_len
  record.write_text(json.dumps(info) + "\n")
  return info


class Deadline:
  """Stops a training run at a wall-clock time: a SIGINT, which `ltm_jax.train` turns into a stop after the current
  step (a checkpoint, its metrics). Outside training a SIGINT from the timer is ignored."""

  def __init__(self):
    signal.signal(signal.SIGINT, lambda *_: None)

  def train(self, cfg, workdir: pathlib.Path, until: float, stop_at: int | None = None) -> dict:
    timer = threading.Timer(max(until - time.time(), 0.0), os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
      return train_variant(workdir.name, cfg, workdir.parent, stop_at, allow_stop=True)
    finally:
      timer.cancel()


def evaluate_variant(workdir: pathlib.Path, eval_batches: int, curve_steps=(), overrides=()) -> dict:
  """`ltm eval`'s full evaluation of the workdir's latest checkpoint on its first `eval_batches` validation batches,
  with `curve_steps` inner steps in the ELBO curve and runtime `overrides` (e.g. latent.inner_steps=32), plus the
  model's parameter count and the evaluation's seconds."""
  lm = load(workdir, overrides=list(overrides))
  t = lm.config.train
  source = data_lib.open_source(lm.config.data, lm.config.model.vocab_size, t.seq_len)
  batches = source.validation_batches(t.batch_size, eval_batches)
  started = time.time()
  metrics = full_evaluation(lm.model, lm.params, batches, seed=0, bytes_per_token=source.bytes_per_token,
                            curve_steps=curve_steps)
  return {"params": lm.num_params, "eval_s": time.time() - started, **metrics}


def evaluated(workdir: pathlib.Path, step: int, eval_batches: int, curve_steps=(), overrides=()) -> dict:
  """`evaluate_variant` of the workdir at training step `step`, read from its `bench-eval.json` when that holds the
  same evaluation (step, batches, curve, runtime overrides) of the same step: evaluating a latent model takes
  minutes, and a finished comparison is re-tabled often. The file keeps one record per evaluation."""
  record = workdir / "bench-eval.json"
  key = {"step": step, "eval_batches": eval_batches, "curve_steps": list(curve_steps)}
  if overrides:
    key["overrides"] = list(overrides)
  saved = []
  if record.exists():
    lines = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    saved = [r for r in lines if r["key"]["step"] == step]  # Records of an older checkpoint are dropped.
    for r in saved:
      if r["key"] == key:
        return r["metrics"]
  metrics = evaluate_variant(workdir, eval_batches, curve_steps, overrides)
  saved.append({"key": key, "metrics": metrics})
  record.write_text("".join(json.dumps(r) + "\n" for r in saved))
  return metrics


def metrics_rows(workdir: pathlib.Path) -> list[dict]:
  """The rows of the workdir's metrics.jsonl (none before training)."""
  path = workdir / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def validation_curve(workdir: pathlib.Path, flops_per_token: float | None = None) -> list[dict]:
  """(tokens, val_continuation_ppl, val_nll, val_shuffled_nll, val_prior_nll, val_kl) at every training eval, and
  the training PFLOPs so far (`pflops`) when `flops_per_token` is given."""
  keys = ("tokens", "val_continuation_ppl", "val_nll", "val_shuffled_nll", "val_prior_nll", "val_kl")
  points = [{k: row[k] for k in keys if k in row} for row in metrics_rows(workdir) if "val_continuation_ppl" in row]
  if flops_per_token is not None:
    points = [{**p, "pflops": p["tokens"] * flops_per_token / 1e15} for p in points]
  return points


def markov_references(cfg: config_lib.Config, eval_batches: int) -> dict:
  """The closed-form losses (`ltm_jax.data.markov.references`: oracle, bayes, window, memory, uniform; nats per
  symbol) over the positions `full_evaluation` scores for continuation (targets t >= T/2) of the validation
  documents it reads."""
  source = data_lib.open_source(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
  count = sum(len(b["targets"]) for b in source.validation_batches(cfg.train.batch_size, eval_batches))
  reach = cfg.model.receptive_field
  refs = markov.references(source.validation_documents(), range(count), window=reach,
                           score_from=cfg.train.seq_len // 2)
  return {**refs.as_dict(), "receptive_field": reach, "documents": count}


def tokens_per_second(workdir: pathlib.Path) -> float | None:
  """The median training throughput logged in the workdir's metrics.jsonl (compilation and evaluations excluded)."""
  rates = sorted(row["tokens_per_sec"] for row in metrics_rows(workdir) if "tokens_per_sec" in row)
  return rates[len(rates) // 2] if rates else None


def at_equal_tokens(curves: dict[str, list[dict]], name: str, baseline: str) -> float | None:
  """Validation continuation perplexity of `name` over `baseline`'s at the last training-token count both curves hold
  (None if they share none): the comparison that stays fair when one run stopped early."""
  base = {p["tokens"]: p["val_continuation_ppl"] for p in curves.get(baseline, [])}
  shared = [p for p in curves.get(name, []) if p["tokens"] in base]
  return shared[-1]["val_continuation_ppl"] / base[shared[-1]["tokens"]] if shared else None


AXES = {"tokens": ("training tokens (M)", 1e6), "pflops": ("training PFLOPs", 1.0)}


def plot(panels: dict[str, dict[str, list[dict]]], out: pathlib.Path, axes=("tokens",),
         references: dict[str, float] | None = None) -> None:
  """One row of panels per entry of `panels` (title -> curves by run name), one column per key of `axes` (tokens,
  pflops): validation continuation perplexity against it, one line per run (dashed: plain decoders), and
  horizontal lines at `references` (name -> perplexity)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, grid = plt.subplots(len(panels), len(axes), figsize=(1.5 + 5.5 * len(axes), 4.3 * len(panels)), squeeze=False)
  for (title, curves), row in zip(panels.items(), grid):
    for ax, key in zip(row, axes):
      label, scale = AXES[key]
      for name, points in curves.items():
        ax.plot([p[key] / scale for p in points], [p["val_continuation_ppl"] for p in points], marker="o",
                label=name, linestyle="--" if name.startswith("plain") else "-")
      for name, value in (references or {}).items():
        ax.axhline(value, color="gray", linewidth=0.8, linestyle=":")
        ax.annotate(name, (0, value), xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(2, 2), fontsize=8, color="gray")
      ax.set(xlabel=label, ylabel="validation continuation perplexity", title=title)
      ax.grid(alpha=0.3)
      ax.legend()
  fig.tight_layout()
  fig.savefig(out, dpi=120)


def run_variants(variants: dict, names, root: pathlib.Path, *, eval_batches: int, curve_steps=(),
                 steps: int | None = None, steps_of: dict[str, int] | None = None, stop_at: int | None = None,
                 overrides=(), row_fn=None, columns=(), start_from: dict[str, str] | None = None
                 ) -> tuple[list[dict], dict]:
  """Trains (for `steps`, or `steps_of[name]`, when given; up to `stop_at` steps of the schedule, when given) and
  evaluates `names` of `variants` (name -> (config file, overrides, what it is)) in root, `overrides` on top of every
  variant's, printing each row as it is done; `row_fn(row)` adds derived columns; `start_from` (name -> variant)
  names the variants that continue another's training (see `train_variant`). Returns (rows, validation curves by
  name)."""
  root.mkdir(parents=True, exist_ok=True)
  rows, curves = [], {}
  for name in names:
    path, own, what = variants[name]
    cfg = load_config(path, list(own) + list(overrides), (steps_of or {}).get(name, steps))
    info = train_variant(name, cfg, root, stop_at, (start_from or {}).get(name))
    row = {"model": name, "config": path, "overrides": own, "what": what, **info,
           "tok_per_s": info["train_tokens"] / info["train_s"] if info["train_s"] else None,
           **evaluated(root / name, info["steps"], eval_batches, curve_steps)}
    rows.append(row_fn(row) if row_fn else row)
    curves[name] = validation_curve(root / name)
    common.print_table(rows[-1:], columns)
  return rows, curves


def inner_step_rows(rows: list[dict], root: pathlib.Path, inner_steps, *, eval_batches: int, row_fn=None,
                    columns=()) -> list[dict]:
  """For every latent row of `rows` (kl > 0), the same trained model evaluated with z fitted by each of
  `inner_steps` inner steps instead of the trained count: what more inference compute buys at evaluation time."""
  extra = []
  for row in rows:
    if not row.get("kl"):
      continue
    for n in (n for n in inner_steps if n != row.get("inner_steps")):  # The trained count is the row itself.
      metrics = evaluated(root / row["model"], row["steps"], eval_batches, overrides=[f"latent.inner_steps={n}"])
      new = {**row, **metrics, "model": f"{row['model']} @ {n} inner steps", "eval_inner_steps": n}
      extra.append(row_fn(new) if row_fn else new)
      common.print_table(extra[-1:], columns)
  return extra


def add_comparison_args(parser: argparse.ArgumentParser, variants: dict, name: str, eval_batches: int, batch: str,
                        curve, steps: int | None = None) -> None:
  """The command line of a latent-versus-plain comparison: --only, --list, --steps (default `steps`, else the
  configs'), --stop-at, --eval-batches (of `batch`), --curve / --no-curve, --eval-inner-steps, --root (default
  runs/<name>) and --name (default `name`)."""
  parser.add_argument("--only", nargs="*", choices=list(variants), help="variants to run (default: all)")
  parser.add_argument("--list", action="store_true", help="print the variants and what each changes, then stop")
  parser.add_argument("--steps", type=int, default=steps,
                      help=f"train.steps of every variant (default: {steps or 'as the configs say'})")
  parser.add_argument("--stop-at", type=int, default=None,
                      help="stop every variant's training at this step of its schedule (a run already past it stays)")
  parser.add_argument("--eval-batches", type=int, default=eval_batches, help=f"validation batches of {batch}")
  parser.add_argument("--curve", type=int, nargs="*", default=list(curve), help="inner steps of the ELBO curve")
  parser.add_argument("--no-curve", dest="curve", action="store_const", const=[], help="skip the ELBO curve")
  parser.add_argument("--eval-inner-steps", type=int, nargs="*", default=[],
                      help="latent variants: also evaluate with z fitted by this many inner steps (one row each)")
  parser.add_argument("--root", default=str(common.ROOT / "runs" / name), help="the variants' workdirs")
  parser.add_argument("--name", default=name, help="results file: benchmarks/results/NAME-<device>.json")
