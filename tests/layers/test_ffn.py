"""The SwiGLU block's fused gate/up product against a plain float64 SwiGLU: values and every gradient."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.layers.ffn import SwiGLU
from ltm_jax.ops.quant_matmul import weights as quant_weights
from ltm_jax.quantize import quantize


def _reference(x, gate, up, down):
  """silu(x W_gate) * (x W_up) W_down in float64, written out."""
  g, u = x @ gate, x @ up
  return ((g / (1 + jnp.exp(-g))) * u) @ down


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 2.0**-6)])
def test_fused_gate_up_matches_float64(dtype, rtol):
  """Products in `dtype` with float32 accumulation: float32 within 1e-5 of the spread, bfloat16 within one part in
  64 (its operands and output each rounded to 8 bits)."""
  block = SwiGLU(hidden=48, std=0.3, out_std=0.3, dtype=dtype)
  x = jax.random.normal(jax.random.key(1), (2, 5, 16), jnp.float32)
  params = nn.meta.unbox(block.init(jax.random.key(0), x)["params"])
  cotangent = jax.random.normal(jax.random.key(2), (2, 5, 16), jnp.float32)

  def loss(params, x):
    y, _ = block.apply({"params": params}, x)
    return jnp.sum(y.astype(jnp.float32) * cotangent), y

  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  with jax.enable_x64(True):
    as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
    args = (as64(x), *(as64(params[n]["kernel"]) for n in ("gate", "up", "down")))
    y_ref, pullback = jax.vjp(_reference, *args)
    grads_ref = pullback(as64(cotangent))
  found = (y, grads[1], grads[0]["gate"]["kernel"], grads[0]["up"]["kernel"], grads[0]["down"]["kernel"])
  for name, got, want in zip(("y", "dx", "dgate", "dup", "ddown"), found, (y_ref, *grads_ref)):
    got, want = np.asarray(got, np.float64), np.asarray(want)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < rtol, (name, err)


def test_quantised_kernels_take_the_two_products():
  """Kernels stored as int8 are read through their `Dense` (the quantised matmul): same output as their
  dequantised values through the fused product, to the quantised matmul's float32 rounding."""
  block = SwiGLU(hidden=64, std=0.3, out_std=0.3)
  x = jax.random.normal(jax.random.key(3), (1, 4, 32), jnp.float32)
  params = nn.meta.unbox(block.init(jax.random.key(4), x)["params"])
  quantised = {name: {"kernel": quantize(params[name]["kernel"], contract=(0,)) if name != "down" else
                      params[name]["kernel"]} for name in params}
  dequantised = {name: {"kernel": quant_weights.dequantize(w["kernel"]) if quant_weights.is_quantized(w["kernel"])
                        else w["kernel"]} for name, w in quantised.items()}
  y_quantised, _ = block.apply({"params": quantised}, x)
  y_dequantised, _ = block.apply({"params": dequantised}, x)
  np.testing.assert_allclose(y_quantised, y_dequantised, atol=1e-5 * float(jnp.max(jnp.abs(y_dequantised))))
