"""The subcommands of benchmarks/latent.py that measure without training: `cost` (a latent train step's time against
a plain step's) and `prior` (the learned prior over latent thoughts against N(0, I))."""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import latent_runs
import numpy as np

from ltm_jax import config as config_lib
from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax.api import load
from ltm_jax.prior import posteriors as posteriors_lib
from ltm_jax.prior.metrics import frechet_distance

PLAIN = "latent.enabled=false"
# configs/ltm_code.py (z in the top block, encoder + 2 inner steps on the prefix) and the levers that led to it, each
# written as changes from that config.
EVERY_BLOCK = "latent.top_layers=null,latent.n_per_layer=2"
COST_VARIANTS = (
    PLAIN,
    f"{EVERY_BLOCK},latent.encoder=false,latent.inner_steps=8,latent.inner_lr=0.3,latent.continuation_fraction=0",
    EVERY_BLOCK,
    "latent.top_layers=2,latent.n_per_layer=4",
    "",
    "latent.inner_steps=1",
    "latent.inner_steps=0",
    "latent.encoder_width=64",
)


def cost(args):
  """Every variant's train step is compiled first; then the steps run round-robin, one step of each variant per
  round, so drift in the machine's speed (other jobs, clocks) falls on all of them alike. Reports the median step
  time of each and its ratio to the plain decoder's (latent.enabled=false) beside the ratio of their training FLOPs
  (`ltm_jax.flops`, what `ltm info` prints)."""
  variants = list(args.variant or COST_VARIANTS)
  if PLAIN not in variants:
    variants.insert(0, PLAIN)
  runs = {}
  for variant in variants:
    cfg = config_lib.load_config(args.config, list(args.overrides) + [v for v in variant.split(",") if v])
    step, state, batch, compile_s = common.compiled_train_step(cfg)
    runs[variant] = {"step": step, "state": state, "batch": batch, "compile_s": compile_s, "times": [],
                     "flops": latent_runs.train_flops(cfg)}
    print(f"compiled {variant or '(as is)'} in {compile_s:.1f} s", flush=True)
  for round_ in range(args.rounds + 2):
    for run in runs.values():
      start = time.perf_counter()
      run["state"], metrics = run["step"](run["state"], run["batch"])
      jax.block_until_ready(metrics)
      if round_ >= 2:  # After 2 warm-up rounds.
        run["times"].append(time.perf_counter() - start)
  plain = runs[PLAIN]
  rows = [{"variant": variant, "batch": "x".join(map(str, run["batch"]["inputs"].shape)),
           "compile_s": run["compile_s"], "step_ms": statistics.median(run["times"]) * 1e3,
           "step_ms_min": min(run["times"]) * 1e3, "step_ms_max": max(run["times"]) * 1e3,
           "vs_plain": statistics.median(run["times"]) / statistics.median(plain["times"]),
           "flops_per_token": run["flops"], "flops_vs_plain": run["flops"] / plain["flops"]}
          for variant, run in runs.items()]
  common.print_table(rows, ["variant", "batch", "compile_s", "step_ms", "step_ms_min", "step_ms_max", "vs_plain",
                            "flops_vs_plain"])
  path = common.write_results(args.name, rows, config_file=args.config, overrides=args.overrides, rounds=args.rounds)
  print(f"wrote {path}")


DIT_SOURCES = (("ddpm", 1000), ("dpm++", 10), ("dpm++", 20), ("dpm++", 50))
_token_nll = jax.jit(latent_lib.token_nll, static_argnums=0)
_infer = jax.jit(latent_lib.infer, static_argnums=0)


def _nll_per_token(lm, windows: list[dict], draw) -> float:
  """Mean NLL per token of the validation windows, z for each batch from draw(batch_index, inputs, targets)."""
  total, count = 0.0, 0
  for i, batch in enumerate(windows):
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    total += float(_token_nll(lm.model, lm.params, inputs, targets, draw(i, inputs, targets)).sum())
    count += targets.size
  return total / count


def elbo_rows(lm, windows, bytes_per_token: float, samples: int) -> list[dict]:
  """Per-byte NLL, KL and the perplexity bound exp((NLL + KL) / bytes) under N(0, I) and under the DiT."""
  totals = {"nll": 0.0, "kl_normal": 0.0, "kl_dit": 0.0}
  count = 0
  for i, batch in enumerate(windows):
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    result, _ = _infer(lm.model, lm.params, inputs, targets, jax.random.key(300 + i))
    q = result.posterior
    eps = jax.random.normal(jax.random.key(400 + i), q.mu.shape)
    z = q.sample(eps)
    log_q = -0.5 * (jnp.log(2 * jnp.pi) + q.logvar + jnp.square(eps)).reshape(len(z), -1).sum(-1)
    totals["nll"] += float(_token_nll(lm.model, lm.params, inputs, targets, z).sum())
    totals["kl_normal"] += float(latent_lib.kl_divergence(q).sum())
    totals["kl_dit"] += float((log_q + lm.prior.nll_bound(z, jax.random.key(500 + i), samples)).sum())
    count += targets.size
  per_byte = {k: v / count / bytes_per_token for k, v in totals.items()}
  return [{"prior": name, "nll_per_byte": per_byte["nll"], "kl_per_byte": per_byte[kl],
           "elbo_ppl_per_byte_bound": float(np.exp(per_byte["nll"] + per_byte[kl]))}
          for name, kl in (("N(0, I)", "kl_normal"), ("DiT (KL bounded above)", "kl_dit"))]


def prior(args):
  """The learned prior over latent thoughts against N(0, I), for a workdir after `ltm fit-prior` and `ltm
  train-prior`: Frechet distance to held-out posteriors, the decoder's NLL of validation text under z from each
  source, and sampling throughput.

  Sources of z, each drawn as many times as there are held-out posteriors: N(0, I) (the prior the decoder was trained
  against); a Gaussian with the training posteriors' mean and full covariance (what the Frechet distance, which sees
  only two moments, cannot tell from the truth); the DiT with ancestral DDPM at 1000 steps and DPM-Solver++ at
  10/20/50 steps; and, as the floor, the training posteriors themselves (their distance is the estimator's bias).
  NLL: nats per byte of the validation windows with z from each source (a fresh draw per window), beside z fitted on
  the window itself and on another window (`shuffled`: what a perfect prior would give).

  `--elbo` instead bounds -log p(x) of the validation windows with each prior: NLL given z ~ q (fitted by the inner
  loop as in training) plus KL(q || p), analytic for N(0, I) and for the DiT bounded from above by
  E_q[log q(z) + bound(z)] (`LatentPrior.nll_bound`), so both are valid bounds."""
  lm = load(args.workdir)
  cfg = lm.config
  splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
  windows = data_lib.eval_batches(splits.val, cfg.train.batch_size, cfg.train.seq_len, args.val_batches)
  bytes_per_token = lm.tokenizer.bytes_per_token
  val_windows = sum(len(w["inputs"]) for w in windows)
  if args.elbo:
    rows = elbo_rows(lm, windows, bytes_per_token, args.bound_samples)
    common.print_table(rows, ["prior", "nll_per_byte", "kl_per_byte", "elbo_ppl_per_byte_bound"])
    path = common.write_results(args.name or "latent-prior-elbo", rows, workdir=args.workdir,
                                prior_step=lm.prior.step, bound_samples=args.bound_samples,
                                inner_steps=cfg.latent.inner_steps, val_windows=val_windows)
    print(f"wrote {path}")
    return
  collected = posteriors_lib.PosteriorSet(posteriors_lib.folder_of(args.workdir))
  heldout = collected.heldout()[:, 0]
  n, shape = len(heldout), heldout.shape[1:]
  train_z = collected.read(range(collected.num_train))[:, 0].reshape(collected.num_train, -1).astype(np.float64)
  rng = np.random.default_rng(0)
  mean, cov = train_z.mean(0), np.cov(train_z, rowvar=False)
  sources = {
      "N(0, I)": lambda key, b: jax.random.normal(key, (b, *shape), jnp.float32),
      "Gaussian fit": lambda key, b: jnp.asarray(rng.multivariate_normal(mean, cov, b).reshape(b, *shape),
                                                 jnp.float32),
      **{f"DiT {s} {k}": (lambda s, k: lambda key, b: lm.prior.sample(b, key, s, k))(s, k) for s, k in DIT_SOURCES},
  }

  def fitted(i, inputs, targets, roll=0):
    result, _ = _infer(lm.model, lm.params, inputs, targets, jax.random.key(100 + i))
    return jnp.roll(result.posterior.mu, roll, axis=0)

  rows = [{"source": "training posteriors (floor)", "nfe": 0,
           "fd": frechet_distance(heldout, train_z[rng.permutation(len(train_z))[:n]])}]
  for name, draw in sources.items():
    row = {"source": name, "fd": frechet_distance(heldout, np.asarray(draw(jax.random.key(1), n))),
           "nfe": next((k for s, k in DIT_SOURCES if name == f"DiT {s} {k}"), 0)}
    row["nll_per_byte"] = _nll_per_token(
        lm, windows, lambda i, inputs, _: draw(jax.random.key(200 + i), inputs.shape[0])) / bytes_per_token
    if name.startswith("DiT"):
      draw(jax.random.key(0), args.throughput_batch).block_until_ready()  # Compiled once per shape.
      started = time.perf_counter()
      draw(jax.random.key(3), args.throughput_batch).block_until_ready()
      row["latents_per_sec"] = args.throughput_batch / (time.perf_counter() - started)
    rows.append(row)
    print(row, flush=True)
  for name, roll in (("posterior of the window itself", 0), ("shuffled posterior (another window's)", 1)):
    rows.append({"source": name, "nll_per_byte": _nll_per_token(
        lm, windows, lambda i, inputs, targets: fitted(i, inputs, targets, roll)) / bytes_per_token})
  base = next(r["fd"] for r in rows if r["source"] == "N(0, I)")
  for row in rows:
    if "fd" in row:
      row["fd_vs_normal"] = row["fd"] / base
  common.print_table(rows, ["source", "nfe", "fd", "fd_vs_normal", "nll_per_byte", "latents_per_sec"])
  path = common.write_results(args.name or "latent-prior", rows, workdir=args.workdir, heldout_posteriors=n,
                              training_posteriors=int(collected.num_train), latent_shape=list(shape),
                              prior=dict(vars(lm.prior.cfg)), prior_step=lm.prior.step, val_windows=val_windows)
  print(f"wrote {path}")


def register(commands) -> None:
  """Adds the `cost` and `prior` subcommands to benchmarks/latent.py's parser."""
  raw = argparse.RawDescriptionHelpFormatter
  sub = commands.add_parser("cost", help="a latent train step's time against a plain step's, side by side",
                            description=inspect.cleandoc(cost.__doc__), formatter_class=raw)
  sub.add_argument("--config", default=str(common.ROOT / "configs" / "ltm_code.py"))
  sub.add_argument("--variant", action="append", default=None,
                   help=f"comma-separated key=value overrides; repeat for several (default: {len(COST_VARIANTS)} "
                        f"variants: configs/ltm_code.py and its levers); '{PLAIN}' is the reference, always measured")
  sub.add_argument("--rounds", type=int, default=10, help="steps of every variant, after 2 warm-up rounds")
  sub.add_argument("--name", default="latent-cost-code", help="results file benchmarks/results/<name>-<device>.json")
  sub.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every variant")
  sub.set_defaults(run=cost)
  sub = commands.add_parser("prior", help="the learned prior over latent thoughts against N(0, I)",
                            description=inspect.cleandoc(prior.__doc__), formatter_class=raw)
  sub.add_argument("--workdir", default="runs/latent-window/ltm_cont100_500")
  sub.add_argument("--val-batches", type=int, default=4, help="validation batches of train.batch_size windows")
  sub.add_argument("--throughput-batch", type=int, default=256)
  sub.add_argument("--name", default=None, help="results name (default latent-prior, latent-prior-elbo)")
  sub.add_argument("--elbo", action="store_true", help="only the ELBO with each prior (see above)")
  sub.add_argument("--bound-samples", type=int, default=16, help="log-SNR draws per z in the DiT's bound")
  sub.set_defaults(run=prior)
