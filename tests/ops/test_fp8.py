"""FP8 products (`ltm_jax.ops.fp8`) against a float64 reference built from the formats' definitions: the rounding of
each operand and of the output gradient, the forward product and both backward products; and model.fp8 in a model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import micro_config
from ltm_jax import model as model_lib
from ltm_jax.ops import fp8


def _grid(exponent_bits: int, mantissa_bits: int, finite_top: bool) -> np.ndarray:
  """Every non-negative finite value of a float8 format, sorted, from its definition: bias 2^(e-1) - 1, subnormals
  at exponent 0. `finite_top`: the top exponent holds finite values except its all-ones mantissa (e4m3fn: no
  infinities); otherwise the top exponent is infinity/NaN (e5m2, IEEE-like)."""
  bias = 2 ** (exponent_bits - 1) - 1
  values = []
  for e in range(2 ** exponent_bits):
    for m in range(2 ** mantissa_bits):
      top = e == 2 ** exponent_bits - 1
      if top and (not finite_top or m == 2 ** mantissa_bits - 1):
        continue
      fraction = m / 2 ** mantissa_bits
      values.append(fraction * 2.0 ** (1 - bias) if e == 0 else (1 + fraction) * 2.0 ** (e - bias))
  return np.array(sorted(values))


E4M3_GRID = _grid(4, 3, finite_top=True)  # Largest 448.
E5M2_GRID = _grid(5, 2, finite_top=False)  # Largest 57344.
GRIDS = {"e4m3": (fp8.E4M3, E4M3_GRID), "e5m2": (fp8.E5M2, E5M2_GRID)}


def _reference_round(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
  """float32 x rounded as the op states it: scale = max|x| / grid max (float32), x / scale in float32, the nearest
  grid value in float64 (a tie to the neighbour with the even code), times the scale, in float32."""
  x = np.asarray(x, np.float32)
  scale = np.float32(np.max(np.abs(x))) / np.float32(grid[-1])
  scaled = np.abs((x / scale).astype(np.float64))
  upper = np.clip(np.searchsorted(grid, scaled), 1, len(grid) - 1)
  below, above = grid[upper - 1], grid[upper]
  tie_up = (above - scaled < scaled - below) | ((above - scaled == scaled - below) & (upper % 2 == 0))
  nearest = np.where(tie_up, above, below)
  return (np.sign(x) * nearest).astype(np.float32) * scale


def _normal(seed: int, shape, spread: float = 1.0) -> np.ndarray:
  """Gaussian values times a log-normal spread of magnitudes, so the rounding meets subnormal and large scaled
  values, not just the middle of the grid."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape) * np.exp(spread * rng.normal(size=shape))).astype(np.float32)


def test_grids_match_the_formats():
  assert E4M3_GRID[-1] == 448 == float(jnp.finfo(fp8.E4M3).max) and len(E4M3_GRID) == 127
  assert E5M2_GRID[-1] == 57344 == float(jnp.finfo(fp8.E5M2).max) and len(E5M2_GRID) == 124


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_round_to_matches_the_reference_exactly(name):
  """Every value (4096 of them, magnitudes over ~e^+-6) equals the reference's rounding, and the largest lands on
  the format's largest value times the scale, so no value overflows or is clipped."""
  dtype, grid = GRIDS[name]
  x = _normal(1, (64, 64), spread=2.0)
  want = _reference_round(x, grid)
  if jax.default_backend() != "cpu":
    # Off the CPU, XLA may divide by the scale as a multiply by its reciprocal and fuse the products: the same grid
    # value, times the scale, lands within an ulp or two of IEEE float32 (measured on an H200: at most 1 ulp).
    np.testing.assert_array_max_ulp(np.asarray(fp8.round_to(jnp.asarray(x), dtype)), want, maxulp=2)
  with jax.default_device(jax.devices("cpu")[0]):  # IEEE float32 division and products: exactly the reference.
    got = np.asarray(fp8.round_to(jnp.asarray(x), dtype))
  np.testing.assert_array_equal(got, want)
  assert np.max(np.abs(got)) == np.float32(np.max(np.abs(x)))
  # The rounding is real: 3 (e4m3) or 2 (e5m2) mantissa bits move most values.
  assert np.mean(got != x) > 0.8


def test_product_and_both_gradients_match_the_reference():
  """y = x @ w (x [B, T, K], w [K, N]) and, for a random upstream gradient c: dx = e5m2(c) @ e4m3(w)^T and
  dw = e4m3(x)^T @ e5m2(c), summed over B, T, each within 1e-5 of float64 products of the reference-rounded values
  (float32 accumulation of 48-256 terms); and the product moves visibly from the unrounded one (e4m3 steps)."""
  x, w, c = _normal(2, (2, 8, 48), 0.5), _normal(3, (48, 24), 0.5), _normal(4, (2, 8, 24), 0.5)
  dims = (((2,), (0,)), ((), ()))
  f = lambda x, w: fp8.dot_general(x, w, dims)
  y, pullback = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
  dx, dw = pullback(jnp.asarray(c))
  xq, wq, cq = (_reference_round(a, GRIDS[n][1]).astype(np.float64)
                for a, n in ((x, "e4m3"), (w, "e4m3"), (c, "e5m2")))
  expected = {"y": xq @ wq, "dx": cq @ wq.T, "dw": np.einsum("btk,btn->kn", xq, cq)}
  for name, got in (("y", y), ("dx", dx), ("dw", dw)):
    want = expected[name]
    err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
    assert err < 1e-5, (name, err)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  assert np.max(np.abs(np.asarray(y) - exact)) / np.max(np.abs(exact)) > 1e-3


def test_an_all_zero_operand_gives_zeros_not_nans():
  x = jnp.zeros((4, 16), jnp.float32)
  w = jnp.asarray(_normal(5, (16, 8)))
  y, (dx, dw) = jax.value_and_grad(lambda x, w: jnp.sum(fp8.dot_general(x, w, (((1,), (0,)), ((), ())))),
                                   argnums=(0, 1))(x, w)
  assert float(y) == 0 and np.all(np.isfinite(dx)) and np.all(np.asarray(dw) == 0)


def test_an_overflow_stays_visible():
  """An infinity in an operand or in the gradient arriving at the output comes out non-finite (the clip to the FP8
  range alone would turn it into 448 or 57344, which no overflow check sees); finite inputs stay finite."""
  x, w = jnp.asarray(_normal(6, (4, 16))), jnp.asarray(_normal(7, (16, 8)))
  assert not np.all(np.isfinite(fp8.round_to(x.at[1, 3].set(jnp.inf), fp8.E4M3)))
  product = lambda x, w: fp8.dot_general(x, w, (((1,), (0,)), ((), ())))
  y, pullback = jax.vjp(product, x, w)
  assert np.all(np.isfinite(y))
  dx, dw = pullback(jnp.ones_like(y).at[0, 0].set(jnp.inf))
  assert not np.all(np.isfinite(dx)) and not np.all(np.isfinite(dw))
  dx, dw = pullback(jnp.ones_like(y))
  assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))


RMS_DRIFT = 0.12


def _inner_jaxprs(eqn):
  """The jaxprs nested in one equation's parameters (pjit, custom_vjp_call, scan, cond...)."""
  for value in eqn.params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _contains(jaxpr, found) -> bool:
  return any(found(eqn) or any(_contains(inner, found) for inner in _inner_jaxprs(eqn)) for eqn in jaxpr.eqns)


def _is_dot(eqn) -> bool:
  return eqn.primitive.name == "dot_general"


def _is_float8_convert(eqn) -> bool:
  return eqn.primitive.name == "convert_element_type" and "float8" in str(eqn.params["new_dtype"])


def _dots(jaxpr) -> tuple[int, int]:
  """(dot_generals, those whose every operand passed through a float8 convert) in `jaxpr`, nested jaxprs counted.
  An operand counts as rounded when it is the output of a nested computation that converts to float8 and multiplies
  nothing (fp8's rounding), or an elementwise cast/scale of such an output."""
  rounded, dots, float8_dots = set(), 0, 0
  for eqn in jaxpr.eqns:
    inner = list(_inner_jaxprs(eqn))
    if _is_dot(eqn):
      dots += 1
      float8_dots += all(v in rounded for v in eqn.invars)
    elif inner and not any(_contains(j, _is_dot) for j in inner) and any(_contains(j, _is_float8_convert)
                                                                          for j in inner):
      rounded.update(eqn.outvars)
    elif eqn.primitive.name in ("convert_element_type", "mul") and any(
        v in rounded for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
      rounded.update(eqn.outvars)
    for j in inner:
      if _contains(j, _is_dot):
        counts = _dots(j)
        dots, float8_dots = dots + counts[0], float8_dots + counts[1]
  return dots, float8_dots


@pytest.mark.parametrize("pattern", ["RA", "W"])
def test_model_fp8_rounds_the_projections_and_keeps_the_gradient_direction(pattern):
  """model.fp8 puts every block projection through the FP8 product: in the traced forward pass, the dot_generals
  whose both operands are float8-rounded number exactly the block projection kernels (none without model.fp8; the
  head and the mixers' own products stay float); the logits' RMS drift from the float32 logits stays within 12% of
  their spread (e4m3 rounds to 2^-4 relative, compounded over the layers of a tiny random model: measured 4.7% RA,
  7.3% RWKV-7), and the loss gradient of every projection kernel keeps its direction (cosine > 0.95; measured
  0.989-0.996)."""
  overrides = {"layer_pattern": pattern}
  if pattern == "W":
    overrides.update(rwkv7_head_size=16)
  cfg = micro_config(**overrides).model
  params = jax.jit(model_lib.init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), None)
  params = jax.tree.map(lambda w: w + 0.05 * jax.random.normal(jax.random.key(1), w.shape)
                        if w.ndim == 2 else w, params)  # Move RWKV-7's zero-initialised kernels.
  tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)

  def loss(params, c):
    logits = model_lib.LM(c).apply({"params": params}, tokens[:, :-1])[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  fp8_cfg = dataclasses.replace(cfg, fp8=True)
  projections = sum(1 for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
                    if "kernel" in jax.tree_util.keystr(path) and "head" not in jax.tree_util.keystr(path))
  for c, expected in ((cfg, 0), (fp8_cfg, projections)):
    forward = jax.make_jaxpr(lambda p, c=c: model_lib.LM(c).apply({"params": p}, tokens)[0])(params)
    dots, float8_dots = _dots(forward.jaxpr)
    assert float8_dots == expected and dots > expected, (c.fp8, dots, float8_dots, projections)
  run = jax.jit(lambda p, c: (model_lib.LM(c).apply({"params": p}, tokens)[0], jax.grad(loss)(p, c)),
                static_argnums=1)
  (logits, grads), (logits8, grads8) = run(params, cfg), run(params, fp8_cfg)
  drift, spread = np.asarray(logits8, np.float64) - np.asarray(logits, np.float64), float(np.std(logits))
  assert np.sqrt(np.mean(drift ** 2)) < RMS_DRIFT * spread
  kernels = [(path, g, g8) for (path, g), g8 in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                                     jax.tree.leaves(grads8)) if "kernel" in jax.tree_util.keystr(path)
             and "head" not in jax.tree_util.keystr(path)]
  assert len(kernels) >= 4
  for path, g, g8 in kernels:
    g, g8 = np.asarray(g, np.float64).ravel(), np.asarray(g8, np.float64).ravel()
    cosine = g @ g8 / (np.linalg.norm(g) * np.linalg.norm(g8))
    assert cosine > 0.95, (jax.tree_util.keystr(path), cosine)
