"""The learned prior over latent thoughts against N(0, I): Frechet distance to held-out posteriors, the decoder's NLL
of validation text under z from each source, and sampling throughput.

  ltm fit-prior --workdir runs/latent-window/ltm_cont100_500        # stage 2: posteriors of the training windows
  ltm train-prior --workdir runs/latent-window/ltm_cont100_500      # the DiT
  python benchmarks/latent_prior.py --workdir runs/latent-window/ltm_cont100_500

Sources of z, each drawn as many times as there are held-out posteriors (the windows kept out of the prior's
training): N(0, I) (the prior the decoder was trained against); a Gaussian with the training posteriors' mean and
full covariance (what the Frechet distance, which sees only two moments, cannot tell from the truth); the DiT with
ancestral DDPM at 1000 steps and DPM-Solver++ at 10/20/50 steps; and, as the floor, the training posteriors
themselves (samples of the same distribution as the held-out set, so their distance is the estimator's bias).

NLL: nats per byte of the validation windows with z from each source (a fresh draw per window), beside z fitted on
the window itself (the posterior) and on another window (`shuffled`, a draw from the aggregate posterior: what a
perfect prior would give). Writes benchmarks/results/latent-prior-<device>.json.

`--elbo` instead bounds -log p(x) of the validation windows with each prior: NLL given z ~ q (fitted by the inner
loop as in training) plus KL(q || p), analytic for N(0, I) and for the DiT bounded from above by
E_q[log q(z) + bound(z)] (`LatentPrior.nll_bound`), so both are valid bounds (benchmarks/results/latent-prior-elbo-*).
"""

from __future__ import annotations

import argparse
import time

import common  # First: puts the checkout on sys.path.

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax.api import load
from ltm_jax.prior import posteriors as posteriors_lib
from ltm_jax.prior.metrics import frechet_distance

DIT_SOURCES = (("ddpm", 1000), ("dpm++", 10), ("dpm++", 20), ("dpm++", 50))


def _nll_per_token(lm, windows: list[dict], draw) -> float:
  """Mean NLL per token of the validation windows, z for each batch from draw(batch_index, inputs, targets)."""
  total, count = 0.0, 0
  for i, batch in enumerate(windows):
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    z = draw(i, inputs, targets)
    total += float(_token_nll(lm.model, lm.params, inputs, targets, z).sum())
    count += targets.size
  return total / count


_token_nll = jax.jit(latent_lib.token_nll, static_argnums=0)
_infer = jax.jit(latent_lib.infer, static_argnums=0)


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default="runs/latent-window/ltm_cont100_500")
  parser.add_argument("--val-batches", type=int, default=4, help="validation batches of train.batch_size windows")
  parser.add_argument("--throughput-batch", type=int, default=256)
  parser.add_argument("--name", default=None, help="results name (default latent-prior, latent-prior-elbo)")
  parser.add_argument("--elbo", action="store_true", help="only the ELBO with each prior (see above)")
  parser.add_argument("--bound-samples", type=int, default=16, help="log-SNR draws per z in the DiT's bound")
  args = parser.parse_args()

  lm = load(args.workdir)
  prior, cfg = lm.prior, lm.config
  splits = data_lib.load_splits(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
  windows = data_lib.eval_batches(splits.val, cfg.train.batch_size, cfg.train.seq_len, args.val_batches)
  bytes_per_token = lm.tokenizer.bytes_per_token
  if args.elbo:
    rows = elbo_rows(lm, windows, bytes_per_token, args.bound_samples)
    common.print_table(rows, ["prior", "nll_per_byte", "kl_per_byte", "elbo_ppl_per_byte_bound"])
    path = common.write_results(args.name or "latent-prior-elbo", rows, workdir=args.workdir,
                                prior_step=prior.step, bound_samples=args.bound_samples,
                                inner_steps=cfg.latent.inner_steps,
                                val_windows=sum(len(w["inputs"]) for w in windows))
    print(f"wrote {path}")
    return
  collected = posteriors_lib.PosteriorSet(posteriors_lib.folder_of(args.workdir))
  heldout = collected.heldout()[:, 0]
  n = len(heldout)
  train = collected.read(range(collected.num_train))
  train_z = train[:, 0].reshape(len(train), -1).astype(np.float64)
  shape = heldout.shape[1:]
  rng = np.random.default_rng(0)
  mean, cov = train_z.mean(0), np.cov(train_z, rowvar=False)
  sources = {
      "N(0, I)": lambda key, b: jax.random.normal(key, (b, *shape), jnp.float32),
      "Gaussian fit": lambda key, b: jnp.asarray(rng.multivariate_normal(mean, cov, b).reshape(b, *shape),
                                                 jnp.float32),
  }
  for sampler, steps in DIT_SOURCES:
    sources[f"DiT {sampler} {steps}"] = (lambda s, k: lambda key, b: prior.sample(b, key, s, k))(sampler, steps)

  def fitted(i, inputs, targets, roll=0):
    result, _ = _infer(lm.model, lm.params, inputs, targets, jax.random.key(100 + i))
    return jnp.roll(result.posterior.mu, roll, axis=0)

  rows = []
  floor = frechet_distance(heldout, train_z[rng.permutation(len(train_z))[:n]])
  rows.append({"source": "training posteriors (floor)", "fd": floor, "nfe": 0})
  for name, draw in sources.items():
    z = np.asarray(draw(jax.random.key(1), n))
    row = {"source": name, "fd": frechet_distance(heldout, z),
           "nfe": next((k for s, k in DIT_SOURCES if name == f"DiT {s} {k}"), 0)}
    row["nll_per_byte"] = _nll_per_token(
        lm, windows, lambda i, inputs, _: draw(jax.random.key(200 + i), inputs.shape[0])) / bytes_per_token
    if name.startswith("DiT"):
      batch = args.throughput_batch
      draw(jax.random.key(0), batch).block_until_ready()  # Compiled once per shape.
      started = time.perf_counter()
      draw(jax.random.key(3), batch).block_until_ready()
      row["latents_per_sec"] = batch / (time.perf_counter() - started)
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
                              prior=dict(vars(prior.cfg)), prior_step=prior.step,
                              val_windows=sum(len(w["inputs"]) for w in windows))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
