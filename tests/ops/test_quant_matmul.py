"""The quantised matmul op (every backend; Pallas interpreted) against a float64 product written out below, and its
agreement with the weights `ltm_jax.inference.quantize` stores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.inference.quantize import dequantize_params, matmul_operands, quantize_params
from ltm_jax.ops.quant_matmul import AVAILABLE, quant_matmul
from ltm_pallas import backend as kernel_backend

# float32 inputs, float32 accumulation over K <= 96 terms: ~1e-7 of the output's scale; allow 2e-6. bfloat16 x is
# rounded before the reference sees it, so only the output's rounding (2^-8 relative) and float32 sums remain.
F32_RTOL, BF16_RTOL = 2e-6, 2.0**-8
CASES = {  # name: (M, G, group, N, packed)
    "int8_per_channel": (3, 1, 96, 48, False),  # G = 1: per output channel; K = 96 is run in 32-row chunks.
    "int4_groups": (2, 3, 32, 80, True),  # N = 80: 16-column tiles.
}


def _case(seed: int, m: int, groups: int, group: int, n: int, packed: bool):
  """Random x [M, K], integer values [G, group, N] in range, scales, and the stored (values, scale) operands."""
  rng = np.random.default_rng(seed)
  bound = 7 if packed else 127
  x = rng.normal(size=(m, groups * group))
  values = rng.integers(-bound, bound + 1, size=(groups, group, n))
  scale = rng.uniform(0.01, 0.1, size=(groups, n))
  if packed:  # Byte i of a group: input i in the low nibble, input i + group/2 in the high one.
    half = group // 2
    stored = (values[:, :half] & 0xF) | ((values[:, half:] & 0xF) << 4)
    stored = np.where(stored >= 128, stored - 256, stored).astype(np.int8)
  else:
    stored = values.astype(np.int8)
  weight = (values * scale[:, None, :]).reshape(groups * group, n)  # float64 [K, N]
  return x, weight, jnp.asarray(stored), jnp.asarray(scale, jnp.float32)


@pytest.mark.parametrize("impl", AVAILABLE)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_a_float64_product(name, impl):
  x, weight, values, scale = _case(0, *CASES[name])
  expected = x @ weight
  got = np.asarray(quant_matmul(jnp.asarray(x, jnp.float32), values, scale, packed=CASES[name][-1], impl=impl))
  np.testing.assert_allclose(got, expected, rtol=0, atol=F32_RTOL * np.max(np.abs(expected)))
  # bfloat16 activations, with leading batch axes [2, M, K]: the weights convert to x's dtype in the product.
  xb = jnp.asarray(np.stack([x, -x]), jnp.bfloat16)
  expected = np.asarray(xb, np.float64) @ weight
  got = quant_matmul(xb, values, scale, packed=CASES[name][-1], impl=impl)
  assert got.dtype == jnp.bfloat16 and got.shape == expected.shape
  np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=0, atol=BF16_RTOL * np.max(np.abs(expected)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_auto_traces_every_platform_branch(name, monkeypatch):
  """Under impl="auto" in a process that may compile for a GPU (a deviceless H100 compile, a GPU host), the op's
  arguments become operands of lax.platform_dependent, and the GPU branch (the Pallas kernel, which takes `packed`
  statically) is traced too: here, on the CPU, with that possibility forced on, the jitted op traces both branches
  and runs the CPU one, matching the float64 product."""
  monkeypatch.setattr(kernel_backend, "may_compile_for_gpu", lambda: True)
  x, weight, values, scale = _case(3, *CASES[name])
  run = jax.jit(lambda x, v, s: quant_matmul(x, v, s, packed=CASES[name][-1]))
  expected = x @ weight
  np.testing.assert_allclose(np.asarray(run(jnp.asarray(x, jnp.float32), values, scale)), expected, rtol=0,
                             atol=F32_RTOL * np.max(np.abs(expected)))


def test_reads_the_weights_quantize_stores():
  """A multi-head output projection [heads, head_dim, embed] (two contraction axes) quantised by quantize_params:
  the op on its matmul_operands equals x @ the dequantised weight, so the layouts of the two agree (the backends
  agree with each other above)."""
  w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32, 48)), jnp.float32)
  x = np.random.default_rng(2).normal(size=(3, 64))
  for kind in ("int8", "int4"):
    q = quantize_params({"out": w}, {"out": ("heads", "head_dim", "embed")}, kind, 32)["out"]
    expected = x @ np.asarray(dequantize_params({"w": q})["w"], np.float64).reshape(64, 48)
    values, scale, packed = matmul_operands(q)
    assert packed == (kind == "int4") and values.shape == ((2, 16, 48) if packed else (1, 64, 48))
    got = np.asarray(quant_matmul(jnp.asarray(x, jnp.float32), values, scale, packed=packed, impl="xla"))
    np.testing.assert_allclose(got, expected, rtol=0, atol=F32_RTOL * np.max(np.abs(expected)))


def test_bad_shapes_are_refused():
  x, _, values, scale = _case(3, *CASES["int4_groups"])
  with pytest.raises(ValueError, match="x has 95 inputs but the weight holds 3 groups of 16 packed rows"):
    quant_matmul(jnp.ones((2, 95)), values, scale, packed=True)
  with pytest.raises(ValueError, match="values must be int8"):
    quant_matmul(jnp.asarray(x), values.astype(jnp.int32), scale, packed=True)
  with pytest.raises(ValueError, match="the kernel needs N and the group rows to be multiples of 16"):
    quant_matmul(jnp.ones((2, 48)), jnp.ones((3, 8, 16), jnp.int8), jnp.ones((3, 16)), packed=True, impl="pallas")
  # Under "auto" the same shape runs (the reference takes any shape).
  small = quant_matmul(jnp.ones((2, 48)), jnp.ones((3, 8, 16), jnp.int8), jnp.ones((3, 16)), packed=True)
  # Every byte 0x01: value 1 for the first half of each group of 16, 0 for the second; 3 groups of 8 ones.
  np.testing.assert_array_equal(np.asarray(small), np.full((2, 16), 24.0))
