"""Posterior inference of latent thought vectors: the fast, per-sequence inner loop of Latent Thought Models.

Prior p(z) = N(0, I); posterior q(z|x) = N(mu, diag(exp(logvar))) with its own (mu, logvar) for every sequence
(local parameters, shaped like z: [B, latent layers, n_per_layer, d_model]). `fit` runs Adam on (mu, logvar) to lower each
sequence's negative ELBO, sum_t NLL(x_t | z, x_<t) + KL(q || p), with z = mu + exp(logvar / 2) * eps for one noise
draw eps held fixed across the steps, and a learning rate cosine-decayed within the loop.

No gradient flows through the inner loop to the decoder: the decoder's parameters enter `nll_fn` as constants
(stop_gradient), and the training step takes its decoder gradient with z held fixed, either at a sample of the
fitted posterior or (latent.decoder_objective=iterates) at every iterate of the loop, whose decoder gradients the
loop's own backward passes yield (`fit(..., params=)`).

With latent.encoder the loop starts from an encoder's proposal (`propose`) rather than from the prior-like
`initial_posterior`; the encoder learns the ELBO at its own proposal, from the gradient the loop takes there.

The second half of the module is the decoder's objective for one training micro-batch (`decoder_terms`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ltm_jax import model as model_lib
from ltm_jax.layers import SplitLatents
from ltm_jax.layers.attention import token_positions
from ltm_jax.config import LatentConfig


class Posterior(NamedTuple):
  """q(z|x) = N(mu, diag(exp(logvar))); both [B, latent layers, n_per_layer, d_model] float32."""
  mu: jax.Array
  logvar: jax.Array

  def sample(self, eps: jax.Array) -> jax.Array:
    """The reparameterised z = mu + sigma * eps for standard-normal eps shaped like mu."""
    return self.mu + jnp.exp(0.5 * self.logvar) * eps


def initial_posterior(key: jax.Array, shape: tuple[int, ...], cfg: LatentConfig,
                      proposal: Posterior | None = None) -> Posterior:
  """Where the inner loop starts: mu = init_mu_std * N(0, 1) (a small random start breaks the symmetry between
  latent vectors) and logvar = init_logvar, or with a `proposal` (an encoder's) its mu plus the same noise and its
  logvar."""
  mu = cfg.init_mu_std * jax.random.normal(key, shape, jnp.float32)
  if proposal is None:
    return Posterior(mu, jnp.full(shape, cfg.init_logvar, jnp.float32))
  return Posterior(proposal.mu + mu, proposal.logvar)


def kl_divergence(posterior: Posterior) -> jax.Array:
  """KL(q || N(0, I)) per sequence, [B]: 0.5 * sum(mu^2 + exp(logvar) - 1 - logvar)."""
  per_dim = 0.5 * (jnp.square(posterior.mu) + jnp.exp(posterior.logvar) - 1.0 - posterior.logvar)
  return per_dim.reshape(per_dim.shape[0], -1).sum(-1)


def inner_schedule(cfg: LatentConfig, steps: int | jax.Array) -> optax.Schedule:
  """inner_lr cosine-decayed to inner_lr * inner_min_lr_ratio over `steps` steps (optax's cosine decay, written out
  so that `steps` may be a traced integer)."""
  steps = jnp.maximum(jnp.asarray(steps, jnp.float32), 1.0)
  alpha = cfg.inner_min_lr_ratio

  def schedule(count):
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(count, steps) / steps))
    return cfg.inner_lr * ((1.0 - alpha) * cosine + alpha)

  return schedule


class FitResult(NamedTuple):
  posterior: Posterior
  nll: jax.Array  # [steps + 1, B] summed NLL of each sequence before every step and after the last.
  kl: jax.Array  # [steps + 1, B] KL(q || p) at the same points.
  path: Posterior  # The steps + 1 posteriors the loop visited (start, after each step): leaves [steps + 1, *z].
  # With `params`: the sum over those steps + 1 iterates of d/dparams of sum_b nll_b at z = q_k.sample(eps); else None.
  params_grad: Any = None
  # With start_grad: d/d(mu, logvar) of sum_b (nll_b + kl_b) at the starting posterior (a Posterior); else None.
  start_grad: Posterior | None = None


def fit(
    nll_fn: Callable[..., jax.Array],
    posterior: Posterior,
    eps: jax.Array,
    cfg: LatentConfig,
    steps: int | None = None,
    *,
    params: Any = None,
    start_grad: bool = False,
    score_fitted: bool = True,
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
    start_grad: also return the negative ELBO's gradient at the starting posterior (the first step's own gradient;
      with 0 steps, computed once).
    score_fitted: score the fitted posterior, the trace's last row (one more forward pass through the decoder).
      False leaves that row's NLL NaN (its KL is still there: it needs no decoder), unless the loop took no step or
      `params` or a 0-step start gradient ask for that pass anyway.

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

  def step(carry, index):
    q, opt_state, params_grad, first_grad = carry
    (nll, kl), (q_grad, p_grad) = gradients(q)
    updates, opt_state = optimizer.update(q_grad, opt_state, q)
    if with_params:
      params_grad = jax.tree.map(jnp.add, params_grad, p_grad)
    if start_grad:
      first_grad = jax.tree.map(lambda kept, g: jnp.where(index == 0, g, kept), first_grad, q_grad)
    return (optax.apply_updates(q, updates), opt_state, params_grad, first_grad), (nll, kl, q)

  posterior = jax.lax.stop_gradient(posterior)
  zeros = jax.tree.map(jnp.zeros_like, params) if with_params else None
  first = jax.tree.map(jnp.zeros_like, posterior) if start_grad else None
  (posterior, _, params_grad, first), (nll, kl, path) = jax.lax.scan(
      step, (posterior, optimizer.init(posterior), zeros, first), jnp.arange(steps))
  posterior = jax.lax.stop_gradient(posterior)
  if with_params or (start_grad and steps == 0):
    (last_nll, last_kl), (q_grad, p_grad) = gradients(posterior)
    params_grad = jax.tree.map(jnp.add, params_grad, p_grad) if with_params else None
    first = q_grad if steps == 0 else first
  elif score_fitted or steps == 0:
    _, (last_nll, last_kl) = terms(posterior, None)
  else:
    last_kl = kl_divergence(posterior)
    last_nll = jnp.full_like(last_kl, jnp.nan)
  append = lambda trace, last: jnp.concatenate([trace, last[None]])
  path = jax.lax.stop_gradient(jax.tree.map(append, path, posterior))
  return FitResult(posterior, append(nll, last_nll), append(kl, last_kl), path, params_grad, first)


def fit_posterior(nll_fn: Callable[[jax.Array], jax.Array], posterior: Posterior, eps: jax.Array, cfg: LatentConfig,
                  steps: jax.Array) -> Posterior:
  """`fit(nll_fn, posterior, eps, cfg, steps).posterior` for a number of steps that may be known only at run time
  (a traced integer): one compiled program serves every step count, as evaluation's sweep over inner steps needs.
  Keeps no trace of the iterates."""
  optimizer = optax.adam(inner_schedule(cfg, steps), b1=cfg.inner_b1, b2=cfg.inner_b2)
  negative_elbo = lambda q: (nll_fn(q.sample(eps)) + kl_divergence(q)).sum()

  def step(_, carry):
    q, opt_state = carry
    updates, opt_state = optimizer.update(jax.grad(negative_elbo)(q), opt_state, q)
    return optax.apply_updates(q, updates), opt_state

  posterior = jax.lax.stop_gradient(posterior)
  fitted, _ = jax.lax.fori_loop(0, steps, step, (posterior, optimizer.init(posterior)))
  return jax.lax.stop_gradient(fitted)


def _positions(inputs: jax.Array, valid: jax.Array | None) -> jax.Array | None:
  return None if valid is None else token_positions(jnp.zeros(inputs.shape[:1], jnp.int32), valid, inputs.shape[1])


def token_nll(model, params, inputs: jax.Array, targets: jax.Array, latents: jax.Array | None = None,
              valid: jax.Array | None = None, trunk: model_lib.Trunk | None = None) -> jax.Array:
  """Per-token negative log-likelihood [B, T] float32 of `targets` under `model` given `latents` (or none), without
  materialising the [B, T, vocab] logits (the LM folds its head into the loss, model.loss_chunk positions at a time).
  `valid` [B, T] marks left padding of `inputs` (see `LM`); padded positions' NLL is meaningless. `trunk`: the
  model's trunk (`trunk_of`) of these inputs, so that only the latent-reading blocks run."""
  nll, _ = model.apply({"params": params}, inputs, None, latents, _positions(inputs, valid), valid, targets=targets,
                       trunk=trunk)
  return nll


def trunk_of(model, params, inputs: jax.Array, valid: jax.Array | None = None) -> model_lib.Trunk:
  """The output of a latent model's blocks below the first that reads z (`model_lib.Trunk`, [B, T, d_model]): what
  every NLL of these inputs under any z starts from."""
  return model.apply({"params": params}, inputs, None, None, _positions(inputs, valid), valid, trunk_only=True)


def propose(model: model_lib.LM, params, tokens: jax.Array, visible: jax.Array) -> Posterior:
  """The amortised encoder's q(z|x) from the `visible` [B, T] tokens of `tokens` [B, T] (a model with
  latent.encoder; `params` are the model's, holding the encoder's under model_lib.ENCODER)."""
  encoder = model_lib.latent_encoder(model.cfg, model.latent)
  if model_lib.ENCODER not in params:
    raise ValueError("latent.encoder is on but the parameters hold no latent encoder; initialise them with "
                     "model.init_params(..., latent) of the same latent config")
  mu, logvar = encoder.apply({"params": params[model_lib.ENCODER]}, tokens, visible)
  shape = model_lib.latent_shape(model.cfg, model.latent, tokens.shape[0])
  return Posterior(mu.reshape(shape), logvar.reshape(shape))


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
    length: int | None = None,
    proposal: Posterior | None = None,
    start_grad: bool = False,
    trace: bool = True,
    trunk: model_lib.Trunk | None = None,
    score_fitted: bool = True,
    shared_noise: bool = False,
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
    length: read only the first `length` positions (static): every counted target must lie before it. The decoder
      is causal, so the fit is the same as on the whole rows, for a fraction of the cost.
    proposal: where to start instead of the model's own start (the encoder's proposal from the counted targets with
      latent.encoder, else the prior-like `initial_posterior`); the loop's symmetry-breaking noise is added to it.
    start_grad: also return the gradient at the start (see `fit`), from which an encoder learns.
    trace: False returns only the fitted posterior (the FitResult's traces and path are None), and `steps` may then
      be a traced integer (`fit_posterior`).
    trunk: the model's trunk (`trunk_of`) of `inputs` (computed here when None), from which every inner step runs the
      latent-reading blocks only. Unused with decoder_grad, whose decoder gradient runs the whole model.
    score_fitted: see `fit`.
    shared_noise: one draw of the start's noise and of eps for every row. Each row's fit is distributed as without
      it, but its posterior mean is then a function of its data alone, so its variance over rows (active units) is
      the data's: with a noise of its own, a row whose decoder ignores z still moves mu by about the learning rate
      a step, in directions its own noise picks.
  """
  cfg = model.latent
  if length is not None:
    inputs, targets = inputs[:, :length], targets[:, :length]
    target_mask = None if target_mask is None else target_mask[:, :length]
    valid = None if valid is None else valid[:, :length]
  shape = model_lib.latent_shape(model.cfg, cfg, inputs.shape[0])
  init_key, eps_key = jax.random.split(key)
  params = jax.lax.stop_gradient(params)
  if decoder_grad:
    trunk = None
  elif trunk is None:
    trunk = trunk_of(model, params, inputs, valid)
  else:
    trunk = jax.lax.stop_gradient(trunk.prefix(length))

  if valid is not None:
    target_mask = valid if target_mask is None else target_mask & valid
  if proposal is None and cfg.encoder:
    counted = jnp.ones(targets.shape, bool) if target_mask is None else target_mask
    proposal = propose(model, params, targets, counted)

  def nll_fn(z, p=params):
    nll = token_nll(model, p, inputs, targets, z, valid, trunk)
    if target_mask is not None:
      nll = jnp.where(target_mask, nll, 0.0)
    return nll.sum(-1)

  noise_shape = (1, *shape[1:]) if shared_noise else shape
  eps = jnp.broadcast_to(jax.random.normal(eps_key, noise_shape, jnp.float32), shape)
  start = initial_posterior(init_key, noise_shape, cfg,
                            jax.lax.stop_gradient(proposal) if proposal is not None else None)
  start = jax.tree.map(lambda x: jnp.broadcast_to(x, shape), start)
  if not trace:
    steps = cfg.inner_steps if steps is None else steps
    return FitResult(fit_posterior(nll_fn, start, eps, cfg, steps), None, None, None), eps
  return fit(nll_fn, start, eps, cfg, steps, params=params if decoder_grad else None, start_grad=start_grad,
             score_fitted=score_fitted), eps


# ------------------------------------------------------------------------------------------ the decoder's objective


def continuation_masks(key: jax.Array, shape: tuple[int, int], fraction: float) -> tuple[jax.Array, jax.Array]:
  """(fit [B, T], score [B, T]) bool masks over the targets of a batch. The first round(fraction * B) rows are
  continuation rows: z is fitted on their targets before a split drawn uniformly from [T/4, split_bound(T)) and
  the decoder scores the targets from the split on. Every other row is fitted and scored whole."""
  batch, length = shape
  rows = round(fraction * batch)
  split = jax.random.randint(key, (batch, 1), length // 4, split_bound(length))
  split = jnp.where(jnp.arange(batch)[:, None] < rows, split, length)
  before = jnp.arange(length)[None, :] < split
  return before | (split == length), ~before | (split == length)


def split_bound(length: int) -> int:
  """Continuation splits of rows of `length` targets lie below this (3/4 of the row): no fitted target beyond."""
  return max(3 * length // 4, length // 4 + 1)


class DecoderTerms(NamedTuple):
  """What the decoder is trained on for one micro-batch of a latent model (`decoder_terms`).

  scored: (z [B, ...] or a `SplitLatents` pair, mask [B, T] or None, length or None) triples; the loss is the NLL of
  every triple's masked targets given its z (held constant), read on the first `length` positions (None: all),
  summed over the triples and divided by the number of scored targets. None with iterates_grad.
  iterates_grad: with latent.decoder_objective=iterates, the decoder's gradient itself (else None).
  encoder_grad: with latent.encoder, the gradient of the encoder's parameters (the ELBO per fitted token at its
  proposal), to add to theirs (else None).
  metrics: kl (per fitted token) and the inner loop's ELBO per fitted token at its start (and `loss` with
  iterates_grad)."""
  scored: tuple[tuple[jax.Array, jax.Array | None, int | None], ...] | None
  iterates_grad: Any
  encoder_grad: Any
  metrics: dict[str, jax.Array]


def decoder_terms(model: nn.Module, params, batch, key: jax.Array,
                  trunk: model_lib.Trunk | None = None) -> DecoderTerms:
  """The inner loop's fit for one micro-batch, and the decoder objective that follows from it.

  latent.decoder_objective=final: z is drawn (fresh noise) from the posterior fitted on each row's fit mask
  (`continuation_masks`; whole rows when latent.continuation_fraction is 0) and scores the row's score mask.
  Continuation rows also score their prefix, under z_0 = the prior-like start (`initial_posterior` with the loop's
  noise, which carries no information), so the decoder learns from every token: what z fitted on text before the
  split adds to the rest, and how to do without it. When every row is a continuation row, the inner loop and the
  prefix's scoring read only the positions before split_bound. When only the last block reads z, one pass scores
  both (`one_pass_split`).
  iterates: the decoder's gradient of the mean over the K + 1 iterates of the NLL per token, taken by the inner
  loop's own backward passes.
  With latent.encoder the loop starts from the encoder's proposal for the fitted targets. `trunk`: the model's trunk
  of the batch's inputs (`trunk_of`), which the inner loop then need not compute again."""
  latent = model.latent
  fit_key, sample_key, split_key = jax.random.split(key, 3)
  inputs, targets = batch["inputs"], batch["targets"]
  fit_mask = score_mask = prefix = None
  if latent.continuation_fraction > 0:
    fit_mask, score_mask = continuation_masks(split_key, targets.shape, latent.continuation_fraction)
    if round(latent.continuation_fraction * targets.shape[0]) == targets.shape[0]:
      prefix = split_bound(targets.shape[1])
  iterates = latent.decoder_objective == "iterates"
  proposal = encoder_grad_fn = None
  if latent.encoder:
    visible = jnp.ones(targets.shape, bool) if fit_mask is None else fit_mask
    proposal, encoder_grad_fn = jax.vjp(
        lambda p: propose(model, dict(params, **{model_lib.ENCODER: p}), targets[:, :prefix], visible[:, :prefix]),
        params[model_lib.ENCODER])
  # The fitted posterior is not scored on the fitted tokens: the decoder's own pass scores what it is trained on.
  fitted, eps = infer(model, params, inputs, targets, fit_key, target_mask=fit_mask, decoder_grad=iterates,
                      length=prefix, proposal=proposal, start_grad=latent.encoder, trunk=trunk, score_fitted=False)
  tokens = targets.size if fit_mask is None else fit_mask.sum()
  metrics = {"kl": fitted.kl[-1].sum() / tokens, "inner_elbo_start": (fitted.nll[0] + fitted.kl[0]).sum() / tokens}
  encoder_grad = None
  if encoder_grad_fn is not None:  # The start is the proposal plus noise: its gradient is the proposal's.
    (encoder_grad,) = encoder_grad_fn(jax.tree.map(lambda g: g / tokens, fitted.start_grad))
  if iterates:
    count = fitted.nll.shape[0] * tokens  # (K + 1) iterates of every fitted token.
    metrics["loss"] = fitted.nll.sum() / count
    return DecoderTerms(None, jax.tree.map(lambda g: g / count, fitted.params_grad), encoder_grad, metrics)
  z = fitted.posterior.sample(jax.random.normal(sample_key, eps.shape, eps.dtype))
  if fit_mask is None:
    return DecoderTerms(((z, None, None),), None, encoder_grad, metrics)
  init_key = jax.random.split(fit_key)[0]  # As `infer` splits it: the loop's own symmetry-breaking draw.
  z_0 = initial_posterior(init_key, eps.shape, latent).sample(eps)
  prefix_mask = fit_mask & ~score_mask
  if one_pass_split(model.cfg, latent):
    return DecoderTerms(((SplitLatents(z_0, z, prefix_mask), None, None),), None, encoder_grad, metrics)
  return DecoderTerms(((z, score_mask, None), (z_0, prefix_mask, prefix)), None, encoder_grad, metrics)


def one_pass_split(cfg, latent: LatentConfig) -> bool:
  """Whether one pass can score a continuation row's prefix under z_0 and the rest under z (`SplitLatents`) with the
  NLL of two separate passes: when z is read by the last block alone. Its cross-attention then feeds only its own
  position's FFN and logits (the block's self-attention comes before it, on z-free inputs), so no position's output
  depends on the latents another position read."""
  return model_lib.latent_layers(cfg, latent) == 1 and not cfg.scan_layers
