"""MM-Rec's projections (qkvz, gate_z, the decay MLPs, bank_query, bank_out) multiply in FP8 under model.fp8 like
every other block projection, and their plain products equal the einsums they are written as (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.layers.mmrec import MMRec, _matmul

PROJECTIONS = 8  # qkvz, gate_z, decay_z down/up, decay_k down/up, bank_query, bank_out.


@pytest.mark.parametrize("precompute", [True, False])
def test_every_projection_rounds_both_operands_to_e4m3_under_fp8(precompute):
  make = lambda fp8: MMRec(n_heads=2, slots=4, segment=4, precompute=precompute, dtype="bfloat16", fp8=fp8)
  x = jax.random.normal(jax.random.key(0), (2, 8, 16))
  params = make(False).init(jax.random.key(1), x)

  def count(fp8):
    layer = make(fp8)
    return str(jax.make_jaxpr(lambda p: layer.apply(p, x)[0])(params)).count("new_dtype=float8_e4m3fn")

  assert count(False) == 0
  assert count(True) == 2 * PROJECTIONS


def test_matmul_contracts_like_the_einsums():
  with jax.enable_x64(True):
    rng = np.random.default_rng(7)
    hs, w_qm = rng.standard_normal((2, 5, 12)), rng.standard_normal((12, 3, 4))
    read, w_o = rng.standard_normal((2, 5, 3, 4)), rng.standard_normal((3, 4, 12))
    np.testing.assert_allclose(_matmul(jnp.asarray(hs), jnp.asarray(w_qm), jnp.float64),
                               np.einsum("btd,dhn->bthn", hs, w_qm), rtol=1e-12)
    np.testing.assert_allclose(_matmul(jnp.asarray(read), jnp.asarray(w_o), jnp.float64, contract=2),
                               np.einsum("bthn,hnd->btd", read, w_o), rtol=1e-12)
