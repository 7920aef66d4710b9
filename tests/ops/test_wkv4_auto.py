"""`wkv4(impl="auto")` compiled for a GPU: the fused kernels when rows x channels are many, the associative scan when
they are few (one long sequence of a narrow model), where the kernels' per-token latency dominates."""

import importlib

import jax
import jax.numpy as jnp
import pytest

from ltm_jax.ops import backend, wkv4 as wkv4_op
from ltm_pallas import backend as kernel_backend

wkv4_module = importlib.import_module("ltm_jax.ops.wkv4")  # The package; `ltm_jax.ops.wkv4` names the function.


@pytest.mark.parametrize("batch, channels, expected", [(8, 4096, "pallas"), (1, 8192, "pallas"), (2, 3072, "pallas"),
                                                       (1, 2048, "associative"), (4, 1024, "associative")])
def test_gpu_auto_follows_rows_times_channels(monkeypatch, batch, channels, expected):
  """The choice for a GPU process (platform mocked; the backends replaced by recorders, so nothing runs a kernel)."""
  monkeypatch.setattr(backend, "platform", lambda: "gpu")
  monkeypatch.setattr(kernel_backend, "may_compile_for_gpu", lambda: False)
  called = []
  fakes = {name: (lambda name: lambda w, u, k, v, s: (called.append(name) or k.astype(v.dtype), s))(name)
           for name in wkv4_module.AVAILABLE}
  monkeypatch.setattr(wkv4_module, "_BACKENDS", fakes)
  k = jax.random.normal(jax.random.key(batch * channels), (batch, 3, channels))
  w = -jnp.exp(jax.random.normal(jax.random.key(1), (channels,)))
  wkv4_op(w, jnp.zeros((channels,)) + 0.3, k, k)
  assert called == [expected]
  assert (batch * channels >= wkv4_module.GPU_PALLAS_MIN_CHANNELS) == (expected == "pallas")
