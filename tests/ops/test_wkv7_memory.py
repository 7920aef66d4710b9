"""wkv7(impl="scan") says before it runs when differentiating it would keep more state than the device holds."""

import importlib
import warnings

import jax
import pytest

from ltm_jax.ops import wkv7

wkv7_module = importlib.import_module("ltm_jax.ops.wkv7")  # The package; `ltm_jax.ops.wkv7` names the function.


def _inputs(shape):
  r, k, v, a, b = (jax.random.normal(jax.random.key(i), shape) for i in range(5))
  w = -jax.nn.softplus(jax.random.normal(jax.random.key(5), shape))
  return r, w, k, v, a, b


def test_the_estimate_is_every_tokens_float32_state():
  assert wkv7_module.scan_backward_bytes(8, 4096, 32, 128) == 64 * 2**30
  assert wkv7_module.scan_backward_bytes(2, 3, 5, 7) == 4 * 2 * 3 * 5 * 7 * 7


def test_scan_beyond_the_device_warns_in_one_line(monkeypatch):
  shape = (2, 3, 2, 4)
  needed = wkv7_module.scan_backward_bytes(2, 3, 2, 4)
  monkeypatch.setattr(wkv7_module, "_device_bytes", lambda: needed - 1)
  with pytest.warns(UserWarning, match=r"impl='scan' at \(B, T, H, N\) = \(2, 3, 2, 4\).*impl='pallas_chunked'") as got:
    wkv7(*_inputs(shape), impl="scan")
  assert "\n" not in str(got[0].message)


@pytest.mark.parametrize("impl, limit_offset", [("scan", 0), ("chunked", -1)])
def test_no_warning_within_the_device_or_for_other_backends(monkeypatch, impl, limit_offset):
  shape = (2, 3, 2, 4)
  monkeypatch.setattr(wkv7_module, "_device_bytes", lambda: wkv7_module.scan_backward_bytes(*shape) + limit_offset)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    wkv7(*_inputs(shape), impl=impl)


def test_the_cpu_reports_no_memory_limit_so_nothing_is_checked_there():
  assert jax.devices()[0].platform != "cpu" or wkv7_module._device_bytes() is None
