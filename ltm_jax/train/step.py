"""The jitted train and eval steps. A train step averages gradients over `grad_accum` micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from ltm_jax import latent as latent_lib
from ltm_jax import loss_scale as loss_scale_lib
from ltm_jax import model as model_lib
from ltm_jax.state import TrainState, create_train_state, run_keys  # noqa: F401  (re-exported)
from ltm_jax.train.optimizer import global_norm

if TYPE_CHECKING:
  from ltm_jax.parallel import Layout


def token_nll(model: nn.Module, params, batch, latents=None, length: int | None = None,
              trunk: model_lib.Trunk | None = None) -> tuple[jax.Array, jax.Array]:
  """Per-token negative log-likelihood [B, T] (float32; [B, length] of the first `length` positions) and the number
  of tokens; from the batch's `trunk` (a latent model's lower blocks' output) when given."""
  trunk = None if trunk is None else trunk.prefix(length)
  nll = latent_lib.token_nll(model, params, batch["inputs"][:, :length], batch["targets"][:, :length], latents,
                             trunk=trunk)
  return nll, jnp.asarray(nll.size, jnp.float32)


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_accum: int, layout: Layout | None = None, loss_fn=None, params_view=None):
  """Returns jitted `step(state, batch) -> (state, metrics)`; batch leaves lead with B, B % grad_accum == 0.

  `loss_fn(params, micro_batch) -> (loss, metrics)` replaces the decoder's token NLL (e.g. a time-series head's
  loss; its metrics are averaged over micro-batches beside `loss`); None: the token NLL of batches of [B, T]
  inputs/targets, with latent inference when the model has latents.

  With latents (model.latent enabled) each micro-batch first fits its posterior in the inner loop (fast learning),
  then the decoder takes one gradient with z held constant (slow learning; `latent.decoder_terms`): of the NLL
  given z sampled from the fitted posterior, or of the mean NLL over the loop's iterates. `loss` is that decoder
  objective per scored token; `kl` (per fitted token) is logged beside it, so with whole-sequence fits and the final
  objective, loss + kl is the training ELBO per token. The blocks below the first that reads z (the trunk) run once
  per micro-batch, forward and backward: the inner loop and every scored z start from their output, and the
  decoder's gradient flows back into them once, through the sum of every scored pass's cotangents.

  With a `layout` (ltm_jax.parallel) the step is compiled for its mesh: state and batch arrive and leave in the
  layout's shardings (the state donated), every micro-batch is split like the batch, each micro-batch's gradient and
  their running sum are laid out like the parameters (no device holds the whole gradient of a split parameter), and
  metrics come back replicated.

  `params_view(params) -> params` is what the model computes with, differentiated through (quantisation-aware
  training passes `quantize.fake_quantize_params`: rounded weights forward, a straight-through gradient backward);
  None: the parameters themselves."""
  latent = model_lib.uses_latents(getattr(model, "latent", None))
  view = params_view or (lambda params: params)
  # float16 gradients underflow: differentiate the loss times a dynamic scale, unscale in float32, and skip the
  # update (halving the scale) when a gradient overflows.
  scaled = model.cfg.dtype == "float16"

  def loss(params, micro, scored, scale, trunk=None):
    params, extra = view(params), {}
    if loss_fn is not None:
      value, extra = loss_fn(params, micro)
    elif scored is None:
      value = token_nll(model, params, micro)[0].mean()
    else:
      total = count = 0.0
      for z, mask, length in scored:
        nll, size = token_nll(model, params, micro, z, length, trunk)
        total, count = (total + nll.sum(), count + size) if mask is None else (
            total + (nll * mask[:, :length]).sum(), count + mask.sum())
      value = total / count
    return (loss_scale_lib.scale_loss(scale, value) if scaled else value), (value, extra)

  def like_params(tree, replicated_too: bool = False):
    """`tree` (shaped like the parameters) laid out like the split parameters (all of them with `replicated_too`);
    a no-op without a layout. Inside the micro-batch loop the replicated ones (norm scales, per-channel mixes) are
    left to XLA, which keeps their running sums split over the batch axes and gathers them once after the loop,
    rather than once per micro-batch."""
    if layout is None:
      return tree
    constrain = lambda x, s: x if s.is_fully_replicated and not replicated_too else (
        jax.lax.with_sharding_constraint(x, s))
    return jax.tree.map(constrain, tree, layout.state.params)

  def step(state: TrainState, batch):
    micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
    # Each micro-batch split over the batch axes like the whole batch (a no-op without a layout's rules).
    micro = jax.tree.map(lambda x: nn.with_logical_constraint(x, (None, "batch", "length", None)[:x.ndim]), micro)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def accumulate(grads_sum, xs):
      mb, index = xs
      terms, trunk, trunk_vjp = latent_lib.DecoderTerms(None, None, None, {}), None, None
      if latent is not None:
        if latent.decoder_objective == "final":
          trunk, trunk_vjp = jax.vjp(lambda p: latent_lib.trunk_of(model, view(p), mb["inputs"]), state.params)
        terms = latent_lib.decoder_terms(model, inner_params, mb, jax.random.fold_in(step_key, index),
                                         None if trunk is None else jax.lax.stop_gradient(trunk))
      grads, extra = terms.iterates_grad, dict(terms.metrics)
      # The inner loop's gradients (the iterates', the encoder's) come unscaled: scale them like the loss gradient.
      rescale = lambda tree: jax.tree.map(lambda g: loss_scale_lib.scale_loss(state.loss_scale, g), tree) if (
          scaled) else tree
      if grads is None and trunk is not None:
        (_, (value, loss_metrics)), (grads, trunk_grad) = jax.value_and_grad(loss, argnums=(0, 4), has_aux=True)(
            state.params, mb, terms.scored, state.loss_scale, trunk)
        grads = jax.tree.map(jnp.add, grads, trunk_vjp(trunk_grad)[0])
        extra.update(loss_metrics, loss=value)
      elif grads is None:
        (_, (value, loss_metrics)), grads = jax.value_and_grad(loss, has_aux=True)(
            state.params, mb, terms.scored, state.loss_scale)
        extra.update(loss_metrics, loss=value)
      else:
        grads = rescale(grads)
      if terms.encoder_grad is not None:
        encoder = model_lib.ENCODER
        grads = dict(grads, **{encoder: jax.tree.map(jnp.add, grads[encoder], rescale(terms.encoder_grad))})
      # Each micro-batch's gradient and the running sum stay in the split parameters' shards: no micro-batch gathers
      # or all-reduces a whole gradient into a replicated accumulator.
      return like_params(jax.tree.map(jnp.add, grads_sum, like_params(grads))), extra

    # The inner loop fits z to the weights the step computes with; they are the same for every micro-batch.
    inner_params = view(state.params) if latent is not None else None
    zeros = like_params(jax.tree.map(jnp.zeros_like, state.params))
    grads, micro_metrics = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(grad_accum)))
    grads = like_params(jax.tree.map(lambda g: g / grad_accum, grads), replicated_too=True)
    if scaled:
      grads = loss_scale_lib.unscale(state.loss_scale, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {k: v.mean() for k, v in micro_metrics.items()}
    grad_norm, loss_scale = global_norm(grads), state.loss_scale  # The clip's own norm: XLA computes it once.
    if scaled:
      finite = loss_scale_lib.all_finite(grads)
      skipped_state = loss_scale_lib.select(finite, opt_state, state.opt_state)
      params = loss_scale_lib.select(finite, params, state.params)
      # The learning-rate schedule still counts a skipped step: it follows state.step, as the logged lr does, and
      # reaches its end at train.steps. The moments and Adam's bias correction do not.
      is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
      opt_state = jax.tree.map(lambda kept, stepped: stepped if is_schedule(kept) else kept, skipped_state,
                               opt_state, is_leaf=is_schedule)
      loss_scale = loss_scale_lib.update(state.loss_scale, finite)
      # A skipped step is routine under loss scaling, not a divergence: log it instead of an infinite norm.
      metrics.update(loss_scale=state.loss_scale.scale, skipped=(~finite).astype(jnp.float32))
      grad_norm = jnp.where(finite, grad_norm, 0.0)
    metrics.update(grad_norm=grad_norm, lr=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, loss_scale=loss_scale), metrics

  if layout is None:
    return jax.jit(step, donate_argnums=0)
  return layout.jit(step, in_shardings=(layout.state, layout.batch),
                    out_shardings=(layout.state, layout.replicated), donate_argnums=0)
