"""The `ltm` command: train, eval, generate, fit-prior, train-prior, info, build-corpus, convert-rwkv, serve. Bad
input prints one line `error: ...` and exits with status 2 (set LTM_DEBUG=1 for the traceback)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import sys
import time


def _train(args) -> int:
  from ltm_jax import compilation_cache, parallel
  from ltm_jax.train import train
  _check_workdir(args.workdir)
  cfg = _train_config(args.config, args.workdir, args.overrides)
  compilation_cache.use(args.compilation_cache)
  # Before anything touches a device: a multi-process run must join its process group first.
  parallel.initialize(args.coordinator_address, args.num_processes, args.process_id)
  result = train(cfg, args.workdir, from_step=args.from_step)
  if result.interrupted_by is not None:
    return 128 + result.interrupted_by
  if not parallel.is_main_process():
    return 0
  val = {k: v for k, v in result.metrics.items() if k.startswith(("val_", "test_")) and isinstance(v, float)}
  print(_done(f"done: step {result.step} in {result.seconds:.0f}s", val))
  return 0


def _train_config(config: str | None, workdir: str, overrides: list[str]):
  """The config file's config with the overrides, or without one the workdir's config.json with the overrides on
  top, refusing overrides that change the model it holds (naming each key)."""
  from ltm_jax import config as config_lib
  from ltm_jax.errors import ConfigError, LtmError
  from ltm_jax.train import checkpoint as ckpt_lib
  if config is not None:
    return config_lib.load_config(config, overrides)
  if not os.path.isfile(os.path.join(workdir, "config.json")):
    raise LtmError(f"--config is required: {workdir} holds no config.json to resume from")
  saved = ckpt_lib.read_config_json(workdir)
  cfg = config_lib.validate(config_lib.apply_overrides(saved, overrides))
  changed = ckpt_lib.model_differences(saved, cfg)
  if changed:
    raise ConfigError("; ".join(f"{key}={new!r} would change the model trained in {workdir} ({key}={old!r})"
                                for key, old, new in changed) +
                      "; train a new model in another workdir (with --config)")
  return cfg


def _done(line: str, metrics: dict[str, float]) -> str:
  """`line`, then `; name value ...` for the metrics (nothing when there are none)."""
  return line + ("; " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()) if metrics else "")


def _eval(args) -> int:
  import tqdm

  from ltm_jax import data as data_lib
  from ltm_jax.api import load
  from ltm_jax.train.evaluation import full_evaluation, latent_worth
  _check_quantize(args)
  _check_lm_workdir(args.workdir, "eval")
  _check_out(args.out)
  lm = _quantized(load(args.workdir, args.step, args.overrides), args)
  t = lm.config.train
  batch_size = args.batch_size or t.batch_size
  # Before the corpus is read: text through a tokenizer that is not the model's would be scored without complaint.
  data_lib.check_model_reads(lm.config.data, lm.config.model.vocab_size)
  source = data_lib.open_source(lm.config.data, lm.config.model.vocab_size, t.seq_len)
  batches = source.validation_batches(batch_size, args.batches or 10**9)
  started = time.time()
  bytes_per_token = source.bytes_per_token
  with tqdm.tqdm(total=len(batches), unit="batch", desc="eval", file=sys.stderr, disable=None) as bar:
    evaluation = full_evaluation(lm.model, lm.float_params, batches, seed=t.seed, bytes_per_token=bytes_per_token,
                                 curve_steps=args.curve_steps, curve_batches=args.curve_batches,
                                 progress=lambda done, total: bar.update(done - bar.n))
  # val_loss / val_bpb: the names training logs, (NLL + KL) per token (exact NLL for the plain decoder).
  aliases = {"val_loss": evaluation["elbo"]}
  if "elbo_bpb" in evaluation:
    aliases["val_bpb"] = evaluation["elbo_bpb"]
  overrides = {"overrides": list(args.overrides)} if args.overrides else {}
  metrics = {"step": lm.trained_steps, **_quantize_record(args), **overrides, **evaluation, **aliases,
             "seq_len": t.seq_len, "seconds": round(time.time() - started, 2)}
  out = _eval_out(args, lm.trained_steps)
  tmp = out.with_name(out.name + ".tmp")
  tmp.write_text(json.dumps(metrics, indent=2) + "\n")
  os.replace(tmp, out)
  for k, v in metrics.items():
    label = " (upper bound)" if k == "elbo_ppl" and metrics["elbo_ppl_is_upper_bound"] else ""
    if isinstance(v, dict):
      v = " ".join(f"{steps}:{x:.4g}" for steps, x in v.items())
    print(f"{k:24s} {v:.4f}{label}" if isinstance(v, float) else f"{k:24s} {v}{label}")
  worth = latent_worth(evaluation)
  if worth:
    print(worth)
  print(f"wrote {out}")
  return 0


def _check_out(out: str | None) -> None:
  from ltm_jax.errors import LtmError
  if out is None:
    return
  if os.path.isdir(out):
    raise LtmError(f"--out {out} is a directory; name the file to write")
  if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    raise LtmError(f"--out {out}: the folder {os.path.dirname(out)} does not exist")


def _eval_out(args, step: int) -> pathlib.Path:
  """--out, else WORKDIR/eval.json for the newest checkpoint (damaged or not) evaluated as trained (no quantisation,
  no overrides), else a name carrying what differs (eval-step300.json, eval-int8.json, eval-train.seq_len=512.json,
  ...): an evaluation never replaces one of something else, and a fallback from a damaged checkpoint never the
  newest one's."""
  import hashlib
  import re

  from ltm_jax.train import checkpoint as ckpt_lib
  if args.out is not None:
    return pathlib.Path(args.out)
  checkpointer = ckpt_lib.Checkpointer(args.workdir, read_only=True)
  try:
    newest = max(checkpointer.all_steps())
  finally:
    checkpointer.close()
  parts = [] if step == newest else [f"step{step}"]
  quantize = _quantize_record(args)
  if quantize:
    tag = [quantize["quantize"]]
    if "quantize_group" in quantize:
      tag.append(f"g{quantize['quantize_group']}")
    if quantize.get("quantize_keep_int8"):
      tag.append("keep-" + ",".join(quantize["quantize_keep_int8"]))
    parts.append("-".join(tag))
  parts += [re.sub(r"[^\w.,=+-]", "_", override) for override in args.overrides]
  name = "-".join(["eval", *parts])
  if len(name) > 200:  # File names stop at 255 bytes: a long override list is cut and told apart by its hash.
    name = name[:180] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
  return pathlib.Path(args.workdir) / f"{name}.json"


def _generate(args) -> int:
  from ltm_jax.api import load
  _check_quantize(args)
  _check_lm_workdir(args.workdir, "generate")
  lm = load(args.workdir, args.step, args.overrides)
  if args.latents is not None and not lm.has_latents:
    raise ValueError("--latents needs a model trained with latents (latent.enabled=true)")
  if (args.sampler is not None or args.sampler_steps is not None) and args.latents != "dit":
    raise ValueError("--sampler and --sampler-steps choose how --latents dit draws z; add --latents dit")
  before = lm.param_bytes
  latents = args.latents
  if latents == "dit":  # One z per prompt from the learned prior (refused here if the workdir has none).
    latents = lm.dit_latents(len(args.prompt or [""]), args.seed, sampler=args.sampler, steps=args.sampler_steps)
  lm = _quantized(lm, args)
  prompts = args.prompt or [""]
  options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 latents=latents)
  # Every input is checked (by stream, or by the whole batch's generate) before anything is printed, so a refusal
  # is the only output.
  if len(prompts) == 1:
    pieces = lm.stream(prompts[0], args.max_new_tokens, chunk=args.chunk, **options)
  else:
    texts = lm.generate(prompts, args.max_new_tokens, **options)
  if args.quantize:
    print(f"{args.quantize} weights: parameters {before / 2**20:.2f} MiB -> {lm.param_bytes / 2**20:.2f} MiB",
          file=sys.stderr)
  if len(prompts) == 1:  # Streamed: each on-device chunk of tokens is printed as soon as it is decoded.
    print(prompts[0], end="", flush=True)
    for piece in pieces:
      print(piece, end="", flush=True)
    print()
    return 0
  for i, (prompt, text) in enumerate(zip(prompts, texts)):
    print(("\n" if i else "") + f"--- {i}\n{prompt}{text}")  # One batch: ragged prompts decode together.
  return 0


def _fit_prior(args) -> int:
  from ltm_jax.api import load
  from ltm_jax.prior import posteriors
  _check_lm_workdir(args.workdir, "fit-prior")
  lm = load(args.workdir, args.step, args.overrides)
  started = time.time()
  report = lambda done, total: print(f"shard {done}/{total} ({time.time() - started:.0f}s)", file=sys.stderr)
  folder = posteriors.collect(lm, args.workdir, sequences=args.sequences, heldout_fraction=args.heldout_fraction,
                              batch_size=args.batch_size, shard_size=args.shard_size, seed=args.seed, on_shard=report)
  collected = posteriors.PosteriorSet(folder)
  print(f"wrote {folder}: {collected.num_records} posteriors of z {list(collected.latent_shape)} "
        f"({collected.num_train} to train the prior, {collected.num_records - collected.num_train} held out)")
  return 0


def _train_prior(args) -> int:
  from ltm_jax.prior.train import train_prior
  _check_workdir(args.workdir)
  result = train_prior(args.workdir, args.overrides)
  if result.interrupted_by is not None:
    return 128 + result.interrupted_by
  print(_done(f"done: prior step {result.step} in {result.seconds:.0f}s",
              {k: v for k, v in result.metrics.items() if isinstance(v, float)}))
  return 0


def _convert_rwkv(args) -> int:
  from ltm_jax.convert import convert_rwkv
  cfg = convert_rwkv(args.checkpoint, args.out, step=args.step, tokenizer=args.tokenizer)
  m = cfg.model
  print(f"wrote {args.out}: {m.n_layers} x {m.layer_pattern}, d_model {m.d_model}, vocab {m.vocab_size}, "
        f"tokenizer {cfg.data.tokenizer}, step {args.step}")
  return 0


def _serve(args) -> int:
  from ltm_jax import compilation_cache
  from ltm_jax.api import load
  _check_quantize(args)
  _check_lm_workdir(args.workdir, "serve")
  _check_listen(args.host, args.port)
  compilation_cache.use(args.compilation_cache)  # Before anything compiles: JAX sets its cache up once.
  try:
    from ltm_jax.serve import Engine
    from ltm_jax.serve.app import serve
  except ImportError as e:
    raise ValueError(f"ltm serve needs the serve extra (pip install 'ltm-jax[serve]'): {e}") from None
  lm = _quantized(load(args.workdir, args.step, args.overrides), args)
  engine = Engine(lm, max_batch=args.max_batch, chunk=args.chunk, max_wait_ms=args.max_wait_ms, queue=args.queue,
                  prefill_chunk=args.prefill_chunk or None, prefill_budget=args.prefill_budget or None,
                  waiting_chunk=args.waiting_chunk or None, static_batches=args.static_batches,
                  stream_steps=not args.stream_per_chunk)
  engine.start()
  print(f"serving {engine.model_name} (step {lm.trained_steps}, {_weights(lm, args)}) on "
        f"http://{args.host}:{args.port}: {engine.max_batch} slots, {engine.programs} programs compiled in "
        f"{engine.compile_seconds:.1f}s", file=sys.stderr, flush=True)
  return serve(engine, host=args.host, port=args.port, grace=args.grace, request_timeout=args.request_timeout or None,
               log_level=args.log_level)


def _weights(lm, args) -> str:
  """The weights served, as the start line names them: their quantisation (with int4 its group size and the
  weights kept at int8) and size."""
  size = f"{lm.param_bytes / 2**20:.2f} MiB"
  if not args.quantize:
    return f"float weights, {size}"
  record = _quantize_record(args)
  group = f" in groups of {record['quantize_group']}" if "quantize_group" in record else ""
  kept = f", {','.join(args.quantize_keep_int8)} at int8" if args.quantize_keep_int8 else ""
  return f"{args.quantize} weights{group}{kept}, {size}"


def _check_listen(host: str, port: int) -> None:
  """Refuses an address the server could not listen on, before the model is loaded and compiled."""
  import socket
  from ltm_jax.errors import LtmError
  if not 0 <= port <= 65535:
    raise LtmError(f"--port must be in [0, 65535], got {port}")
  try:
    with socket.create_server((host, port)):
      pass
  except OSError as e:
    raise LtmError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _build_corpus(args) -> int:
  from ltm_jax.data import pycorpus
  manifest = pycorpus.build(args.specs or pycorpus.DEFAULT_PACKAGES, args.out,
                            max_file_bytes=args.max_file_bytes or pycorpus.MAX_FILE_BYTES, overwrite=args.overwrite)
  print(pycorpus.summary(manifest, args.out))
  return 0


def _info(args) -> int:
  from ltm_jax import config as config_lib
  from ltm_jax.info import format_info, model_info
  from ltm_jax.train.compiled import compiled_memory
  cfg = config_lib.load_config(args.config, args.overrides)
  _refuse_timeseries(cfg, "info")
  info = model_info(cfg)
  if args.compile:
    info.update(compiled_memory(cfg))
  print(json.dumps(info, indent=2) if args.json else format_info(info))
  return 0


def _check_workdir(workdir: str) -> None:
  from ltm_jax.errors import LtmError
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise LtmError(f"--workdir {workdir} is a file, not a directory")


def _refuse_timeseries(cfg, command: str) -> None:
  """The commands other than train read decoder LMs; a time-series config would be read as one."""
  from ltm_jax.errors import LtmError
  if cfg.timeseries.enabled:
    raise LtmError(f"ltm {command} works on decoder LMs; this is a time-series model (timeseries.enabled): its "
                   "val_* and final test_* metrics are in the workdir's metrics.jsonl")


def _check_lm_workdir(workdir: str, command: str) -> None:
  from ltm_jax.train import checkpoint as ckpt_lib
  _check_workdir(workdir)
  if os.path.isfile(os.path.join(workdir, "config.json")):
    _refuse_timeseries(ckpt_lib.read_config_json(workdir), command)


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _non_negative_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _names(text: str) -> tuple[str, ...]:
  names = tuple(name.strip() for name in text.split(","))
  if not all(names):
    raise argparse.ArgumentTypeError(f"must be comma-separated names, got {text!r}")
  return names


def _probability(text: str) -> float:
  value = float(text)
  if not 0 < value <= 1:  # NaN fails every comparison, so it is refused here too.
    raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
  return value


def _non_negative(text: str) -> float:
  value = float(text)
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
  return value


def _seed(text: str) -> int:
  from ltm_jax.inference.inputs import SEED_RANGE
  value = int(text)
  if not SEED_RANGE[0] <= value < SEED_RANGE[1]:
    raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**63), got {value}")
  return value


def _order_seed(text: str) -> int:
  """A seed that numpy's generator (an order of windows) takes and jax's 32-bit keys do not repeat."""
  value = int(text)
  if not 0 <= value < 2**32:
    raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {value}")
  return value


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--quantize", choices=("int8", "int4"), default=None,
                      help="int8: matmul weights stored as int8 with per-output-channel scales; int4: as int4 with a "
                           "scale per --quantize-group inputs and output channel; read as stored by the GPU's "
                           "quantised matmul, dequantised ahead of the decode loop on CPU")
  parser.add_argument("--quantize-group", type=_positive_int, default=None, metavar="G",
                      help="with --quantize int4: inputs per scale (even, dividing every weight's fan-in, or longer; "
                           "default 128); refused without --quantize int4")
  parser.add_argument("--quantize-keep-int8", type=_names, default=(), metavar="NAMES",
                      help="with --quantize int4: comma-separated weight names stored as int8 instead, each matching "
                           "every weight with a path component of that name (head: the LM head; v,out: attention's "
                           "value and output projections)")


def _check_quantize(args) -> None:
  """Refuses the int4-only flags without --quantize int4 (one rule for both), before anything is loaded."""
  if args.quantize != "int4" and args.quantize_keep_int8:
    raise ValueError("--quantize-keep-int8 keeps some int4 weights at int8; add --quantize int4")
  if args.quantize != "int4" and args.quantize_group is not None:
    raise ValueError("--quantize-group sets int4's inputs per scale; add --quantize int4")


def _quantized(lm, args):
  """`lm` quantised as --quantize, --quantize-group and --quantize-keep-int8 say (unchanged without --quantize)."""
  return lm.quantize(args.quantize, args.quantize_group, args.quantize_keep_int8) if args.quantize else lm


def _quantize_record(args) -> dict:
  """The quantisation flags as a results file records them ({} without --quantize)."""
  if not args.quantize:
    return {}
  record = {"quantize": args.quantize}
  if args.quantize == "int4":
    from ltm_jax.quantize import DEFAULT_GROUP_SIZE
    record.update(quantize_group=args.quantize_group or DEFAULT_GROUP_SIZE,
                  quantize_keep_int8=list(args.quantize_keep_int8))
  return record


class _HelpFormatter(argparse.HelpFormatter):
  """Help that ends each option's text with its default (an option without text gets the default alone), unless
  the text already names one or there is none to show (None, False, an empty list)."""

  @staticmethod
  def _default(action) -> str | None:
    default = action.default
    if not action.option_strings or default in (None, False, argparse.SUPPRESS) or default in ([], ()):
      return None
    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return shown.replace("%", "%%")  # Help text is %-formatted.

  def _format_action(self, action):
    if not action.help and self._default(action) is not None:
      action = copy.copy(action)
      action.help = f"default: {self._default(action)}"
    return super()._format_action(action)

  def _get_help_string(self, action):
    text, default = action.help or "", self._default(action)
    return text if default is None or "default" in text else f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
  """The subcommands' parsers: `_HelpFormatter` help."""

  def __init__(self, **kwargs):
    super().__init__(**{"formatter_class": _HelpFormatter, **kwargs})


def parser() -> argparse.ArgumentParser:
  from ltm_jax import __version__
  p = argparse.ArgumentParser(prog="ltm", description="Train, evaluate and sample Latent Thought language models.")
  p.add_argument("--version", action="version", version=f"ltm {__version__}")
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

  train = sub.add_parser("train", help="train (or resume) a model in a workdir")
  train.add_argument("--config", default=None,
                     help="Python config file, e.g. configs/tiny.py; without it, resume from the workdir's own "
                          "config.json, the overrides on top")
  train.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and TensorBoard files go here")
  train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.d_model=256 train.steps=200")
  train.add_argument("--from-step", type=_non_negative_int, default=None, metavar="N",
                     help="resume from the kept checkpoint of step N instead of the latest, deleting the checkpoints "
                          "and metrics rows after it (after a divergence whose newest checkpoints are already bad)")
  train.add_argument("--compilation-cache", default=None, metavar="DIR",
                     help="JAX's persistent compilation cache, so a restart loads the programs compiled before "
                          "instead of compiling them again ('none': off; default: $JAX_COMPILATION_CACHE_DIR if set, "
                          "else $XDG_CACHE_HOME/ltm_jax/jax-compilation-cache, ~/.cache/... without XDG_CACHE_HOME)")
  train.add_argument("--coordinator-address", default=None,
                     help="multi-process: host:port of process 0 (or LTM_COORDINATOR_ADDRESS; SLURM is detected)")
  train.add_argument("--num-processes", type=_positive_int, default=None, help="multi-process: number of processes")
  train.add_argument("--process-id", type=int, default=None, help="multi-process: this process's id, 0-based")
  train.set_defaults(run=_train)

  ev = sub.add_parser("eval", help="evaluate the latest checkpoint on the validation split; writes eval.json (or "
                                   "a name carrying the step, quantisation and overrides evaluated, or --out)")
  ev.add_argument("--workdir", required=True)
  ev.add_argument("--out", default=None, metavar="FILE",
                  help="write the results here (default: WORKDIR/eval.json for the newest checkpoint as trained, "
                       "else WORKDIR/eval-<what differs>.json, e.g. eval-step300.json, eval-int8.json, "
                       "eval-latent.inner_steps=32.json)")
  ev.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ev.add_argument("--batches", type=_positive_int, default=None, help="limit validation batches (default: all)")
  ev.add_argument("--batch-size", type=_positive_int, default=None)
  ev.add_argument("--curve-steps", type=_non_negative_int, nargs="*", default=[0, 4, 8, 16, 32, 64],
                  help="latent models: inner steps of the ELBO curve elbo_ppl_by_inner_steps (default 0 4 8 16 32 "
                       "64; the trained latent.inner_steps is always one of them)")
  ev.add_argument("--curve-batches", type=_non_negative_int, default=0,
                  help="latent models: validation batches the ELBO curve is measured on (default 0: no curve; 1 "
                       "costs about as much as the rest of a tiny model's evaluation)")
  _add_quantize_arguments(ev)
  ev.add_argument("overrides", nargs="*", metavar="key=value",
                  help="runtime changes, e.g. latent.inner_steps=32 model.wkv_impl=scan")
  ev.set_defaults(run=_eval)

  gen = sub.add_parser("generate", help="sample a continuation of a prompt")
  gen.add_argument("--workdir", required=True)
  gen.add_argument("--prompt", action="append", default=None,
                   help="text to continue (empty: start from the beginning-of-text token); repeat it to decode several "
                        "prompts of any lengths as one batch")
  gen.add_argument("--max-new-tokens", type=_positive_int, default=200)
  gen.add_argument("--temperature", type=_non_negative, default=1.0, help="0 = greedy")
  gen.add_argument("--top-k", type=_positive_int, default=None)
  gen.add_argument("--top-p", type=_probability, default=None)
  gen.add_argument("--seed", type=_seed, default=0)
  gen.add_argument("--step", type=int, default=None)
  _add_quantize_arguments(gen)
  gen.add_argument("--chunk", type=_positive_int, default=16,
                   help="tokens per on-device decode loop between streamed prints (one prompt)")
  gen.add_argument("--latents", choices=("posterior", "prior", "dit"), default=None,
                   help="latent models: z inferred from the prompt (default for prompts of 2+ tokens), drawn from "
                        "N(0, I) (prior) or from the learned prior trained by `ltm train-prior` (dit)")
  gen.add_argument("--sampler", choices=("dpm++", "ddpm"), default=None,
                   help="with --latents dit: DPM-Solver++(2M) or ancestral DDPM (default prior.sampler)")
  gen.add_argument("--sampler-steps", type=_positive_int, default=None,
                   help="with --latents dit: denoiser evaluations (default prior.sampler_steps)")
  gen.add_argument("overrides", nargs="*", metavar="key=value", help="runtime changes, e.g. latent.inner_steps=8")
  gen.set_defaults(run=_generate)

  fit = sub.add_parser("fit-prior", help="stage 2 of a learned prior: the decoder's posteriors over its training "
                                         "windows, written to WORKDIR/prior/posteriors (resumable)")
  fit.add_argument("--workdir", required=True)
  fit.add_argument("--step", type=int, default=None, help="decoder checkpoint step (default: latest)")
  fit.add_argument("--sequences", type=_positive_int, default=None,
                   help="training windows to fit (default: all), taken in an order drawn from --seed")
  fit.add_argument("--heldout-fraction", type=_probability, default=0.2,
                   help="the share of windows kept out of the prior's training, to evaluate it on")
  fit.add_argument("--batch-size", type=_positive_int, default=32)
  fit.add_argument("--shard-size", type=_positive_int, default=256, help="records per shard (a multiple of the batch)")
  fit.add_argument("--seed", type=_order_seed, default=0)
  fit.add_argument("overrides", nargs="*", metavar="key=value", help="runtime changes, e.g. model.attention_impl=xla")
  fit.set_defaults(run=_fit_prior)

  tp = sub.add_parser("train-prior", help="train (or resume) the DiT prior over z on WORKDIR/prior/posteriors; "
                                          "checkpoints in WORKDIR/prior/checkpoints")
  tp.add_argument("--workdir", required=True)
  tp.add_argument("overrides", nargs="*", metavar="prior.key=value", help="e.g. prior.steps=2000 prior.depth=6")
  tp.set_defaults(run=_train_prior)

  info = sub.add_parser("info", help="parameter count, FLOPs per token and estimated memory of a config")
  info.add_argument("--config", required=True)
  info.add_argument("--json", action="store_true", help="print JSON")
  info.add_argument("--compile", action="store_true",
                    help="also compile the train step for this machine's backend (no run) and report XLA's memory "
                         "analysis: compiled_temp_bytes etc.")
  info.add_argument("overrides", nargs="*", metavar="key=value")
  info.set_defaults(run=_info)

  corpus = sub.add_parser("build-corpus", help="write a text corpus folder (train.txt, val.txt, manifest.json with "
                                                "its hash) from the .py files of installed Python packages; "
                                                "train on it with data.source=FOLDER")
  corpus.add_argument("--out", required=True, help="the corpus folder to write (refused if it exists and is not empty)")
  corpus.add_argument("--max-file-bytes", type=_positive_int, default=None,
                      help="skip source files larger than this (default 1,000,000: generated tables, not code)")
  corpus.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
  corpus.add_argument("specs", nargs="*", metavar="NAME[==VERSION]",
                      help="installed distributions to read (default: the pinned set of ltm_jax.data.pycorpus."
                           "DEFAULT_PACKAGES); a missing one, or one at another version than pinned, is refused")
  corpus.set_defaults(run=_build_corpus)

  conv = sub.add_parser("convert-rwkv", help="turn an official RWKV-7 (x070) or RWKV-4 .pth checkpoint into a workdir "
                                             "(needs torch; the CPU build is enough)")
  conv.add_argument("--checkpoint", required=True, help="the official .pth file")
  conv.add_argument("--out", required=True, help="a new workdir (refused if it already holds one)")
  conv.add_argument("--step", type=int, default=0, help="the step number to save the weights at (default 0)")
  conv.add_argument("--tokenizer", default="auto", choices=("auto", "rwkv_world", "byte"),
                    help="auto: rwkv_world for 65536-id vocabularies, else byte (use token ids)")
  conv.set_defaults(run=_convert_rwkv)

  srv = sub.add_parser("serve", help="an HTTP server with continuous batching and OpenAI-compatible completions and "
                                     "chat completions APIs (needs the serve extra)")
  srv.add_argument("--workdir", required=True)
  srv.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  srv.add_argument("--host", default="127.0.0.1", help="the address to listen on")
  srv.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one)")
  srv.add_argument("--max-batch", type=_positive_int, default=32, help="decoding rows (requests decoded together)")
  srv.add_argument("--max-wait-ms", type=_non_negative, default=10.0,
                   help="how long an idle server holds a first request for others to prefill with it")
  srv.add_argument("--queue", type=_positive_int, default=256,
                   help="requests that may wait for a row; more are answered 429")
  _add_quantize_arguments(srv)
  srv.add_argument("--chunk", type=_positive_int, default=16,
                   help="decode steps per on-device loop: new requests join at its boundaries")
  srv.add_argument("--stream-per-chunk", action="store_true",
                   help="hand text out when a decode chunk ends, up to --chunk tokens at once, instead of token by "
                        "token as each step's tokens reach the host (a host round trip a step cheaper)")
  srv.add_argument("--prefill-chunk", type=_non_negative_int, default=128,
                   help="prompts longer than this many tokens are prefilled in pieces of it, one piece between two "
                        "decode chunks, so a long prompt does not stall the running requests for its whole length "
                        "(0: whole prompts at once)")
  srv.add_argument("--prefill-budget", type=_non_negative_int, default=0,
                   help="prompt tokens (each prompt at its padded length bucket) one admission round between decode "
                        "chunks may prefill; the other waiting requests wait for the next round, and decode chunks run "
                        "--waiting-chunk steps while any wait, so each admission stalls the running requests for less "
                        "(0: off, every waiting request that finds a free row is admitted at once)")
  srv.add_argument("--waiting-chunk", type=_non_negative_int, default=0,
                   help="decode steps per on-device loop while requests wait (0: --chunk / 4 with --prefill-budget, "
                        "else --chunk)")
  srv.add_argument("--request-timeout", type=_non_negative, default=0.0,
                   help="seconds a request may take from arrival to its last token; a later one is cancelled and "
                        "answered 504, or streamed an error event (0: no limit)")
  srv.add_argument("--static-batches", action="store_true",
                   help="a benchmark baseline: requests are admitted only when every row is free, so each batch runs "
                        "to completion before the next one starts (no continuous batching)")
  srv.add_argument("--grace", type=_non_negative, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM before they are cancelled")
  srv.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache, so a restart loads the programs compiled before instead "
                        "of compiling them again ('none': off; default: $JAX_COMPILATION_CACHE_DIR if set, else "
                        "$XDG_CACHE_HOME/ltm_jax/jax-compilation-cache, ~/.cache/... without XDG_CACHE_HOME)")
  srv.add_argument("--log-level", choices=("debug", "info", "warning"), default="info",
                   help="the server's log lines on stderr: info writes one access line per request (debug adds "
                        "GET /health and /metrics), warning none")
  srv.add_argument("overrides", nargs="*", metavar="key=value", help="runtime changes, e.g. model.wkv_impl=scan")
  srv.set_defaults(run=_serve)
  return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line's arguments. A command's key=value overrides may come before, between or after its options
  (argparse alone takes only the first run of them, and its intermixed parsing refuses subcommands)."""
  p = parser()
  args, rest = p.parse_known_args(argv)
  if rest and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in rest):
    args.overrides = [*args.overrides, *rest]
  elif rest:
    p.error(f"unrecognized arguments: {' '.join(rest)}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
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
