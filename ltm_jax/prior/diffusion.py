"""The continuous-time VP diffusion of the latent prior: its schedule and its epsilon-prediction training loss.

x_t = alpha_t x_0 + sigma_t eps with alpha_t^2 + sigma_t^2 = 1 (variance preserving) and the linear schedule of
Song et al. (2021), log alpha_t = -beta_min t / 2 - (beta_max - beta_min) t^2 / 4, for t in [t_min, 1]. Samplers work
in the half log-SNR lambda_t = log(alpha_t / sigma_t), which decreases in t and has a closed-form inverse.

The network predicts eps (epsilon-prediction); its data prediction is x_0 = (x_t - sigma_t eps) / alpha_t.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# eps_fn(x_t [B, ...], t [B]) -> the predicted noise, shaped like x_t.
Denoiser = Callable[[jax.Array, jax.Array], jax.Array]


class VPSchedule(NamedTuple):
  beta_min: float = 0.1
  beta_max: float = 20.0
  t_min: float = 1e-3

  def log_alpha(self, t):
    return -0.5 * self.beta_min * t - 0.25 * (self.beta_max - self.beta_min) * t * t

  def alpha(self, t):
    return jnp.exp(self.log_alpha(t))

  def sigma(self, t):
    # sqrt(1 - alpha^2) through expm1: exact for the small t where alpha^2 is within rounding of 1.
    return jnp.sqrt(-jnp.expm1(2.0 * self.log_alpha(t)))

  def log_snr(self, t):
    """lambda_t = log(alpha_t / sigma_t)."""
    log_alpha = self.log_alpha(t)
    return log_alpha - 0.5 * jnp.log(-jnp.expm1(2.0 * log_alpha))

  def time_of(self, log_snr):
    """The t with lambda_t = log_snr: -log alpha_t = log(1 + exp(-2 lambda)) / 2 solved as a quadratic in t."""
    neg_log_alpha = 0.5 * jnp.logaddexp(0.0, -2.0 * log_snr)
    b0, slope = self.beta_min, self.beta_max - self.beta_min
    # t = 2c / (b0/2 + sqrt(b0^2/4 + slope c)) for c = -log alpha: the root without cancellation.
    return 2.0 * neg_log_alpha / (0.5 * b0 + jnp.sqrt(0.25 * b0 * b0 + slope * neg_log_alpha))


def schedule_of(prior_cfg) -> VPSchedule:
  return VPSchedule(prior_cfg.beta_min, prior_cfg.beta_max, prior_cfg.t_min)


def noised(schedule: VPSchedule, x0: jax.Array, t: jax.Array, eps: jax.Array) -> jax.Array:
  """x_t = alpha_t x_0 + sigma_t eps for x0, eps [B, ...] and t [B]."""
  expand = lambda a: a.reshape(a.shape + (1,) * (x0.ndim - 1))
  return expand(schedule.alpha(t)) * x0 + expand(schedule.sigma(t)) * eps


def denoising_loss(eps_fn: Denoiser, x0: jax.Array, key: jax.Array, schedule: VPSchedule) -> jax.Array:
  """Per-example loss [B]: mean over coordinates of (eps_fn(x_t, t) - eps)^2, t ~ U(t_min, 1), eps ~ N(0, I).

  Its expectation is the time-averaged mean squared error of the noise prediction, minimised by the exact
  denoiser E[eps | x_t]; weighted by sigma_t^2 / alpha_t^2 it would be the data-prediction error instead."""
  t_key, eps_key = jax.random.split(key)
  t = jax.random.uniform(t_key, x0.shape[:1], x0.dtype, schedule.t_min, 1.0)
  eps = jax.random.normal(eps_key, x0.shape, x0.dtype)
  error = eps_fn(noised(schedule, x0, t, eps), t) - eps
  return jnp.mean(jnp.square(error).reshape(x0.shape[0], -1), axis=-1)


def nll_bound(eps_fn: Denoiser, x0: jax.Array, key: jax.Array, schedule: VPSchedule, samples: int = 16) -> jax.Array:
  """An upper bound [B] on -log p(x0) in nats under the diffusion model, estimated without bias (the continuous-time
  variational bound of Kingma et al., 2021), for x0 [B, ...]:

    KL(q(x_1 | x0) || N(0, I))                                            the prior term, analytic
    + E_q[-log N(x0; x_tmin / alpha_tmin, (sigma_tmin / alpha_tmin)^2 I)]  the model's last step, analytic
    + (1/2) int_{t_min}^1 (-d logSNR/dt) E||eps - eps_theta(x_t, t)||^2 dt   the diffusion term

  The integral is taken over log-SNR (dt * -d logSNR/dt = d logSNR), where its integrand is bounded, by `samples`
  stratified draws per example: (logSNR range / 2) times the mean squared noise-prediction error."""
  batch, dims = x0.shape[0], x0[0].size
  log_snr_1, log_snr_0 = 2.0 * schedule.log_snr(jnp.asarray(1.0, x0.dtype)), 2.0 * schedule.log_snr(
      jnp.asarray(schedule.t_min, x0.dtype))
  u_key, eps_key = jax.random.split(key)
  u = (jnp.arange(samples, dtype=x0.dtype) + jax.random.uniform(u_key, (batch, samples), x0.dtype)) / samples
  t = schedule.time_of(0.5 * (log_snr_1 + u * (log_snr_0 - log_snr_1))).reshape(-1)
  x0_rep = jnp.repeat(x0, samples, axis=0)
  eps = jax.random.normal(eps_key, x0_rep.shape, x0.dtype)
  error = jnp.square(eps_fn(noised(schedule, x0_rep, t, eps), t) - eps).reshape(batch, samples, -1).sum(-1)
  diffusion = 0.5 * (log_snr_0 - log_snr_1) * error.mean(-1)
  flat = x0.reshape(batch, -1)
  alpha_1, var_1 = schedule.alpha(1.0), -jnp.expm1(2.0 * schedule.log_alpha(1.0))
  prior = 0.5 * (jnp.square(alpha_1 * flat).sum(-1) + dims * (var_1 - 1.0 - jnp.log(var_1)))
  last_step = 0.5 * dims * (jnp.log(2.0 * jnp.pi) - log_snr_0 + 1.0)  # log(sigma^2 / alpha^2) = -logSNR
  return prior + last_step + diffusion
