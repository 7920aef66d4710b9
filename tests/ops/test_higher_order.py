"""Second derivatives through every op whose backend has a custom derivative rule: the backends whose rules are fused
kernels refuse one with a single line naming the op and the backends that have one; the others match a float64
reference. Pallas kernels run interpreted here (the refusal happens while tracing, before any kernel runs); the same
refusals on compiled kernels are in tests/ops/test_gpu_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax import ops
from ltm_jax.ops.attention import cudnn
from ltm_jax.ops.mdi import mdi
from ltm_jax.ops.quant_matmul import quant_matmul
from ltm_jax.ops.rwkv7_key import rwkv7_key
from ltm_jax.ops.add_norm import add_norm
from ltm_jax.ops.rwkv7_out import rwkv7_out


def _normal(seed: int, shape) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _second(f):
  """x -> d/dx sum(sin(d/dx sum(sin(f(x))))): a second derivative that every output and gradient entry feeds."""
  first = jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))
  return jax.grad(lambda x: jnp.sum(jnp.sin(first(x))))


# op: (the function of one array, its shape, what the refusal must name). Shapes are the kernels' smallest tiles.
REFUSED = {
    "attention_pallas": (lambda q: ops.attention(q, q * 0.5, q, causal=True, impl="pallas"), (1, 16, 2, 16),
                         ("attention: impl='pallas'", "impl='xla'")),
    # cuDNN needs a GPU; here the same wrapper runs JAX's own attention through the mapped arguments.
    "attention_cudnn": (lambda q: cudnn.attention(q, q * 0.5, q, causal=True, window=4, scale=0.3,
                                                  implementation="xla"), (1, 16, 2, 16),
                        ("attention: impl='cudnn'", "impl='xla'")),
    "wkv4_pallas": (lambda k: ops.wkv4(-jnp.exp(k[0, 0]), k[0, 1], k, -k, impl="pallas")[0], (1, 16, 8),
                    ("wkv4: impl='pallas'", "impl='scan'", "impl='associative'")),
    "wkv7_pallas": (lambda x: ops.wkv7(x, -jnp.exp(x), x, -x, x, x * x, impl="pallas")[0], (1, 16, 1, 16),
                    ("wkv7: impl='pallas'", "impl='scan'", "impl='chunked'")),
    # Log-decays above the chunked kernels' bound (-3.75 at chunk 16), so either branch of pallas_chunked may run.
    "wkv7_pallas_chunked": (lambda x: ops.wkv7(x, -0.5 * jax.nn.sigmoid(x), x, -x, x, x * x,
                                               impl="pallas_chunked")[0], (1, 16, 1, 16),
                            ("wkv7: impl='pallas' and impl='pallas_chunked'", "impl='scan'", "impl='chunked'")),
    # y [B, T, H, N] with the bonus sums, values, gate and affine all drawn from it, so every input is differentiated.
    "rwkv7_out_pallas": (lambda y: rwkv7_out(y, y[..., 0], jnp.sin(y).reshape(1, 16, 16), y.reshape(1, 16, 16) * 0.5,
                                             y[0, 0, 0], y[0, 1, 0], eps=64e-5, impl="pallas"), (1, 16, 1, 16),
                         ("rwkv7_out: impl='pallas'", "impl='xla'")),
    # k [B, T, C] with the learning rate, receptance and vectors drawn from it; every output feeds the sum.
    "rwkv7_key_pallas": (lambda k: jnp.concatenate([o.reshape(-1) for o in rwkv7_key(
        k, k * 0.5, jnp.sin(k), k[0, 3], k[0, 0], k[0, 1] * 0.5, k[0, 2], head_size=16, eps=1e-12, impl="pallas")]),
                         (1, 16, 16), ("rwkv7_key: impl='pallas'", "impl='xla'")),
    # x [B, T, C] with the sub-layer output, scale and bias drawn from it; both outputs feed the sum.
    "add_norm_pallas": (lambda x: jnp.concatenate([o.reshape(-1) for o in add_norm(
        x, jnp.sin(x), x[0, 0], x[0, 1], kind="layernorm", eps=1e-5, dtype=jnp.float32, impl="pallas")]),
                          (1, 16, 16), ("add_norm: impl='pallas'", "impl='xla'")),
}


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_fused_kernels_refuse_a_second_derivative_in_one_line(op):
  f, shape, names = REFUSED[op]
  x = _normal(0, shape)
  with pytest.raises(NotImplementedError) as error:
    jax.make_jaxpr(_second(f))(x)
  message = str(error.value)
  assert "\n" not in message, message
  for name in names:
    assert name in message, message
  assert "no second derivative" in message


def test_first_derivative_of_the_guarded_cudnn_wrapper_is_unchanged():
  """The wrapper that refuses a second derivative passes the first one through: equal to JAX's own attention's."""
  q, k, v = (_normal(i, (2, 12, 2, 8)) for i in (1, 2, 3))
  wrapped = lambda q, k, v: cudnn.attention(q, k, v, causal=True, window=5, scale=0.4, implementation="xla")
  plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.4, is_causal=True, local_window_size=(4, 0))
  loss = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.cos(fn(*a))), argnums=(0, 1, 2))
  for got, want in zip(jax.jit(loss(wrapped))(q, k, v), jax.jit(loss(plain))(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_quant_matmul_pallas_second_derivative_matches_float64():
  """The kernel's tangent is the reference product of the tangents, so it has derivatives of every order: the second
  derivative in x and the first in the scales against a float64 product (float32 sums over K = 32: 1e-5)."""
  rng = np.random.default_rng(4)
  m, k, n = 3, 32, 16
  values = rng.integers(-127, 128, size=(1, k, n))
  x, scale = rng.normal(size=(m, k)) * 0.1, rng.uniform(0.01, 0.03, size=(1, n))
  run = lambda x, s: quant_matmul(x, jnp.asarray(values, jnp.int8), s, packed=False, impl="pallas")
  loss = lambda mm: lambda x, s: jnp.sum(jnp.sin(jax.grad(lambda x: jnp.sum(jnp.sin(mm(x, s))))(x)))
  got = jax.jit(jax.grad(loss(run), argnums=(0, 1)))(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32))
  with jax.enable_x64(True):
    exact = lambda x, s: x @ (jnp.asarray(values, jnp.float64) * s[:, None, :]).reshape(k, n)
    want = jax.jit(jax.grad(loss(exact), argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(scale))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


def test_mmrec_adjoint_second_derivative_matches_the_differentiated_recurrence():
  """The adjoint backend's hand-written backward pass is plain JAX, so differentiating it again is exact: the second
  derivative equals that of the reference recurrence (plain autodiff of a scan), both in float64, to 1e-9."""
  rng = np.random.default_rng(5)
  b, t, d = 2, 3, 4
  gate_z, z, h0 = rng.normal(size=(b, t, d)), rng.normal(size=(b, t, d)), rng.normal(size=(b, d))
  gamma, w_h, scale = rng.uniform(0.1, 0.9, size=(b, t, d)), rng.normal(size=(d, d)) / 2, 1 + 0.3 * rng.normal(size=d)
  with jax.enable_x64(True):
    def second(impl):
      f = lambda z: mdi(jnp.asarray(gate_z), z, jnp.asarray(gamma), jnp.asarray(w_h), jnp.asarray(scale),
                        jnp.asarray(h0), impl=impl)[0]
      return np.asarray(jax.jit(_second(f))(jnp.asarray(z)))
    got, want = second("adjoint"), second("scan")
  assert np.all(np.isfinite(want)) and np.max(np.abs(want)) > 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
