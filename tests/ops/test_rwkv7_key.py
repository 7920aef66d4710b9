"""The key side of an RWKV-7 time-mix (`ltm_jax.ops.rwkv7_key`: learning rate, key norm, delta-rule keys, bonus
sums): its backends' values and gradients against a float64 statement of the formula written here, the Pallas kernels
(`ltm_pallas.rwkv7_key`, interpreted on CPU) against the XLA form, and the RWKV-7 time-mix with the kernels against
the same layer with the XLA form."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_gradients_close
from ltm_jax.layers.rwkv7 import NORMALIZE_EPS, TimeMix7
from ltm_jax.ops import rwkv7_key as op
from ltm_pallas import rwkv7_key as kernel

# B * T = 48 rows: row blocks of 16 (block_rows_for), so three blocks' partial sums of the vectors' gradients add up.
B, T, H, N = 2, 24, 3, 16
C = H * N
# float32 against float64: one norm over N = 16 terms and a few products per output; measured ~3e-7 of the largest
# magnitude. bfloat16 inputs (the reference reads the same rounded values): the kernel rounds each output once, the
# XLA form up to three times; gradients once more: four and eight bfloat16 ulps (2^-8).
F32_RTOL = 1e-5
BF16_RTOL, BF16_GRAD_RTOL = 4 * 2.0**-8, 8 * 2.0**-8
NAMES = ("k", "z", "r", "base", "scale", "mix", "bonus")
OUTPUTS = ("neg_kk", "b", "k2", "rk")


def _inputs(seed, dtype=jnp.float32, b=B, t=T, h=H, n=N):
  """Fresh random (k, z, r, base, scale, mix, bonus): k with a per-head spread, sigmoid(base + z) across (0, 1)."""
  rng = np.random.default_rng(seed)
  c = h * n
  k = (rng.normal(0, 1, (b, t, h, n)) * rng.uniform(0.2, 3, (b, t, h, 1))).reshape(b, t, c)
  arrays = (k, rng.normal(0, 1.5, (b, t, c)), rng.normal(0, 1, (b, t, c)), rng.normal(-0.2, 0.5, c),
            rng.normal(0.7, 0.2, c), rng.normal(1.0, 0.3, c), rng.normal(0, 0.5, c))
  dtypes = (dtype,) * 3 + (jnp.float32,) * 4
  return tuple(jnp.asarray(x, d) for x, d in zip(arrays, dtypes))


def _reference(k, z, r, base, scale, mix, bonus, n=N, eps=NORMALIZE_EPS):
  """The formula in float64 jax.numpy (differentiable for the reference gradients)."""
  b, t, c = k.shape
  a = 1 / (1 + jnp.exp(-(base + z)))
  heads = lambda x: x.reshape(b, t, c // n, n)
  ks = heads(k * scale)
  # max(|ks|, eps) as sqrt(max(|ks|^2, eps^2)): the same value, and a zero head's gradient is finite.
  kk = ks / jnp.sqrt(jnp.maximum(jnp.sum(ks * ks, axis=-1, keepdims=True), eps * eps))
  k2 = k * (1 + (a - 1) * mix)
  return -kk, kk * heads(a), k2, jnp.sum(heads(r * k2 * bonus), axis=-1)


def _cotangents(seed, dtype):
  rng = np.random.default_rng(seed)
  shapes = ((B, T, H, N), (B, T, H, N), (B, T, C), (B, T, H))
  return tuple(jnp.asarray(rng.normal(size=s), d) for s, d in zip(shapes, (dtype,) * 3 + (jnp.float32,)))


def _value_and_grads(fn, inputs, cotangents):
  out, vjp = jax.vjp(fn, *inputs)
  return out, vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, out)))


def _float64(inputs, cotangents):
  with jax.enable_x64(True):
    as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    out, grads = _value_and_grads(_reference, [as64(x) for x in inputs], tuple(as64(c) for c in cotangents))
    return [np.asarray(o) for o in out], [np.asarray(g) for g in grads]


def _close(actual, expected, rtol, what):
  scale = np.abs(expected).max()
  assert scale > 0.1, what  # Not trivially small.
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=rtol * scale, err_msg=what)


def _run(impl):
  return lambda *x: op.rwkv7_key(*x, head_size=N, eps=NORMALIZE_EPS, impl=impl)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_values_and_gradients_match_float64(impl):
  inputs, cotangents = _inputs(0), _cotangents(1, jnp.float32)
  out, grads = _value_and_grads(_run(impl), inputs, cotangents)
  ref_out, ref_grads = _float64(inputs, cotangents)
  for name, o, ref in zip(OUTPUTS, out, ref_out):
    assert o.shape == ref.shape, name
    _close(o, ref, F32_RTOL, name)
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    assert grad.shape == ref.shape and grad.dtype == inputs[NAMES.index(name)].dtype, name
    _close(grad, ref, F32_RTOL, f"d{name}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bfloat16_inputs_within_rounding_of_float64(impl):
  inputs, cotangents = _inputs(2, jnp.bfloat16), _cotangents(3, jnp.bfloat16)
  out, grads = _value_and_grads(_run(impl), inputs, cotangents)
  assert [o.dtype for o in out] == [jnp.bfloat16] * 3 + [jnp.float32]
  ref_out, ref_grads = _float64(inputs, cotangents)
  for name, o, ref in zip(OUTPUTS, out, ref_out):
    _close(o, ref, BF16_RTOL, name)
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    _close(grad, ref, BF16_GRAD_RTOL, f"d{name}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_zero_key_head_takes_the_norm_floor_with_finite_gradients(impl):
  """A head whose key is zero: kk = 0 (divided by eps, not by its zero norm) and every gradient finite (the
  derivative of kk there is 1 / eps, as torch.nn.functional.normalize's)."""
  inputs = list(_inputs(11))
  inputs[0] = inputs[0].at[0, 3, :N].set(0.0)
  out, grads = _value_and_grads(_run(impl), inputs, _cotangents(12, jnp.float32))
  assert np.all(np.asarray(out[0])[0, 3, 0] == 0) and np.all(np.asarray(out[1])[0, 3, 0] == 0)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def test_shapes_the_kernels_do_not_take_run_the_xla_form():
  inputs = _inputs(6, b=1, t=13)
  assert not kernel.supported(13, N)
  for got, want in zip(_run("pallas")(*inputs), _run("xla")(*inputs)):
    np.testing.assert_array_equal(got, want)


def test_shape_errors_and_unknown_impl():
  k, z, r, base, scale, mix, bonus = _inputs(7)
  with pytest.raises(ValueError, match="bonus"):
    op.rwkv7_key(k, z, r, base, scale, mix, bonus[:4], head_size=N, eps=1e-12)
  with pytest.raises(ValueError, match="unknown impl"):
    op.rwkv7_key(k, z, r, base, scale, mix, bonus, head_size=N, eps=1e-12, impl="cuda")


def _random_params(module, *args, seed):
  """Random parameters at their natural scales (zero-initialised projections and constant vectors included)."""
  shapes = nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), *args)["params"])
  rng = np.random.default_rng(seed)

  def draw(path, x):
    if "shift_" in jax.tree_util.keystr(path):
      return jnp.asarray(rng.uniform(0, 1, x.shape), jnp.float32)
    std = 1 / math.sqrt(x.shape[0]) if x.ndim == 2 else 1.0
    return jnp.asarray(rng.normal(0, std, x.shape), jnp.float32)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def test_time_mix_with_the_kernels_matches_the_xla_form():
  """TimeMix7 (float32, a later layer: value residual too) with key_impl='pallas' against the same layer with the
  unfused XLA form: outputs and the gradients of every parameter, the input and v_first."""
  rng = np.random.default_rng(9)
  x, v_first, cotangent = (jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32) for _ in range(3))
  lora = dict(decay_lora=8, iclr_lora=8, value_lora=4, gate_lora=8)
  layers = {impl: TimeMix7(layer=1, n_layers=3, head_size=N, first=False, impl="chunked", out_impl="xla",
                           key_impl=impl, **lora) for impl in ("xla", "pallas")}
  params = _random_params(layers["xla"], x, None, v_first, seed=10)

  def run(impl):
    def loss(params, x, v_first):
      y, _, _ = layers[impl].apply({"params": params}, x, None, v_first)
      return jnp.sum(y * cotangent), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, v_first)
    return y, grads

  (y_xla, g_xla), (y_pallas, g_pallas) = run("xla"), run("pallas")
  _close(y_pallas, np.asarray(y_xla, np.float64), F32_RTOL, "y")
  assert_gradients_close(g_pallas, g_xla, F32_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the Triton kernels are compiled only for one")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_kernels_match_float64_on_a_gpu(dtype):
  """The Triton-compiled kernels (impl='pallas' under jit on a GPU): values and gradients against float64, within
  the GPU tests' tolerances (tests/ops/test_gpu_kernels.py: 2e-3 in float32 for another summation order, 2^-5 in
  bfloat16)."""
  inputs, cotangents = _inputs(13, dtype), _cotangents(14, dtype)
  fn = lambda *x: _value_and_grads(_run("pallas"), x, cotangents)
  assert "__gpu$xla.gpu.triton" in jax.jit(fn).lower(*inputs).as_text()
  out, grads = jax.jit(fn)(*inputs)
  ref_out, ref_grads = _float64(inputs, cotangents)
  rtol = 2e-3 if dtype == jnp.float32 else 2.0**-5
  for name, got, want in zip(OUTPUTS + tuple(f"d{n}" for n in NAMES), (*out, *grads), (*ref_out, *ref_grads)):
    _close(got, want, rtol, name)
