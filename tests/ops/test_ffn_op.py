"""ltm_jax.ops.ffn: y = act(x @ W_in) @ W_out (relu2, swiglu), its xla backend against a float64 reference written
plainly in numpy, values and the gradients of x, W_in and W_out; what the op refuses; the fused backend's fallback
where the kernel's tiles do not divide the shape. The fused kernels themselves (Mosaic GPU, interpret mode) are
checked in tests/ops/test_matmul_mgpu.py, which also runs the op through them."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ffn_reference import reference
from ltm_jax.ops import ffn as ffn_op


def random_inputs(key, rows, d, n, e, groups, dtype):
  """x [rows, d], W_in [d, G, n], W_out [n, e], dy [rows, e]: normal, scaled so z and h are O(1)."""
  kx, ki, ko, kd = jax.random.split(key, 4)
  x = jax.random.normal(kx, (rows, d))
  w_in = jax.random.normal(ki, (d, groups, n)) / np.sqrt(d)
  w_out = jax.random.normal(ko, (n, e)) / np.sqrt(n)
  dy = jax.random.normal(kd, (rows, e))
  return tuple(t.astype(dtype) for t in (x, w_in, w_out, dy))


def run(x, w_in, w_out, dy, activation, impl):
  """(y, dx, dW_in, dW_out) through the op on [1, M, d] inputs."""
  y, pull = jax.vjp(lambda a, b, c: ffn_op.ffn(a[None], b, c, activation=activation, impl=impl)[0], x, w_in, w_out)
  return (y, *pull(dy))


def assert_close(got, expected, rtol, what):
  for name, g, e in zip(("y", "dx", "dW_in", "dW_out"), got, expected):
    g = np.asarray(g, np.float64)
    assert g.shape == e.shape, (what, name)
    np.testing.assert_allclose(g, e, rtol=rtol, atol=rtol * np.max(np.abs(e)), err_msg=f"{what}: {name}")


# Relative to max|expected|. float32: measured <= 4.7e-7. bfloat16: the inputs are rounded before the reference sees
# them, so only the op's own roundings count (z, h, dh, dz and the outputs in bfloat16): measured 3.5e-3 to 6.9e-3.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-6}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_xla_backend_matches_the_float64_reference(activation, dtype):
  key = jax.random.PRNGKey(zlib.crc32(f"{activation} {dtype}".encode()))
  inputs = random_inputs(key, 48, 32, 64, 24, ffn_op.ACTIVATIONS[activation], jnp.dtype(dtype))
  got = run(*inputs, activation, "xla")
  assert all(t.dtype == jnp.dtype(dtype) for t in got)
  assert_close(got, reference(*inputs, activation), TOLERANCE[dtype], f"xla {activation} {dtype}")


def test_the_tolerance_separates_the_activations():
  """The comparison above can fail: swiglu's output against the reference with gate and up swapped."""
  x, w_in, w_out, dy = random_inputs(jax.random.PRNGKey(3), 48, 32, 64, 24, 2, jnp.float32)
  got = run(x, w_in, w_out, dy, "swiglu", "xla")
  with pytest.raises(AssertionError):
    assert_close(got, reference(x, w_in[:, ::-1], w_out, dy, "swiglu"), TOLERANCE["bfloat16"], "swapped")


@pytest.mark.parametrize("rows, d, dtype", [(40, 128, "bfloat16"), (256, 64, "bfloat16"), (256, 128, "float32")])
def test_fused_backend_falls_back_to_xla(rows, d, dtype):
  """Rows not a multiple of the kernel's tile, or d_model 64 (one K step; bfloat16), or float32 at a shape the kernel
  takes: impl="pallas_mgpu" traces no kernel (a Mosaic GPU kernel shows as `mpmd_map`, a Pallas one as `pallas_call`)
  and gives the xla form's values. The fallback multiplies the [M, d] rows where the xla form multiplies [1, M, d]:
  XLA's CPU dot may sum those in different orders (it does on some CPUs), so the values agree to float32 summation
  order (1e-6 of the largest) or one bfloat16 rounding, not bit for bit; the kernel would differ by bfloat16 products'
  error in float32 (~1e-3)."""
  from ltm_pallas import matmul_mgpu  # pylint: disable=g-import-not-at-top
  assert matmul_mgpu.supported(rows, d, 128, 2) == (dtype == "float32")
  inputs = random_inputs(jax.random.PRNGKey(4), rows, d, 128, d, 2, jnp.dtype(dtype))
  traced = str(jax.make_jaxpr(lambda *a: run(*a, "swiglu", "pallas_mgpu"))(*inputs))
  assert "mpmd_map" not in traced and "pallas_call" not in traced
  tolerance = 2.0**-8 if dtype == "bfloat16" else 1e-6
  for got, want in zip(run(*inputs, "swiglu", "pallas_mgpu"), run(*inputs, "swiglu", "xla")):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tolerance * np.max(np.abs(want)))


@pytest.mark.parametrize("activation, shapes, message", [
    ("gelu", ((1, 4, 8), (8, 1, 16), (16, 8)), "activation must be one of"),
    ("swiglu", ((1, 4, 8), (8, 1, 16), (16, 8)), r"swiglu wants x \[B, T, d\], w_in \[d, 2, n\]"),
    ("relu2", ((4, 8), (8, 1, 16), (16, 8)), r"relu2 wants x \[B, T, d\]"),
    ("relu2", ((1, 4, 8), (8, 1, 16), (12, 8)), r"w_out \[n, d_out\]"),
    ("relu2", ((1, 4, 8), (8, 1, 16), (16, 1, 8)), r"w_out \[n, d_out\]"),
])
def test_bad_shapes_are_refused(activation, shapes, message):
  x, w_in, w_out = (jnp.ones(s) for s in shapes)
  with pytest.raises(ValueError, match=message):
    ffn_op.ffn(x, w_in, w_out, activation=activation, impl="xla")
