"""`impl="auto"` and the Pallas lowering follow the platform a computation is compiled for, and the library imports
without the Triton lowering module."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from conftest import ROOT
from ltm_jax import ops
from ltm_jax.ops.neural_memory import initial_state, neural_memory
from ltm_pallas import backend as kernel_backend

TRITON_CALL = "__gpu$xla.gpu.triton"


def _module(fn, platform: str, *args) -> str:
  """StableHLO of `fn` lowered for `platform` (no device of that platform needed)."""
  allow = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
  return export.export(jax.jit(fn), platforms=[platform], disabled_checks=allow)(*args).mlir_module()


def _inputs(seed: int, *shapes):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)]


CASES = {
    "wkv4": lambda k: ops.wkv4(-jnp.exp(k[0, 0]), k[0, 1], k, k)[0],
    "wkv7": lambda x: ops.wkv7(x, -jnp.exp(x), x, x, -x, x)[0],
    "attention": lambda q: ops.attention(q, q, q, causal=True),
}
# WKV-4's rows x channels at the kernels' side of ops.wkv4.GPU_PALLAS_MIN_CHANNELS (fewer take the associative scan).
SHAPES = {"wkv4": (2, 8, 4096), "wkv7": (1, 32, 2, 16), "attention": (1, 64, 2, 32)}


@pytest.fixture
def gpu_target(monkeypatch):
  """As in a process that can compile for a GPU (a GPU host, or the CUDA plugin for a deviceless compilation)."""
  monkeypatch.setattr(kernel_backend, "may_compile_for_gpu", lambda: True)


@pytest.mark.parametrize("op", sorted(CASES))
def test_auto_compiles_the_kernel_for_a_gpu_and_not_for_the_cpu(op, gpu_target, cuda_lowering):
  (x,) = _inputs(0, SHAPES[op])
  assert TRITON_CALL in _module(CASES[op], "cuda", x)
  assert TRITON_CALL not in _module(CASES[op], "cpu", x)


def test_explicit_pallas_interprets_on_the_cpu_and_compiles_for_a_gpu(gpu_target, cuda_lowering):
  k, v = _inputs(1, (2, 32, 16), (2, 32, 16))
  w, u = -jnp.exp(k[0, 0]), v[0, 0]
  fn = lambda k, v: ops.wkv4(w, u, k, v, impl="pallas")[0]
  assert TRITON_CALL in _module(fn, "cuda", k, v)
  assert TRITON_CALL not in _module(fn, "cpu", k, v)
  np.testing.assert_allclose(jax.jit(fn)(k, v), ops.wkv4(w, u, k, v, impl="scan")[0], rtol=2e-5, atol=2e-5)


def test_auto_binds_keyword_settings_to_every_platform_branch(gpu_target):
  """neural_memory passes its chunk length as a keyword: where auto dispatches by platform (a GPU host), every
  branch gets it, and the CPU branch here equals the explicit backend."""
  rng = np.random.default_rng(3)
  b, t, h, n = 2, 6, 2, 4
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, n)), jnp.float32) for _ in range(3))
  eta, theta, alpha = (jnp.asarray(rng.uniform(0.1, 0.5, size=(b, t, h)), jnp.float32) for _ in range(3))
  state = initial_state((rng.normal(size=(h, n, n)) / 2,), b)
  run = lambda impl: neural_memory(q, k, v, eta, theta, alpha, state, chunk=3, impl=impl)[0]
  np.testing.assert_array_equal(run("auto"), run("chunked"))


def test_a_process_without_gpu_targets_traces_no_kernel_under_auto():
  """A process that cannot compile for a GPU (no GPU backend, no CUDA/ROCm plugin) resolves auto statically: no
  kernel is traced, so twice-differentiable ops stay twice differentiable (a custom VJP kernel is not). The
  subprocess hides the GPU and the plugins, so the test means the same on a GPU host."""
  code = """
import sys
sys.modules["jax_plugins"] = None  # No CUDA/ROCm PJRT plugin can be found (importing it raises ImportError).
import jax, jax.numpy as jnp, numpy as np
from ltm_jax import ops
from ltm_jax.ops.neural_memory import initial_state, neural_memory
from ltm_pallas import backend
assert jax.default_backend() == "cpu" and not backend.may_compile_for_gpu()
q = jax.random.normal(jax.random.key(2), (1, 16, 2, 8))
second = jax.grad(lambda q: jax.grad(lambda q: ops.attention(q, q, q, causal=True).sum())(q).sum())
assert "pallas_call" not in str(jax.make_jaxpr(second)(q))
assert np.isfinite(np.asarray(jax.jit(second)(q))).all()
print("ok")
"""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_library_and_interpreted_kernels_work_without_the_triton_lowering_module():
  code = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # As if jax had removed it: importing it raises ImportError.
import jax, jax.numpy as jnp, numpy as np
import ltm_jax
from ltm_jax import ops
from ltm_jax.ops.neural_memory import initial_state, neural_memory
k = jax.random.normal(jax.random.key(0), (2, 16, 8))
y = ops.wkv4(-jnp.ones(8), jnp.zeros(8), k, k, impl="pallas")[0]
np.testing.assert_allclose(y, ops.wkv4(-jnp.ones(8), jnp.zeros(8), k, k, impl="scan")[0], rtol=2e-5, atol=2e-5)
print("ok")
"""
  # Interpreting is what a process without a GPU does (on a GPU, a missing Triton lowering is an error): the GPU is
  # hidden, so the test means the same on a GPU host.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
