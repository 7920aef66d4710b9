"""The RWKV-7 output stage (`ltm_jax.ops.rwkv7_out`: group norm, r.k bonus, gate): its backends' values and gradients
against a float64 statement of the formula written here, the Pallas kernels (`ltm_pallas.rwkv7_out`, interpreted
on CPU) against the XLA form, and the RWKV-7 time-mix with the kernels against the same layer with the XLA form."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_gradients_close
from ltm_jax.layers.rwkv7 import GROUP_NORM_EPS, TimeMix7
from ltm_jax.ops import rwkv7_out as op
from ltm_pallas import rwkv7_out as kernel

# B * T = 48 rows: row blocks of 16 (block_rows_for), so three blocks' partial sums of d_scale and d_bias are added.
B, T, H, N = 2, 24, 3, 16
C = H * N
# float32 against float64: a head's mean and variance over N = 16 terms and one product per output; measured
# ~5e-7 of the largest magnitude. bfloat16 inputs (the reference reads the same rounded values): the kernel rounds its
# output once, the XLA form three times; gradients are rounded once more: four and eight bfloat16 ulps (2^-8).
F32_RTOL = 1e-5
BF16_RTOL, BF16_GRAD_RTOL = 4 * 2.0**-8, 8 * 2.0**-8
NAMES = ("y", "rk", "v", "g", "scale", "bias")


def _inputs(seed, dtype=jnp.float32, b=B, t=T, h=H, n=N):
  """Fresh random (y, rk, v, g, scale, bias): y with a per-head offset and spread, so the normalisation matters."""
  rng = np.random.default_rng(seed)
  c = h * n
  y = rng.normal(0, 1, (b, t, h, n)) * rng.uniform(0.2, 3, (b, t, h, 1)) + rng.normal(0, 2, (b, t, h, 1))
  arrays = (y, rng.normal(0, 1, (b, t, h)), rng.normal(0, 1, (b, t, c)), rng.normal(0, 1, (b, t, c)),
            rng.normal(1, 0.3, c), rng.normal(0, 0.3, c))
  dtypes = (dtype, jnp.float32, dtype, dtype, jnp.float32, jnp.float32)
  return tuple(jnp.asarray(a, d) for a, d in zip(arrays, dtypes))


def _reference(y, rk, v, g, scale, bias, eps=GROUP_NORM_EPS):
  """The formula in float64 jax.numpy (differentiable for the reference gradients)."""
  b, t, h, n = y.shape
  mean = jnp.mean(y, axis=-1, keepdims=True)
  var = jnp.mean((y - mean) ** 2, axis=-1, keepdims=True)
  z = (y - mean) / jnp.sqrt(var + eps) * scale.reshape(h, n) + bias.reshape(h, n)
  z = z + rk[..., None] * v.reshape(b, t, h, n)
  return z.reshape(b, t, h * n) * g


def _value_and_grads(fn, inputs, cotangent):
  """fn's output and the gradients of sum(output * cotangent) with respect to every input."""
  out, vjp = jax.vjp(fn, *inputs)
  return out, vjp(cotangent.astype(out.dtype))


def _float64(inputs, cotangent):
  with jax.enable_x64(True):
    as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
    out, grads = _value_and_grads(_reference, [as64(a) for a in inputs], as64(cotangent))
    return np.asarray(out), [np.asarray(g) for g in grads]


def _close(actual, expected, rtol, what):
  scale = np.abs(expected).max()
  assert scale > 0.1, what  # Not trivially small.
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_values_and_gradients_match_float64(impl):
  inputs = _inputs(0)
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, C)), jnp.float32)
  fn = lambda *a: op.rwkv7_out(*a, eps=GROUP_NORM_EPS, impl=impl)
  out, grads = _value_and_grads(fn, inputs, cotangent)
  ref_out, ref_grads = _float64(inputs, cotangent)
  _close(out, ref_out, F32_RTOL, "out")
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    assert grad.shape == ref.shape and grad.dtype == inputs[NAMES.index(name)].dtype, name
    _close(grad, ref, F32_RTOL, f"d{name}")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bfloat16_inputs_within_rounding_of_float64(impl):
  inputs = _inputs(2, jnp.bfloat16)
  cotangent = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, C)), jnp.bfloat16)
  fn = lambda *a: op.rwkv7_out(*a, eps=GROUP_NORM_EPS, impl=impl)
  out, grads = _value_and_grads(fn, inputs, cotangent)
  assert out.dtype == jnp.bfloat16
  ref_out, ref_grads = _float64(inputs, cotangent)
  _close(out, ref_out, BF16_RTOL, "out")
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    _close(grad, ref, BF16_GRAD_RTOL, f"d{name}")


def test_kernel_matches_the_xla_form_and_uses_several_row_blocks():
  assert kernel.block_rows_for(B * T) == 16 and kernel.supported(B * T, N)
  inputs = _inputs(4)
  cotangent = jnp.asarray(np.random.default_rng(5).normal(size=(B, T, C)), jnp.float32)
  outs = {impl: _value_and_grads(lambda *a, impl=impl: op.rwkv7_out(*a, eps=GROUP_NORM_EPS, impl=impl), inputs,
                                 cotangent) for impl in ("xla", "pallas")}
  (xla_out, xla_grads), (pallas_out, pallas_grads) = outs["xla"], outs["pallas"]
  _close(pallas_out, np.asarray(xla_out, np.float64), F32_RTOL, "out")
  for name, a, b in zip(NAMES, pallas_grads, xla_grads):
    _close(a, np.asarray(b, np.float64), F32_RTOL, f"d{name}")


@pytest.mark.parametrize("shape", [(1, 13, 2, 16), (2, 8, 2, 12)], ids=["rows_13", "head_size_12"])
def test_shapes_the_kernels_do_not_take_run_the_xla_form(shape):
  b, t, h, n = shape
  assert not kernel.supported(b * t, n)
  inputs = _inputs(6, b=b, t=t, h=h, n=n)
  np.testing.assert_array_equal(op.rwkv7_out(*inputs, eps=GROUP_NORM_EPS, impl="pallas"),
                                op.rwkv7_out(*inputs, eps=GROUP_NORM_EPS, impl="xla"))


def test_block_rows_for():
  assert [kernel.block_rows_for(r) for r in (64, 128, 48, 24, 26, 13, 32768)] == [64, 64, 16, 8, 2, 1, 64]


def test_shape_errors_and_unknown_impl():
  y, rk, v, g, scale, bias = _inputs(7)
  with pytest.raises(ValueError, match="rk"):
    op.rwkv7_out(y, rk[..., :1], v, g, scale, bias, eps=1e-5)
  with pytest.raises(ValueError, match="unknown impl"):
    op.rwkv7_out(y, rk, v, g, scale, bias, eps=1e-5, impl="cuda")


def test_kernels_refuse_a_second_derivative_in_one_line():
  inputs = _inputs(8)
  f = lambda y: jnp.sum(jnp.sin(op.rwkv7_out(y, *inputs[1:], eps=GROUP_NORM_EPS, impl="pallas")))
  second = jax.grad(lambda y: jnp.sum(jnp.sin(jax.grad(f)(y))))
  with pytest.raises(NotImplementedError) as error:
    jax.make_jaxpr(second)(inputs[0])
  assert "\n" not in str(error.value) and "rwkv7_out: impl='pallas'" in str(error.value)
  assert "no second derivative" in str(error.value)


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


@pytest.mark.parametrize("first", [True, False])
def test_time_mix_with_the_kernels_matches_the_xla_form(first):
  """TimeMix7 (float32) with out_impl='pallas' against the same layer with the unfused XLA form: outputs and the
  gradients of every parameter, the input and v_first."""
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  v_first = None if first else jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(0, 1, (B, T, C)), jnp.float32)
  lora = dict(decay_lora=8, iclr_lora=8, value_lora=4, gate_lora=8)
  layers = {impl: TimeMix7(layer=0 if first else 1, n_layers=3, head_size=N, first=first, impl="chunked",
                           out_impl=impl, **lora) for impl in ("xla", "pallas")}
  params = _random_params(layers["xla"], x, None, v_first, seed=10)

  def run(impl):
    def loss(params, x, v_first):
      y, _, _ = layers[impl].apply({"params": params}, x, None, v_first)
      return jnp.sum(y * cotangent), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1) if first else (0, 1, 2), has_aux=True)(params, x, v_first)
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
  inputs = _inputs(11, dtype)
  cotangent = jnp.asarray(np.random.default_rng(12).normal(size=(B, T, C)), dtype)
  fn = lambda *a: _value_and_grads(lambda *x: op.rwkv7_out(*x, eps=GROUP_NORM_EPS, impl="pallas"), a, cotangent)
  assert "__gpu$xla.gpu.triton" in jax.jit(fn).lower(*inputs).as_text()
  out, grads = jax.jit(fn)(*inputs)
  ref_out, ref_grads = _float64(inputs, cotangent)
  rtol = 2e-3 if dtype == jnp.float32 else 2.0**-5
  _close(out, ref_out, rtol, "out")
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    _close(grad, ref, rtol, f"d{name}")
