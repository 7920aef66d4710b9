"""The attention layer's stacked query/key/value product against the three products written out in float64: values and
gradients, with grouped key/value heads (each key/value head's query heads beside it)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.layers.attention import Attention
from ltm_jax.ops.quant_matmul import weights as quant_weights
from ltm_jax.quantize import quantize


def _layer(dtype="float32", heads=6, kv_heads=2):
  return Attention(n_heads=heads, kv_heads=kv_heads, head_dim=8, window=None, capacity=16, rope_theta=10_000.0,
                   std=0.3, out_std=0.3, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _params(heads, kv_heads):
  """Initial parameters (float32 whatever the compute dtype), made once per head layout for the tests here."""
  x = jnp.zeros((1, 5, 24), jnp.float32)
  return nn.meta.unbox(jax.jit(_layer("float32", heads, kv_heads).init)(jax.random.key(heads), x)["params"])


def _project(layer, params, x):
  return layer.apply({"params": params}, x, method=lambda m, x: m._project(x))


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 2.0**-6)])
@pytest.mark.parametrize("heads, kv_heads", [(6, 2), (4, 4)])
def test_stacked_projection_matches_float64(dtype, rtol, heads, kv_heads):
  """q, k, v and the gradients of x and the three kernels from one cotangent each: float32 within 1e-5 of the
  largest entry, bfloat16 within one part in 64. Query head h must come from column h of the query kernel (its
  key/value head is h // (heads / kv_heads)), which a wrong grouping would permute."""
  layer = _layer(dtype, heads, kv_heads)
  x = jax.random.normal(jax.random.key(1), (2, 5, 24), jnp.float32)
  params = _params(heads, kv_heads)
  cots = [jax.random.normal(jax.random.key(2 + i), (2, 5, h, 8), jnp.float32)
          for i, h in enumerate((heads, kv_heads, kv_heads))]

  def loss(kernels, x):
    outs = _project(layer, {**params, **{n: {"kernel": w} for n, w in zip("qkv", kernels)}}, x)
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cots)), outs

  kernels = tuple(params[n]["kernel"] for n in "qkv")
  (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(kernels, x)
  with jax.enable_x64(True):
    as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
    reference = lambda w, x: tuple(jnp.einsum("btc,chd->bthd", x, k) for k in w)
    outs_ref, pullback = jax.vjp(reference, tuple(as64(k) for k in kernels), as64(x))
    (dw_ref, dx_ref) = pullback(tuple(as64(c) for c in cots))
  found = (*outs, grads[1], *grads[0])
  for name, got, want in zip(("q", "k", "v", "dx", "dq_kernel", "dk_kernel", "dv_kernel"), found,
                             (*outs_ref, dx_ref, *dw_ref)):
    got, want = np.asarray(got, np.float64), np.asarray(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < rtol, (name, err)


def test_quantised_kernels_take_the_three_products():
  """Kernels stored as int8 are read through their `Dense` (the quantised matmul): the same output as their
  dequantised values through the stacked product, to the quantised matmul's float32 rounding."""
  layer = _layer()
  x = jax.random.normal(jax.random.key(3), (1, 4, 24), jnp.float32)
  params = nn.meta.unbox(jax.jit(layer.init)(jax.random.key(4), x)["params"])
  quantised = {n: {"kernel": quantize(w["kernel"], contract=(0,)) if n in "qkv" else w["kernel"]}
               for n, w in params.items()}
  dequantised = {n: {"kernel": quant_weights.dequantize(w["kernel"]) if quant_weights.is_quantized(w["kernel"])
                     else w["kernel"]} for n, w in quantised.items()}
  apply = jax.jit(lambda params, x: layer.apply({"params": params}, x)[0])
  y_quantised, y_dequantised = apply(quantised, x), apply(dequantised, x)
  np.testing.assert_allclose(y_quantised, y_dequantised, atol=1e-5 * float(jnp.max(jnp.abs(y_dequantised))))
