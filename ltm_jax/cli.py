"""The `ltm` command: train, eval, generate, info. Bad input prints one line `error: ...` and exits with status 2
(set LTM_DEBUG=1 for the traceback)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


def _train(args) -> int:
  from ltm_jax import config as config_lib
  from ltm_jax.train import train
  cfg = config_lib.load_config(args.config, args.overrides)
  result = train(cfg, args.workdir)
  if result.interrupted_by is not None:
    return 128 + result.interrupted_by
  val = {k: v for k, v in result.metrics.items() if k.startswith("val_")}
  print(f"done: step {result.step} in {result.seconds:.0f}s; " + " ".join(f"{k} {v:.4f}" for k, v in val.items()
                                                                        if isinstance(v, float)))
  return 0


def _eval(args) -> int:
  from ltm_jax import data as data_lib
  from ltm_jax.api import load
  from ltm_jax.train.step import evaluate, make_eval_step
  lm = load(args.workdir, args.step)
  t = lm.config.train
  batch_size = args.batch_size or t.batch_size
  splits = data_lib.load_splits(lm.config.data, lm.config.model.vocab_size, t.seq_len)
  batches = data_lib.eval_batches(splits.val, batch_size, t.seq_len, args.batches or 10**9)
  started = time.time()
  bytes_per_token = None if splits.is_token_file else lm.tokenizer.bytes_per_token
  evaluation = evaluate(make_eval_step(lm.model), lm.params, batches, bytes_per_token)
  metrics = {"step": lm.trained_steps, **evaluation, "seq_len": t.seq_len, "seconds": round(time.time() - started, 2)}
  out = pathlib.Path(args.workdir) / "eval.json"
  out.write_text(json.dumps(metrics, indent=2) + "\n")
  for k, v in metrics.items():
    print(f"{k:12s} {v:.4f}" if isinstance(v, float) else f"{k:12s} {v}")
  print(f"wrote {out}")
  return 0


def _generate(args) -> int:
  from ltm_jax.api import load
  lm = load(args.workdir, args.step)
  print(args.prompt + lm.generate(args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed))
  return 0


def _info(args) -> int:
  from ltm_jax import config as config_lib
  from ltm_jax.info import format_info, model_info
  cfg = config_lib.load_config(args.config, args.overrides)
  info = model_info(cfg)
  print(json.dumps(info, indent=2) if args.json else format_info(info))
  return 0


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _probability(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
  return value


def _non_negative(text: str) -> float:
  value = float(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="ltm", description="Train, evaluate and sample Latent Thought language models.")
  sub = p.add_subparsers(dest="command", required=True)

  train = sub.add_parser("train", help="train (or resume) a model in a workdir")
  train.add_argument("--config", required=True, help="Python config file, e.g. configs/tiny.py")
  train.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and TensorBoard files go here")
  train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.d_model=256 train.steps=200")
  train.set_defaults(run=_train)

  ev = sub.add_parser("eval", help="evaluate the latest checkpoint on the validation split; writes eval.json")
  ev.add_argument("--workdir", required=True)
  ev.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ev.add_argument("--batches", type=_positive_int, default=None, help="limit validation batches (default: all)")
  ev.add_argument("--batch-size", type=_positive_int, default=None)
  ev.set_defaults(run=_eval)

  gen = sub.add_parser("generate", help="sample a continuation of a prompt")
  gen.add_argument("--workdir", required=True)
  gen.add_argument("--prompt", default="", help="text to continue (empty: start from the beginning-of-text token)")
  gen.add_argument("--max-new-tokens", type=_positive_int, default=200)
  gen.add_argument("--temperature", type=_non_negative, default=1.0, help="0 = greedy")
  gen.add_argument("--top-k", type=_positive_int, default=None)
  gen.add_argument("--top-p", type=_probability, default=None)
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--step", type=int, default=None)
  gen.set_defaults(run=_generate)

  info = sub.add_parser("info", help="parameter count, FLOPs per token and estimated memory of a config")
  info.add_argument("--config", required=True)
  info.add_argument("--json", action="store_true", help="print JSON")
  info.add_argument("overrides", nargs="*", metavar="key=value")
  info.set_defaults(run=_info)
  return p


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  from absl import logging as absl_logging  # orbax logs routine notices as warnings; keep the terminal for results.
  absl_logging.set_verbosity(absl_logging.ERROR)
  from ltm_jax.errors import LtmError
  try:
    return args.run(args)
  except (LtmError, ValueError, FileNotFoundError) as e:
    if os.environ.get("LTM_DEBUG"):
      raise
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
