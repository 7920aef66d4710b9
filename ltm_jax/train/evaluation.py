"""The full evaluation behind `ltm eval`: likelihood bounds, continuation perplexity and latent diagnostics.

For a latent model, per token over the validation windows (see docs/cli.md, "`ltm eval`: eval.json"):
  nll               NLL given z drawn (fresh noise) from q(z|x) fitted on the whole sequence
  kl                KL(q || p) per token
  elbo_ppl          exp((NLL_sum + KL) / T): an UPPER BOUND on the perplexity (the ELBO bounds -log p(x))
  continuation_ppl  z fitted on the first half of each sequence only, perplexity of the second half: the number that
                    compares with an autoregressive LM's perplexity on the same second halves
  prior_nll         NLL with z drawn from the prior N(0, I)
  shuffled_nll      NLL with z fitted on another sequence of the batch (the decoder uses z if this is worse than nll)
  active_units      latent dimensions whose posterior mean varies across sequences (Var > 0.01, Burda et al. 2016)
  mu_abs            mean |mu| of the posterior means (prior units: 0 is the prior's mean, 1 its standard deviation)
  elbo_ppl_by_inner_steps  elbo_ppl when the inner loop runs 0, 4, 8, 16, 32, 64 steps, over the first
                    `curve_batches` batches (curve_tokens tokens)
The plain decoder gets the same keys where they mean something: kl = 0, elbo_ppl = exp(nll) exactly.

Training runs the same computation at every evaluation (without the inner-steps curve, `validation_metrics`), so
the diagnostics in metrics.jsonl are the numbers `ltm eval` gives for the same batches and seed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib

CURVE_STEPS = (0, 4, 8, 16, 32, 64)
ACTIVE_UNIT_THRESHOLD = 0.01


def batch_metrics(model, params, inputs, targets, key, steps: int | jax.Array, full: bool,
                  index: int | jax.Array = 0) -> dict[str, jax.Array]:
  """Sums over batch `index` [B, T] of an evaluation whose key is `key`, the posteriors fitted with `steps` inner
  steps (a traced integer is fine). Every row of every batch starts its fit from the same noise (`key`'s; `infer`'s
  shared_noise): each row's numbers are distributed as with noise of its own, and its posterior mean is a function
  of its data, whose variance over the rows active units measure. z's samples come from `key` and `index`. `full`
  adds everything beyond the ELBO (continuation, prior, shuffled, mu)."""
  latent = model_lib.uses_latents(model.latent)
  length = targets.shape[1]
  second_half = jnp.arange(length) >= length // 2
  if latent is None:
    nll = latent_lib.token_nll(model, params, inputs, targets)
    return {"nll": nll.sum(), "kl": jnp.zeros(()), "continuation_nll": (nll * second_half).sum()}

  def posterior_sample(fit_key, sample_key, mask=None, prefix=None):
    fitted, eps = latent_lib.infer(model, params, inputs, targets, fit_key, steps=steps, target_mask=mask,
                                   length=prefix, trace=False, shared_noise=True)
    return fitted.posterior, fitted.posterior.sample(jax.random.normal(sample_key, eps.shape))

  fit_root, sample_root = jax.random.split(key)  # Apart: a batch's sample keys never repeat a fit's noise.
  fit_keys = jax.random.split(fit_root)
  keys = jax.random.split(jax.random.fold_in(sample_root, index), 3)
  posterior, z = posterior_sample(fit_keys[0], keys[0])
  out = {"nll": latent_lib.token_nll(model, params, inputs, targets, z).sum(),
         "kl": latent_lib.kl_divergence(posterior).sum()}
  if full:  # The first half's fit reads the first half only: the decoder is causal, so it is the same fit.
    _, z_first_half = posterior_sample(fit_keys[1], keys[1], jnp.broadcast_to(~second_half, targets.shape),
                                       length // 2)
    nll = latent_lib.token_nll(model, params, inputs, targets, z_first_half)
    out["continuation_nll"] = (nll * second_half).sum()
    out["prior_nll"] = latent_lib.token_nll(model, params, inputs, targets,
                                            jax.random.normal(keys[2], z.shape)).sum()
    out["shuffled_nll"] = latent_lib.token_nll(model, params, inputs, targets, jnp.roll(z, 1, axis=0)).sum()
    out["mu"] = posterior.mu.reshape(posterior.mu.shape[0], -1)
  return out


def make_batch_metrics(model, layout=None):
  """`batch_metrics` for `model`, jitted as fn(params, inputs, targets, key, steps, full, index) (full static; the
  inner steps are a run-time value, so every step count runs the same program); with a `layout` (ltm_jax.parallel)
  compiled for its mesh, params and batch as placed, results replicated."""
  fn = functools.partial(batch_metrics, model)
  if layout is None:
    return jax.jit(fn, static_argnums=5)
  return layout.jit(fn, static_argnums=5, out_shardings=layout.replicated)


# The default for one device: jitted with the model static, so each model compiles once per value of `full`.
_jitted_batch_metrics = jax.jit(batch_metrics, static_argnums=(0, 6))


def full_evaluation(model: model_lib.LM, params, batches: Iterable[dict[str, Any]], *, seed: int = 0,
                    bytes_per_token: float | None = None, curve_steps: Iterable[int] = CURVE_STEPS,
                    curve_batches: int | None = None, metrics_fn=None,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
  """Every metric of the module docstring over `batches` (dicts of [B, T] inputs/targets); z draws from `seed`;
  the ELBO curve at `curve_steps` inner steps (and at latent.inner_steps) over the first `curve_batches` batches
  (None: all). `metrics_fn`: `make_batch_metrics`'s function to run (default: one jitted for the model on the
  default device). `progress(done, total)` is called after every batch."""
  metrics_fn = metrics_fn or functools.partial(_jitted_batch_metrics, model)
  latent = model_lib.uses_latents(model.latent)
  batches = list(batches)
  if latent is not None and any(b["inputs"].shape[0] < 2 for b in batches):
    raise ValueError("shuffled_nll needs at least 2 sequences per batch; raise --batch-size")
  curve_batches = len(batches) if curve_batches is None else min(curve_batches, len(batches))
  curve_steps = list(curve_steps) if curve_batches else []
  curve = sorted(set(curve_steps) | {latent.inner_steps}) if latent is not None and curve_steps else []
  main_steps = latent.inner_steps if latent is not None else 0
  totals: dict[str, float] = {}
  curve_totals = {steps: 0.0 for steps in curve}
  mu_sum = mu_sq = None
  mu_abs = 0.0
  tokens = sequences = curve_tokens = 0
  key = jax.random.key(seed)
  for index, batch in enumerate(batches):
    out = jax.device_get(metrics_fn(params, batch["inputs"], batch["targets"], key, main_steps, True, index))
    mu = out.pop("mu", None)
    for k, v in out.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    if mu is not None:
      mu = mu.astype(np.float64)
      mu_sum = mu.sum(0) if mu_sum is None else mu_sum + mu.sum(0)
      mu_sq = (mu**2).sum(0) if mu_sq is None else mu_sq + (mu**2).sum(0)
      mu_abs += float(np.abs(mu).sum())
    for steps in curve if index < curve_batches else ():
      if steps == main_steps:
        curve_totals[steps] += float(out["nll"]) + float(out["kl"])
      else:
        part = metrics_fn(params, batch["inputs"], batch["targets"], key, steps, False, index)
        curve_totals[steps] += float(part["nll"]) + float(part["kl"])
    curve_tokens += batch["targets"].size if index < curve_batches else 0
    tokens += batch["targets"].size
    sequences += batch["targets"].shape[0]
    if progress is not None:
      progress(index + 1, len(batches))
  if not tokens:
    raise ValueError("no validation batches to evaluate")

  second_half_tokens = sum(b["targets"].shape[0] * (b["targets"].shape[1] - b["targets"].shape[1] // 2)
                           for b in batches)
  nll, kl = totals["nll"] / tokens, totals["kl"] / tokens
  metrics: dict[str, Any] = {
      "nll": nll,
      "kl": kl,
      "elbo": nll + kl,
      "elbo_ppl": _ppl(nll + kl),
      "elbo_ppl_is_upper_bound": latent is not None,
      "continuation_ppl": _ppl(totals["continuation_nll"] / second_half_tokens),
      "prior_nll": totals["prior_nll"] / tokens if latent is not None else None,
      "shuffled_nll": totals["shuffled_nll"] / tokens if latent is not None else None,
      "active_units": None,
      "latent_dims": None,
      "mu_abs": None,
      "elbo_ppl_by_inner_steps": {str(s): _ppl(v / curve_tokens) for s, v in curve_totals.items()},
      "curve_tokens": curve_tokens if curve else 0,
      "inner_steps": main_steps,
      "tokens": tokens,
      "sequences": sequences,
  }
  if mu_sum is not None:
    variance = mu_sq / sequences - (mu_sum / sequences) ** 2
    metrics["active_units"] = int((variance > ACTIVE_UNIT_THRESHOLD).sum())
    metrics["latent_dims"] = int(variance.size)
    metrics["mu_abs"] = float(mu_abs / (sequences * variance.size))
  if bytes_per_token:
    metrics["elbo_bpb"] = (nll + kl) / math.log(2) / bytes_per_token
  return metrics


def latent_worth(metrics: dict[str, Any]) -> str | None:
  """What z is worth in a full evaluation of a latent model, as one line a person reads (None for a plain decoder):
  continuation perplexity, what z fitted on another sequence and z from the prior cost against each sequence's own z,
  and the active latent dimensions."""
  if metrics.get("shuffled_nll") is None:
    return None
  active = f"; {metrics['active_units']}/{metrics['latent_dims']} latent dimensions active" if (
      metrics.get("active_units") is not None) else ""
  return (f"z is worth: continuation perplexity {metrics['continuation_ppl']:.3f} (z fitted on each sequence's first "
          f"half, the second half scored); z from another sequence costs "
          f"{metrics['shuffled_nll'] - metrics['nll']:.3f} nats/token, z from the prior "
          f"{metrics['prior_nll'] - metrics['nll']:.3f}{active}")


def _ppl(nll_per_token: float) -> float:
  """exp(NLL per token); infinity where that overflows a float (a diverged model's NLL), instead of an OverflowError."""
  try:
    return math.exp(nll_per_token)
  except OverflowError:
    return math.inf


# The full evaluation's keys that training logs at every evaluation, as val_<key>.
VALIDATION_KEYS = ("nll", "kl", "continuation_ppl", "prior_nll", "shuffled_nll", "active_units", "mu_abs")


def validation_metrics(model: model_lib.LM, params, batches, *, seed: int, bytes_per_token: float | None,
                       metrics_fn=None) -> dict[str, Any]:
  """What training logs at each evaluation: `full_evaluation` without the inner-steps curve, as val_loss (NLL + KL
  per token: the exact NLL of a plain decoder, the ELBO bound of a latent model), val_bpb and val_<key> for
  VALIDATION_KEYS (None-valued keys, the latent diagnostics of a plain decoder, are left out)."""
  evaluation = full_evaluation(model, params, batches, seed=seed, bytes_per_token=bytes_per_token, curve_steps=(),
                               metrics_fn=metrics_fn)
  metrics = {"val_loss": evaluation["elbo"], "val_tokens": evaluation["tokens"]}
  if "elbo_bpb" in evaluation:
    metrics["val_bpb"] = evaluation["elbo_bpb"]
  metrics.update({f"val_{k}": evaluation[k] for k in VALIDATION_KEYS if evaluation[k] is not None})
  return metrics
