"""Samplers of the latent prior, one signature: sampler(eps_fn, x_T, schedule, steps, key) -> x_{t_min}.

x_T [B, ...] is standard-normal noise at t = 1; each sampler makes `steps` evaluations of the denoiser and returns
the sample at t_min (where sigma_t_min ~ 0.01 for the default schedule, below anything the decoder resolves).

- `ddpm`: ancestral sampling on a grid uniform in t: from x_s, the data prediction x_0 = (x_s - sigma_s eps)/alpha_s,
  then a draw from the forward process's posterior q(x_t | x_s, x_0) (Ho et al., 2020, in continuous time).
- `dpm_solver_pp`: DPM-Solver++(2M) (Lu et al., 2022, Algorithm 2), deterministic, on a grid uniform in log-SNR
  lambda: x_i = (sigma_i / sigma_{i-1}) x_{i-1} - alpha_i expm1(-h_i) D_i with h_i = lambda_i - lambda_{i-1} and
  D_i = (1 + 1/(2 r_i)) x0_{i-1} - x0_{i-2} / (2 r_i), r_i = h_{i-1} / h_i; the first and the last step are first
  order (D_i = x0_{i-1}), which keeps the method second order and stable at few steps.
Both are jittable and batched; `sample` picks one by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.prior.diffusion import Denoiser, VPSchedule


def _data_prediction(eps_fn: Denoiser, schedule: VPSchedule, x: jax.Array, t: jax.Array) -> jax.Array:
  t_batch = jnp.full(x.shape[:1], t, x.dtype)
  return (x - schedule.sigma(t) * eps_fn(x, t_batch)) / schedule.alpha(t)


def time_grid(schedule: VPSchedule, steps: int, kind: str, dtype=jnp.float32) -> jax.Array:
  """steps + 1 times from 1 down to t_min, uniform in t ("time") or in log-SNR ("log_snr")."""
  if kind == "time":
    return jnp.linspace(1.0, schedule.t_min, steps + 1, dtype=dtype)
  start, end = schedule.log_snr(jnp.asarray(1.0, dtype)), schedule.log_snr(jnp.asarray(schedule.t_min, dtype))
  grid = schedule.time_of(jnp.linspace(start, end, steps + 1, dtype=dtype))
  return grid.at[0].set(1.0).at[-1].set(schedule.t_min)  # The ends exactly, not through a round trip.


def dpm_solver_pp_update(x: jax.Array, x0: jax.Array, x0_prev: jax.Array, schedule: VPSchedule, t_prev, t,
                         h_prev, second_order) -> jax.Array:
  """One DPM-Solver++(2M) step from x at t_prev to t, given the data predictions at t_prev (x0) and at the point
  before it (x0_prev, reached by a log-SNR step h_prev); first order where `second_order` is False."""
  log_snr_prev, log_snr = schedule.log_snr(t_prev), schedule.log_snr(t)
  h = log_snr - log_snr_prev
  # 1 / (2 r) = h / (2 h_prev), set to 0 on first-order steps (where h_prev may be 0): finite, and differentiable.
  half_inverse_r = jnp.where(second_order, 0.5 * h / jnp.where(second_order, h_prev, 1.0), 0.0)
  d = (1.0 + half_inverse_r) * x0 - half_inverse_r * x0_prev
  log_sigma_ratio = 0.5 * (jnp.log(-jnp.expm1(2.0 * schedule.log_alpha(t)))
                           - jnp.log(-jnp.expm1(2.0 * schedule.log_alpha(t_prev))))
  return jnp.exp(log_sigma_ratio) * x - schedule.alpha(t) * jnp.expm1(-h) * d


def dpm_solver_pp(eps_fn: Denoiser, x_T: jax.Array, schedule: VPSchedule, steps: int,
                  key: jax.Array | None = None) -> jax.Array:
  """DPM-Solver++(2M) from x_T at t = 1 to t_min in `steps` denoiser evaluations (`key` is unused: deterministic)."""
  del key
  times = time_grid(schedule, steps, "log_snr", x_T.dtype)
  log_snrs = schedule.log_snr(times)

  def step(carry, i):
    x, x0_prev = carry
    x0 = _data_prediction(eps_fn, schedule, x, times[i])
    h_prev = log_snrs[i] - log_snrs[jnp.maximum(i - 1, 0)]
    second_order = (i > 0) & (i < steps - 1)
    x = dpm_solver_pp_update(x, x0, x0_prev, schedule, times[i], times[i + 1], h_prev, second_order)
    return (x, x0), None

  (x, _), _ = jax.lax.scan(step, (x_T, jnp.zeros_like(x_T)), jnp.arange(steps))
  return x


def ddpm(eps_fn: Denoiser, x_T: jax.Array, schedule: VPSchedule, steps: int, key: jax.Array) -> jax.Array:
  """Ancestral sampling from x_T at t = 1 to t_min in `steps` denoiser evaluations, each followed by fresh noise."""
  times = time_grid(schedule, steps, "time", x_T.dtype)

  def step(x, inputs):
    s, t, step_key = inputs
    x0 = _data_prediction(eps_fn, schedule, x, s)
    log_alpha_s, log_alpha_t = schedule.log_alpha(s), schedule.log_alpha(t)
    var_s = -jnp.expm1(2.0 * log_alpha_s)  # sigma_s^2
    var_t = -jnp.expm1(2.0 * log_alpha_t)
    var_s_given_t = -jnp.expm1(2.0 * (log_alpha_s - log_alpha_t))  # sigma_{s|t}^2 = sigma_s^2 - alpha_{s|t}^2 sigma_t^2
    mean = (jnp.exp(log_alpha_s - log_alpha_t) * var_t / var_s) * x + (jnp.exp(log_alpha_t) * var_s_given_t / var_s) * x0
    std = jnp.sqrt(var_s_given_t * var_t / var_s)
    return mean + std * jax.random.normal(step_key, x.shape, x.dtype), None

  keys = jax.random.split(key, steps)
  x, _ = jax.lax.scan(step, x_T, (times[:-1], times[1:], keys))
  return x


SAMPLERS = {"dpm++": dpm_solver_pp, "ddpm": ddpm}


def sample(name: str, eps_fn: Denoiser, x_T: jax.Array, schedule: VPSchedule, steps: int,
           key: jax.Array) -> jax.Array:
  """The sampler `name` ("dpm++" or "ddpm") run for `steps` >= 1 denoiser evaluations from x_T."""
  check(name, steps)
  return SAMPLERS[name](eps_fn, x_T, schedule, int(steps), key)


def check(name: str, steps) -> None:
  """ValueError unless `name` is a sampler and `steps` a positive integer."""
  if name not in SAMPLERS:
    raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
    raise ValueError(f"sampler steps must be a positive integer, got {steps!r}")
