"""Posterior inference of latent thought vectors: the fast, per-sequence inner loop of Latent Thought Models.

Prior p(z) = N(0, I); posterior q(z|x) = N(mu, diag(exp(logvar))) with its own (mu, logvar) for every sequence
(local parameters, shaped like z: [B, n_layers, n_per_layer, d_model]). `fit` runs Adam on (mu, logvar) to lower each
sequence's negative ELBO, sum_t NLL(x_t | z, x_<t) + KL(q || p), with z = mu + exp(logvar / 2) * eps for one noise
draw eps held fixed across the steps, and a learning rate cosine-decayed within the loop.

No gradient flows through the inner loop to the decoder: the decoder's parameters enter `nll_fn` as constants
(stop_gradient), and the training step takes its decoder gradient with z held fixed, either at a sample of the
fitted posterior or (latent.decoder_objective=iterates) at every iterate of the loop, whose decoder gradients the
loop's own backward passes yield (`fit(..., params=)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ltm_jax import model as model_lib
from ltm_jax.layers.attention import token_positions
from ltm_jax.config import LatentConfig


class Posterior(NamedTuple):
  """q(z|x) = N(mu, diag(exp(logvar))); both [B, n_layers, n_per_layer, d_model] float32."""
  mu: jax.Array
  logvar: jax.Array

  def sample(self, eps: jax.Array) -> jax.Array:
    """The reparameterised z = mu + sigma * eps for standard-normal eps shaped like mu."""
    return self.mu + jnp.exp(0.5 * self.logvar) * eps


def initial_posterior(key: jax.Array, shape: tuple[int, ...], cfg: LatentConfig) -> Posterior:
  """mu = init_mu_std * N(0, 1) (a small random start breaks the symmetry between latent vectors), logvar const."""
  mu = cfg.init_mu_std * jax.random.normal(key, shape, jnp.float32)
  return Posterior(mu, jnp.full(shape, cfg.init_logvar, jnp.float32))


def kl_divergence(posterior: Posterior) -> jax.Array:
  """KL(q || N(0, I)) per sequence, [B]: 0.5 * sum(mu^2 + exp(logvar) - 1 - logvar)."""
  per_dim = 0.5 * (jnp.square(posterior.mu) + jnp.exp(posterior.logvar) - 1.0 - posterior.logvar)
  return per_dim.reshape(per_dim.shape[0], -1).sum(-1)


def inner_schedule(cfg: LatentConfig, steps: int) -> optax.Schedule:
  """inner_lr cosine-decayed to inner_lr * inner_min_lr_ratio over `steps` steps."""
  return optax.cosine_decay_schedule(cfg.inner_lr, max(steps, 1), alpha=cfg.inner_min_lr_ratio)


class FitResult(NamedTuple):
  posterior: Posterior
  nll: jax.Array  # [steps + 1, B] summed NLL of each sequence before every step and after the last.
  kl: jax.Array  # [steps + 1, B] KL(q || p) at the same points.
  path: Posterior  # The steps + 1 posteriors the loop visited (start, after each step): leaves [steps + 1, *z].
  # With `params`: the sum over those steps + 1 iterates of d/dparams of sum_b nll_b at z = q_k.sample(eps); else None.
  params_grad: Any = None


def fit(
    nll_fn: Callable[..., jax.Array],
    posterior: Posterior,
    eps: jax.Array,
    cfg: LatentConfig,
    steps: int | None = None,
    *,
    params: Any = None,
) -> FitResult:
  """Runs `steps` (default cfg.inner_steps) Adam steps on (mu, logvar) from `posterior`, inside one `lax.scan`.

  Args:
    nll_fn: z [B, ...] -> [B] summed token NLL of each sequence given z. Closes over the decoder and its batch; its
      parameters must be constants here (the caller stop_gradients them), as no gradient flows back through `fit`.
      With `params`, it is called as nll_fn(z, params) instead.
    posterior: the starting point (`initial_posterior`).
    eps: standard-normal noise shaped like mu, fixed for every step.
    cfg: the latent config (learning rate, its decay, Adam's betas).
    steps: a static number of steps; 0 returns `posterior` unchanged.
    params: optional decoder parameters to differentiate as well. Each inner step's backward pass through the
      decoder then also yields the decoder's gradient at that iterate (the cost of the weight-gradient products
      only), summed into `params_grad`; the iterates themselves still do not depend on `params` (no gradient flows
      through the updates of (mu, logvar)).

  Returns:
    the fitted posterior (gradients stopped), the per-sequence NLL and KL trace and the path of iterates. Sequences
    are independent: the loss is a sum over sequences and Adam is elementwise, so each (mu, logvar) sees only its
    own sequence.
  """
  steps = cfg.inner_steps if steps is None else steps
  optimizer = optax.adam(inner_schedule(cfg, steps), b1=cfg.inner_b1, b2=cfg.inner_b2)
  with_params = params is not None

  def terms(q: Posterior, p) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    z = q.sample(eps)
    nll, kl = (nll_fn(z, p) if with_params else nll_fn(z)), kl_divergence(q)
    return (nll + kl).sum(), (nll, kl)

  grad_fn = jax.value_and_grad(terms, argnums=(0, 1) if with_params else 0, has_aux=True)

  def gradients(q):
    (_, aux), grads = grad_fn(q, params)
    return aux, (grads if with_params else (grads, None))

  def step(carry, _):
    q, opt_state, params_grad = carry
    (nll, kl), (q_grad, p_grad) = gradients(q)
    updates, opt_state = optimizer.update(q_grad, opt_state, q)
    if with_params:
      params_grad = jax.tree.map(jnp.add, params_grad, p_grad)
    return (optax.apply_updates(q, updates), opt_state, params_grad), (nll, kl, q)

  posterior = jax.lax.stop_gradient(posterior)
  zeros = jax.tree.map(jnp.zeros_like, params) if with_params else None
  (posterior, _, params_grad), (nll, kl, path) = jax.lax.scan(
      step, (posterior, optimizer.init(posterior), zeros), None, length=steps)
  posterior = jax.lax.stop_gradient(posterior)
  if with_params:
    (last_nll, last_kl), (_, p_grad) = gradients(posterior)
    params_grad = jax.tree.map(jnp.add, params_grad, p_grad)
  else:
    _, (last_nll, last_kl) = terms(posterior, None)
  append = lambda trace, last: jnp.concatenate([trace, last[None]])
  path = jax.lax.stop_gradient(jax.tree.map(append, path, posterior))
  return FitResult(posterior, append(nll, last_nll), append(kl, last_kl), path, params_grad)


def token_nll(model, params, inputs: jax.Array, targets: jax.Array, latents: jax.Array | None = None,
              valid: jax.Array | None = None) -> jax.Array:
  """Per-token negative log-likelihood [B, T] float32 of `targets` under `model` given `latents` (or none), without
  materialising the [B, T, vocab] logits (the LM folds its head into the loss, model.loss_chunk positions at a time).
  `valid` [B, T] marks left padding of `inputs` (see `LM`); padded positions' NLL is meaningless."""
  positions = None if valid is None else token_positions(jnp.zeros(inputs.shape[:1], jnp.int32), valid,
                                                          inputs.shape[1])
  nll, _ = model.apply({"params": params}, inputs, None, latents, positions, valid, targets=targets)
  return nll


def infer(
    model: model_lib.LM,
    params,
    inputs: jax.Array,
    targets: jax.Array,
    key: jax.Array,
    *,
    steps: int | None = None,
    target_mask: jax.Array | None = None,
    valid: jax.Array | None = None,
    decoder_grad: bool = False,
) -> tuple[FitResult, jax.Array]:
  """Fits q(z|x) for each sequence of a batch with the inner loop; returns the fit and its fixed noise eps.

  Args:
    model: an `LM` with latents enabled.
    params: its parameters; gradients are stopped (the decoder learns nothing from the inner loop).
    inputs, targets: [B, T] int token ids.
    key: PRNG key for the initial mu and the noise.
    steps: inner steps (default latent.inner_steps).
    target_mask: [B, T] bool; only these targets count (e.g. the first half of each sequence, for continuation).
    valid: [B, T] bool, False on left padding of `inputs` (ragged prompts); targets whose input is padding do not
      count.
    decoder_grad: also return, as `params_grad`, the decoder's gradient of the counted targets' summed NLL at every
      iterate, summed over the iterates (see `fit`).
  """
  cfg = model.latent
  shape = model_lib.latent_shape(model.cfg, cfg, inputs.shape[0])
  init_key, eps_key = jax.random.split(key)
  params = jax.lax.stop_gradient(params)

  if valid is not None:
    target_mask = valid if target_mask is None else target_mask & valid

  def nll_fn(z, p=params):
    nll = token_nll(model, p, inputs, targets, z, valid)
    if target_mask is not None:
      nll = jnp.where(target_mask, nll, 0.0)
    return nll.sum(-1)

  eps = jax.random.normal(eps_key, shape, jnp.float32)
  start = initial_posterior(init_key, shape, cfg)
  return fit(nll_fn, start, eps, cfg, steps, params=params if decoder_grad else None), eps
