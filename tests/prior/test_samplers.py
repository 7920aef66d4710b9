"""Numerics of the latent prior's samplers (ltm_jax.prior.samplers): DPM-Solver++(2M) against an independent float64
transcription of the published algorithm, and both samplers against the exact marginals of Gaussian data, for which
the exact denoiser is known in closed form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from ltm_jax.prior import samplers
from ltm_jax.prior.diffusion import VPSchedule

SCHEDULES = [VPSchedule(), VPSchedule(beta_min=0.5, beta_max=12.0, t_min=1e-2)]

# ---- An independent float64 numpy transcription of the schedule and of DPM-Solver++(2M).


def np_log_alpha(schedule, t):
  """log alpha_t = -beta_min t / 2 - (beta_max - beta_min) t^2 / 4."""
  return -0.5 * schedule.beta_min * t - 0.25 * (schedule.beta_max - schedule.beta_min) * t**2


def np_alpha(schedule, t):
  return np.exp(np_log_alpha(schedule, t))


def np_sigma(schedule, t):
  """sqrt(1 - alpha_t^2), with 1 - alpha^2 through expm1 so it keeps ~1e-16 relative accuracy near t_min."""
  return np.sqrt(-np.expm1(2.0 * np_log_alpha(schedule, t)))


def np_lambda(schedule, t):
  """Half log-SNR lambda_t = log(alpha_t / sigma_t)."""
  return np.log(np_alpha(schedule, t)) - np.log(np_sigma(schedule, t))


def np_time_grid(schedule, steps):
  """Times from 1 to t_min uniform in lambda, the interior ones by root bracketing on the numpy lambda_t."""
  lam = np.linspace(np_lambda(schedule, 1.0), np_lambda(schedule, schedule.t_min), steps + 1)
  inner = [optimize.brentq(lambda s, l=l: np_lambda(schedule, s) - l, schedule.t_min, 1.0, xtol=1e-18, rtol=1e-15)
           for l in lam[1:-1]]
  return np.array([1.0, *inner, schedule.t_min])


def np_dpm_step(schedule, x, x0_cur, x0_prev, t_prev_prev, t_prev, t, second_order):
  """One step of Lu et al. (2022), DPM-Solver++(2M) (Algorithm 2), data prediction, from t_{i-1} = t_prev to t_i = t:
  h_i = lambda_{t_i} - lambda_{t_{i-1}}, r_i = h_{i-1} / h_i,
  D_i = (1 + 1/(2 r_i)) x0_theta(x_{t_{i-1}}, t_{i-1}) - 1/(2 r_i) x0_theta(x_{t_{i-2}}, t_{i-2}),
  x_{t_i} = sigma_{t_i} / sigma_{t_{i-1}} x_{t_{i-1}} - alpha_{t_i} (e^{-h_i} - 1) D_i,
  with D_i = x0_theta(x_{t_{i-1}}, t_{i-1}) for a first-order step (t_prev_prev is then unused)."""
  h = np_lambda(schedule, t) - np_lambda(schedule, t_prev)
  if second_order:
    h_prev = np_lambda(schedule, t_prev) - np_lambda(schedule, t_prev_prev)
    r = h_prev / h
    d = (1.0 + 1.0 / (2.0 * r)) * x0_cur - (1.0 / (2.0 * r)) * x0_prev
  else:
    d = x0_cur
  return np_sigma(schedule, t) / np_sigma(schedule, t_prev) * x - np_alpha(schedule, t) * np.expm1(-h) * d


def np_dpm_solver_pp(np_eps_fn, x_T, schedule, steps):
  """Algorithm 2 of Lu et al. (2022) on the lambda-uniform grid. The paper's first step is first order; as in the
  code under test (its docstring: "the first and the last step are first order"), the LAST step is first order too
  (the published algorithm would make it second order; this is the lower-order-final variant)."""
  times = np_time_grid(schedule, steps)
  x, x0_prev = x_T, None
  for i in range(steps):
    t_prev = times[i]
    x0_cur = (x - np_sigma(schedule, t_prev) * np_eps_fn(x, np.full(len(x), t_prev))) / np_alpha(schedule, t_prev)
    second_order = 0 < i < steps - 1
    x = np_dpm_step(schedule, x, x0_cur, x0_prev, times[i - 1] if i > 0 else None, t_prev, times[i + 1],
                    second_order)
    x0_prev = x0_cur
  return x


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dpm_solver_pp_update_matches_published_step(schedule):
  """dpm_solver_pp_update agrees with the transcription of Algorithm 2's step to 1e-12 (relative, in norm) in float64
  for random states, data predictions, times t < t_prev in (t_min, 1) and previous step sizes, first and second
  order."""
  rng = np.random.default_rng(20)
  with jax.enable_x64(True):
    update = jax.jit(
        lambda x, x0, x0p, tp, t, hp, so: samplers.dpm_solver_pp_update(x, x0, x0p, schedule, tp, t, hp, so))
    for trial in range(12):
      x, x0, x0_prev = rng.normal(size=(3, 5, 4))
      t_prev_prev, t_prev, t = np.sort(rng.uniform(schedule.t_min, 1.0, 3))[::-1]
      h_prev = np_lambda(schedule, t_prev) - np_lambda(schedule, t_prev_prev)
      for second_order in (False, True):
        out = np.asarray(update(*(jnp.asarray(v, jnp.float64) for v in (x, x0, x0_prev, t_prev, t, h_prev)),
                                jnp.asarray(second_order)))
        assert out.dtype == np.float64
        ref = np_dpm_step(schedule, x, x0, x0_prev, t_prev_prev, t_prev, t, second_order)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert err < 1e-12, (trial, second_order, err)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_time_grid_is_uniform_in_log_snr(schedule):
  """time_grid(..., "log_snr") equals the lambda-uniform grid found by root bracketing (rtol 1e-12, float64), with
  the ends exactly 1 and t_min; "time" is uniform in t."""
  with jax.enable_x64(True):
    grid = np.asarray(samplers.time_grid(schedule, 7, "log_snr", jnp.float64))
    uniform = np.asarray(samplers.time_grid(schedule, 7, "time", jnp.float64))
  np.testing.assert_allclose(grid, np_time_grid(schedule, 7), rtol=1e-12)
  assert grid[0] == 1.0 and grid[-1] == schedule.t_min
  np.testing.assert_allclose(uniform, np.linspace(1.0, schedule.t_min, 8), rtol=1e-15)


@pytest.mark.parametrize("steps", [1, 2, 3, 6])
def test_dpm_solver_pp_run_matches_transcription(steps):
  """A whole dpm_solver_pp run (float64) with a smooth nonlinear eps_fn, tanh(x W + t c), agrees with the numpy loop
  of Algorithm 2 (first and last step first order) to 1e-11 relative, in norm."""
  schedule = VPSchedule()
  rng = np.random.default_rng(30 + steps)
  d = 4
  w = rng.normal(size=(d, d)) / np.sqrt(d)
  c = rng.normal(size=d)
  x_T = rng.normal(size=(6, d))
  np_eps_fn = lambda x, t: np.tanh(x @ w + t[:, None] * c)
  with jax.enable_x64(True):
    wj, cj = jnp.asarray(w), jnp.asarray(c)
    eps_fn = lambda x, t: jnp.tanh(x @ wj + t[:, None] * cj)
    out = np.asarray(jax.jit(lambda x: samplers.dpm_solver_pp(eps_fn, x, schedule, steps))(jnp.asarray(x_T)))
  assert out.dtype == np.float64
  ref = np_dpm_solver_pp(np_eps_fn, x_T, schedule, steps)
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert err < 1e-11, err


# ---- Gaussian data x0 ~ N(m, C): x_t ~ N(alpha_t m, alpha_t^2 C + sigma_t^2 I), and E[eps | x_t] is affine in x_t.


def random_gaussian(rng, d):
  m = rng.normal(size=d)
  a = rng.normal(size=(d, d))
  return m, a @ a.T / d + 0.1 * np.eye(d)


def _matmul(x, mat):
  """x [B, d] @ mat [d, d] as d broadcast products: XLA's CPU dot for d = 3 is several times slower at B = 1e5."""
  return sum(x[:, i:i + 1] * mat[i] for i in range(mat.shape[0]))


def exact_denoiser(schedule, m, cov, dtype):
  """E[eps | x_t] = sigma_t (alpha_t^2 C + sigma_t^2 I)^{-1} (x_t - alpha_t m), through C = U diag(w) U^T."""
  w, u = np.linalg.eigh(cov)
  m, w, u = (jnp.asarray(v, dtype) for v in (m, w, u))

  def eps_fn(x, t):
    alpha, sigma = schedule.alpha(t)[:, None], schedule.sigma(t)[:, None]
    y = _matmul(x - alpha * m, u)
    return sigma * _matmul(y / (alpha**2 * w + sigma**2), u.T)

  return eps_fn


def marginal(schedule, m, cov, t):
  """Mean and covariance of x_t."""
  alpha, sigma = np_alpha(schedule, t), np_sigma(schedule, t)
  return alpha * m, alpha**2 * cov + sigma**2 * np.eye(len(m))


def test_dpm_solver_pp_is_second_order_on_gaussian_data():
  """With the exact denoiser, dpm_solver_pp is an affine map of x_T; pushing the exact x_1 ~ N(mu_1, S_1) (as mu_1 and
  mu_1 + L e_k, S_1 = L L^T) gives the law of its output. Its mean is exact (the data prediction is constant along
  x_t = alpha_t m: |error| < 1e-12); its covariance error relative to the exact S_t_min (max-abs / max-abs) falls at
  second order: from 20 to 160 steps each doubling divides it by 3..5 and the log-log slope is in [-2.3, -1.7]
  (10 -> 20 steps is still pre-asymptotic, ratio ~2.5), and it is below 1e-2 at 80 steps. float64."""
  schedule = VPSchedule()
  rng = np.random.default_rng(40)
  d = 4
  m, cov = random_gaussian(rng, d)
  mu_1, s_1 = marginal(schedule, m, cov, 1.0)
  mu_0, s_0 = marginal(schedule, m, cov, schedule.t_min)
  x_T = mu_1 + np.vstack([np.zeros(d), np.linalg.cholesky(s_1).T])  # Rows: mu_1, then mu_1 + L e_k.
  step_counts = [10, 20, 40, 80, 160]
  errors = []
  with jax.enable_x64(True):
    eps_fn = exact_denoiser(schedule, m, cov, jnp.float64)
    for steps in step_counts:
      out = np.asarray(jax.jit(lambda x, steps=steps: samplers.dpm_solver_pp(eps_fn, x, schedule, steps))(
          jnp.asarray(x_T)))
      mean, diffs = out[0], out[1:] - out[0]
      np.testing.assert_allclose(mean, mu_0, rtol=0, atol=1e-12)
      errors.append(np.abs(diffs.T @ diffs - s_0).max() / np.abs(s_0).max())
  errors = np.array(errors)
  assert errors[0] < 0.2
  ratios = errors[1:-1] / errors[2:]  # Per doubling, 20 -> 40 -> 80 -> 160.
  assert np.all((ratios > 3.0) & (ratios < 5.0)), errors
  slope = np.polyfit(np.log(step_counts[1:]), np.log(errors[1:]), 1)[0]
  assert -2.3 < slope < -1.7, (slope, errors)
  assert errors[step_counts.index(80)] < 1e-2, errors


def np_ddpm_law(schedule, m, cov, steps):
  """The exact law of the output of ancestral sampling with the exact denoiser, propagated in float64: on the grid
  uniform in t, from s to t < s, x0(x) = (x - sigma_s E[eps|x_s]) / alpha_s = P x + q and x_t ~ q(x_t | x_s, x0) =
  N(alpha_{s|t} sigma_t^2 / sigma_s^2 x_s + alpha_t sigma_{s|t}^2 / sigma_s^2 x0, sigma_{s|t}^2 sigma_t^2 / sigma_s^2)
  with alpha_{s|t} = alpha_s / alpha_t and sigma_{s|t}^2 = sigma_s^2 - alpha_{s|t}^2 sigma_t^2 (Ho et al., 2020;
  Kingma et al., 2021), so the mean and covariance go through an affine map and an added noise at each step."""
  eye = np.eye(len(m))
  mean, covariance = marginal(schedule, m, cov, 1.0)
  times = np.linspace(1.0, schedule.t_min, steps + 1)
  for s, t in zip(times[:-1], times[1:]):
    alpha_s, sigma_s, alpha_t, sigma_t = np_alpha(schedule, s), np_sigma(schedule, s), np_alpha(schedule, t), np_sigma(
        schedule, t)
    s_inv = np.linalg.inv(alpha_s**2 * cov + sigma_s**2 * eye)
    p = (eye - sigma_s**2 * s_inv) / alpha_s
    q = sigma_s**2 * s_inv @ m
    alpha_st = alpha_s / alpha_t
    var_st = sigma_s**2 - alpha_st**2 * sigma_t**2
    a = alpha_st * sigma_t**2 / sigma_s**2 * eye + alpha_t * var_st / sigma_s**2 * p
    mean = a @ mean + alpha_t * var_st / sigma_s**2 * q
    covariance = a @ covariance @ a.T + var_st * sigma_t**2 / sigma_s**2 * eye
  return mean, covariance


@pytest.mark.optimized_compile  # Runs a long sampling loop: 10x slower unoptimised.
def test_ddpm_matches_gaussian_marginal():
  """ddpm (float32, 1000 steps, 100k samples, d = 3) with the exact denoiser, from the exact x_1:
  - its sample mean and covariance match the exact law of the discretised chain (np_ddpm_law) within 5 Monte-Carlo
    standard errors per entry (Gaussian: se(S_ij) = sqrt((S_ii S_jj + S_ij^2) / N), se(mu_i) = sqrt(S_ii / N));
  - that law's covariance tends to the exact marginal at t_min at first order (500 -> 1000 steps halves the error,
    ratio in [1.7, 2.3]; its mean is exact), its error at 1000 steps below 0.015;
  - so the samples match the exact marginal (alpha m, alpha^2 C + sigma^2 I) within that bias + 5 standard errors."""
  schedule = VPSchedule()
  rng = np.random.default_rng(50)
  d, n, steps = 3, 100_000, 1000
  m, cov = random_gaussian(rng, d)
  mu_1, s_1 = marginal(schedule, m, cov, 1.0)
  mu_0, s_0 = marginal(schedule, m, cov, schedule.t_min)
  x_T = jnp.asarray(mu_1 + rng.normal(size=(n, d)) @ np.linalg.cholesky(s_1).T, jnp.float32)
  eps_fn = exact_denoiser(schedule, m, cov, jnp.float32)
  out = jax.jit(lambda x, k: samplers.ddpm(eps_fn, x, schedule, steps, k))(x_T, jax.random.key(50))
  assert out.dtype == jnp.float32 and out.shape == (n, d)
  out = np.asarray(out, np.float64)
  mean, covariance = out.mean(0), np.cov(out.T)

  law_mean, law_cov = np_ddpm_law(schedule, m, cov, steps)
  se_mean = np.sqrt(np.diag(law_cov) / n)
  se_cov = np.sqrt((np.outer(np.diag(law_cov), np.diag(law_cov)) + law_cov**2) / n)
  assert np.all(np.abs(mean - law_mean) < 5 * se_mean), (mean - law_mean) / se_mean
  assert np.all(np.abs(covariance - law_cov) < 5 * se_cov), (covariance - law_cov) / se_cov

  # A check of the float64 reference itself, on which the tolerance below rests: its chain converges at first
  # order, as ancestral sampling does, so `bias` is the discretisation error and not a transcription error.
  bias = np.abs(law_cov - s_0).max()
  half_bias = np.abs(np_ddpm_law(schedule, m, cov, steps // 2)[1] - s_0).max()
  assert 1.7 < half_bias / bias < 2.3, (half_bias, bias)
  assert bias < 0.015, bias
  np.testing.assert_allclose(law_mean, mu_0, rtol=0, atol=1e-10)

  assert np.all(np.abs(mean - mu_0) < 5 * se_mean), (mean - mu_0) / se_mean
  assert np.all(np.abs(covariance - s_0) < bias + 5 * se_cov), covariance - s_0


def np_ddpm(np_eps_fn, x_T, schedule, noises):
  """Ancestral sampling (Ho et al., 2020, in continuous time) in float64, one step per entry of `noises`, on a grid
  uniform in t from 1 to t_min: from x_s, x_0 = (x_s - sigma_s eps) / alpha_s, then x_t ~ q(x_t | x_s, x_0), the
  Gaussian with mean alpha_{s|t} sigma_t^2 / sigma_s^2 x_s + alpha_t sigma_{s|t}^2 / sigma_s^2 x_0 and variance
  sigma_{s|t}^2 sigma_t^2 / sigma_s^2, where alpha_{s|t} = alpha_s / alpha_t and
  sigma_{s|t}^2 = sigma_s^2 - alpha_{s|t}^2 sigma_t^2; x_t = mean + std * noise."""
  times = np.linspace(1.0, schedule.t_min, len(noises) + 1)
  x = x_T
  for s, t, noise in zip(times[:-1], times[1:], noises):
    a_s, a_t, sig_s, sig_t = (np_alpha(schedule, s), np_alpha(schedule, t), np_sigma(schedule, s),
                              np_sigma(schedule, t))
    x0 = (x - sig_s * np_eps_fn(x, np.full(len(x), s))) / a_s
    a_st = a_s / a_t
    var_st = sig_s**2 - a_st**2 * sig_t**2
    mean = a_st * sig_t**2 / sig_s**2 * x + a_t * var_st / sig_s**2 * x0
    x = mean + np.sqrt(var_st * sig_t**2 / sig_s**2) * noise
  return x


@pytest.mark.parametrize("name", ["dpm++", "ddpm"])
def test_sample_by_name_matches_the_float64_transcription_of_that_sampler(name):
  """sample(name, ...) (3 steps, float32) against the float64 NumPy transcription of the named sampler, and not the
  other one's: DPM-Solver++(2M) above, ancestral DDPM in np_ddpm (fed the same standard-normal draws, which are the
  sampler's input: jax.random.normal of each of jax.random.split(key, steps))."""
  schedule = VPSchedule()
  steps = 3
  rng = np.random.default_rng(60)
  w = rng.normal(size=(3, 3)) / 2
  eps_fn = lambda x, t: jnp.tanh(x @ jnp.asarray(w, jnp.float32)) * t[:, None]
  np_eps_fn = lambda x, t: np.tanh(x @ w) * t[:, None]
  x_T = rng.normal(size=(4, 3))
  key = jax.random.key(60)
  noises = [np.asarray(jax.random.normal(k, x_T.shape, jnp.float32), np.float64)
            for k in jax.random.split(key, steps)]
  references = {"dpm++": np_dpm_solver_pp(np_eps_fn, x_T, schedule, steps),
                "ddpm": np_ddpm(np_eps_fn, x_T, schedule, noises)}
  got = np.asarray(samplers.sample(name, eps_fn, jnp.asarray(x_T, jnp.float32), schedule, steps, key), np.float64)
  scale = np.abs(references[name]).max()
  np.testing.assert_allclose(got, references[name], rtol=0, atol=1e-5 * scale)
  other = references["ddpm" if name == "dpm++" else "dpm++"]
  assert np.abs(got - other).max() > 1e-2 * scale  # The two references differ: a swapped name would fail.


@pytest.mark.parametrize("name,steps", [("dpm++", 0), ("ddpm", 0), ("dpm++", -2), ("ddpm", 2.0), ("dpm++", True),
                                        ("euler", 10), ("DDPM", 10)])
def test_sample_refuses_bad_arguments(name, steps):
  """sample raises ValueError for steps <= 0 or not an int, and for an unknown sampler name."""
  x_T = jnp.asarray(np.random.default_rng(70).normal(size=(2, 3)), jnp.float32)
  with pytest.raises(ValueError):
    samplers.sample(name, lambda x, t: x, x_T, VPSchedule(), steps, jax.random.key(0))


def test_dpm_solver_pp_is_differentiable():
  """Gradients through the solver are finite (its first step has h_prev = 0, where 1 / r must not reach the
  backward pass), and equal central differences of the (float64) solver to 1e-6 relative."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(80)
    w = jnp.asarray(rng.normal(size=(3, 3)) / 2)
    eps_fn = lambda x, t: jnp.tanh(x @ w) * t[:, None]
    x_T = jnp.asarray(rng.normal(size=(2, 3)))
    loss = lambda x: jnp.sum(jnp.sin(samplers.dpm_solver_pp(eps_fn, x, VPSchedule(), 5)))
    grad = np.asarray(jax.grad(loss)(x_T))
    direction = rng.normal(size=x_T.shape)
    step = 1e-6
    numeric = (loss(x_T + step * direction) - loss(x_T - step * direction)) / (2 * step)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(np.sum(grad * direction), numeric, rtol=1e-6)
