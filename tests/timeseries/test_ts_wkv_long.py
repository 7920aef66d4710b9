"""Every WKV backend over a series as long as the benchmark's (T = 3750) with decays at both extremes (almost none,
so 3750 steps of keys pile up in the state, and near-total forgetting), against float64 recurrences written here.
Width is tiny (4 channels, one head of 4): length and decay are what is under test. The Pallas backends are
interpreted on a CPU and compiled (Triton) on a GPU; at head size 4 and decays down to e^-30, WKV-7's pallas_chunked
takes the sequential kernels there (float32 elementwise recurrences, no matrix products)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.wkv4 import AVAILABLE as WKV4_IMPLS
from ltm_jax.ops.wkv4 import wkv4
from ltm_jax.ops.wkv7 import AVAILABLE as WKV7_IMPLS
from ltm_jax.ops.wkv7 import wkv7

T = 3750
# Max |y - y64| relative to max |y64|: float32 against float64 after 3750 accumulating steps (every backend
# measured at about 2e-7 on CPU, none yet on a GPU; 25x that leaves room for other compilers' summation orders).
RTOL_OF_MAX = 5e-6


def _wkv4_float64(w, u, k, v):
  """y_t = (a + e^{u + k_t} v_t) / (b + e^{u + k_t}); a <- e^w a + e^{k_t} v_t, b <- e^w b + e^{k_t}."""
  batch, length, channels = k.shape
  a, b = np.zeros((batch, channels)), np.zeros((batch, channels))
  y = np.empty((batch, length, channels))
  for t in range(length):
    now = np.exp(u + k[:, t])
    y[:, t] = (a + now * v[:, t]) / (b + now)
    a = np.exp(w) * a + np.exp(k[:, t]) * v[:, t]
    b = np.exp(w) * b + np.exp(k[:, t])
  return y


def _wkv7_float64(r, w, k, v, a, b):
  """S <- S diag(e^w) + (S a) b^T + v k^T, y = S r (ltm_jax/ops/wkv7's definition), per row and head."""
  batch, length, heads, n = r.shape
  state = np.zeros((batch, heads, n, n))
  y = np.empty((batch, length, heads, n))
  for t in range(length):
    sa = np.einsum("bhij,bhj->bhi", state, a[:, t])
    state = (state * np.exp(w[:, t])[:, :, None, :] + sa[..., None] * b[:, t][:, :, None, :]
             + v[:, t][..., None] * k[:, t][:, :, None, :])
    y[:, t] = np.einsum("bhij,bhj->bhi", state, r[:, t])
  return y


def _close(y, expected):
  error = float(np.abs(np.asarray(y, np.float64) - expected).max() / np.abs(expected).max())
  assert error < RTOL_OF_MAX, error


@pytest.mark.parametrize("impl", WKV4_IMPLS)
def test_wkv4_backends_over_3750_steps_with_extreme_decays(impl):
  rng = np.random.default_rng(1)
  # Per-step decay e^w from 0.9999 (3750 steps keep 69%) to e^-50; keys spread over +-9 so e^k spans 8 decades.
  w = -np.array([1e-4, 1e-2, 5.0, 50.0])
  u = rng.standard_normal(4)
  k, v = 3 * rng.standard_normal((2, T, 4)), rng.standard_normal((2, T, 4))
  run = jax.jit(lambda *xs: wkv4(*xs, impl=impl)[0])
  y = run(*(jnp.asarray(x, jnp.float32) for x in (w, u, k, v)))
  _close(y, _wkv4_float64(w, u, k, v))


# pallas_mgpu (head sizes 64 and 128, bfloat16 products, jax >= 0.11) is held to the reference in
# tests/ops/test_wkv7_mgpu.py.
@pytest.mark.parametrize("impl", [impl for impl in WKV7_IMPLS if impl != "pallas_mgpu"])
def test_wkv7_backends_over_3750_steps_with_extreme_decays(impl):
  rng = np.random.default_rng(2)
  shape = (2, T, 1, 4)
  r, k, v = (rng.standard_normal(shape) for _ in range(3))
  # Log-decays beyond both ends of what an RWKV-7 layer makes ((-0.61, 0)): 1e-6 per step and e^-30.
  w = np.broadcast_to(-np.array([1e-6, 0.61, 5.0, 30.0]), shape)
  kk = rng.standard_normal(shape)
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  iclr = 1 / (1 + np.exp(-rng.standard_normal(shape)))
  a, b = -kk, kk * iclr
  run = jax.jit(lambda *xs: wkv7(*xs, impl=impl)[0])
  y = run(*(jnp.asarray(x, jnp.float32) for x in (r, w, k, v, a, b)))
  _close(y, _wkv7_float64(r, w, k, v, a, b))
