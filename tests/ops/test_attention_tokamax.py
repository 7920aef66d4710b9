"""The tokamax attention backend (impl="tokamax", `ltm_jax.ops.attention.tokamax_mgpu`): its support check, where
`auto` takes it, and our masks mapped onto tokamax's arguments against the float64 reference.

tokamax needs jax >= 0.11.1 (Python 3.12), so the mapping and compile checks run in a subprocess
(tests/ops/attention_tokamax_worker.py) under a Python that has it: $LTM_TOKAMAX_PYTHON, else .venv-aot's. Without
one they skip, naming what to install. The mapping runs through tokamax's XLA implementation, which takes the same
arguments as its Mosaic GPU kernels; the kernels themselves cannot run here (jax 0.11.2's Mosaic GPU interpret mode
has no rule for `run_state`, which tokamax's kernels use), so they are only compiled for sm_90a.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_reference import reference_mask
from attention_reference import reference_value_and_grads
from attention_reference import value_and_grads
from attention_tokamax_worker import MAPPING_CASES as _MAPPING_CASES
from attention_tokamax_worker import cache_positions
from conftest import ROOT, cpu_only_env
from ltm_jax.ops.attention import _auto_gpu, attention, tokamax_mgpu
from ltm_pallas import backend as kernel_backend
from ltm_pallas.backend import GpuLowering

WORKER = ROOT / "tests" / "ops" / "attention_tokamax_worker.py"
# float32 through tokamax's XLA implementation against float64, relative to max |expected|: float32 rounding only
# (measured: outputs up to 4.7e-7, gradients up to 8.8e-7); a window one key short moves the output by 0.70.
RTOL = 1e-5
TRITON = GpuLowering("triton", None)


def _tokamax_python() -> str:
  python = os.environ.get("LTM_TOKAMAX_PYTHON", str(ROOT / ".venv-aot" / "bin" / "python"))
  if not os.path.exists(python):
    pytest.skip(f"needs a Python with tokamax: {tokamax_mgpu.INSTALL} into .venv-aot or set LTM_TOKAMAX_PYTHON")
  probe = subprocess.run([python, "-c", "import tokamax"], env=cpu_only_env(), capture_output=True, timeout=120)
  if probe.returncode:
    pytest.skip(f"{python} has no tokamax: {tokamax_mgpu.INSTALL}, or set LTM_TOKAMAX_PYTHON")
  return python


def _run_worker(mode: str, out) -> None:
  proc = subprocess.run([_tokamax_python(), str(WORKER), mode, str(out)], cwd=ROOT, env=cpu_only_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.fixture(scope="module")
def mapping(tmp_path_factory):
  out = tmp_path_factory.mktemp("tokamax") / "mapping.npz"
  _run_worker("mapping", out)
  with np.load(out) as saved:
    return dict(saved)


def _case(mapping, name):
  b, t, s, _, _, d, causal, window, segments = _MAPPING_CASES[name]
  ids, kv_ids = mapping.get(f"{name}/ids"), mapping.get(f"{name}/kv_ids")
  mask = reference_mask(b, t, s, causal=causal, window=window, q_pos=mapping.get(f"{name}/q_pos"),
                        kv_pos=mapping.get(f"{name}/kv_pos"), q_seg=ids, kv_seg=kv_ids)
  ref_out, ref_grads = reference_value_and_grads(mapping[f"{name}/q"], mapping[f"{name}/k"], mapping[f"{name}/v"],
                                                 mask, d**-0.5, mapping[f"{name}/cot"])
  assert mask.any(-1).all(), "every query sees a key (tokamax's XLA form does not give such rows zeros)"
  return ref_out, ref_grads


def _assert_close(actual, expected, what):
  np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=RTOL * np.max(np.abs(expected)), err_msg=what)


def test_the_worker_ran_these_cases(mapping):
  assert {key.split("/")[0] for key in mapping if "/" in key} == set(_MAPPING_CASES)


def test_second_derivative_names_the_backends_that_have_one(mapping):
  error = str(mapping["second_order_error"])
  assert "impl='tokamax'" in error and "impl='xla'" in error


def test_blocked_cases_run_blocked():
  for name, (_, t, s, _, _, _, causal, window, _) in _MAPPING_CASES.items():
    assert tokamax_mgpu.uses_blocks(causal, window, t, s) == name.startswith("blocked"), name


def test_cache_cases_hide_empty_slots(mapping):
  for name in ("cache_window", "cache_causal_segments"):
    assert (mapping[f"{name}/kv_pos"] == np.iinfo(np.int32).max).sum() == 3 * mapping[f"{name}/q"].shape[0]


@pytest.mark.parametrize("name", list(_MAPPING_CASES))
def test_mapping_matches_the_reference(mapping, name):
  ref_out, ref_grads = _case(mapping, name)
  _assert_close(mapping[f"{name}/out"], ref_out, f"{name}: out")
  for label, ref in zip(("dq", "dk", "dv"), ref_grads):
    _assert_close(mapping[f"{name}/{label}"], ref, f"{name}: {label}")


def test_the_tolerance_separates_a_window_one_key_off(mapping):
  """The check above can fail: against the reference for a window one key shorter, the mapped output is out of
  tolerance."""
  name = "window_gqa"
  b, t, s, _, _, d, _, window, _ = _MAPPING_CASES[name]
  mask = reference_mask(b, t, s, causal=True, window=window - 1)
  off, _ = reference_value_and_grads(mapping[f"{name}/q"], mapping[f"{name}/k"], mapping[f"{name}/v"], mask,
                                     d**-0.5, mapping[f"{name}/cot"])
  with pytest.raises(AssertionError):
    _assert_close(mapping[f"{name}/out"], off, "out against a window of W - 1")


def test_kernels_compile_for_sm90a(tmp_path):
  """tokamax's forward and backward Mosaic GPU kernels compile for an H100 at the models' training shapes
  (window and GQA at head dims 64 and 128, segment ids under a window, blocked and whole; 512 queries over a
  2048-key cache by positions): a train step's attention is
  three Mosaic GPU kernels and no Triton one."""
  if not (ROOT / ".venv-aot" / ".installed").exists() and "LTM_TOKAMAX_PYTHON" not in os.environ:
    pytest.skip("needs .venv-aot (the CUDA plugin's deviceless compile; `make gpu-aot` builds it)")
  out = tmp_path / "compile.json"
  _run_worker("compile", out)
  results = json.loads(out.read_text())
  assert results and all(r["ok"] for r in results.values()), results
  for name, result in results.items():
    # The forward, dq and dk/dv kernels, and nothing lowered through Triton.
    kernels = [c for c in result["custom_calls"] if c.startswith("mosaic_gpu")]
    assert len(kernels) == 3, (name, result["custom_calls"])
    assert not any("triton" in c for c in result["custom_calls"]), (name, result["custom_calls"])


def test_local_window_mapping():
  # T == S: keys i - (W - 1) <= j <= i.
  assert tokamax_mgpu.local_window(causal=True, window=8, t=32, s=32) == (7, 0)
  # End-aligned T < S: queries at positions S - T + i; a window shorter than S - T gives a negative `before`.
  assert tokamax_mgpu.local_window(causal=True, window=4, t=8, s=32) == (4 - 1 - 24, 24)
  assert tokamax_mgpu.local_window(causal=True, window=None, t=8, s=32) == (40, 24)
  assert tokamax_mgpu.local_window(causal=False, window=None, t=8, s=32) is None


_SUPPORTED = dict(q_shape=(2, 64, 8, 128), kv_shape=(2, 64, 2, 128), dtype=jnp.bfloat16, causal=True,
                  has_positions=False, missing=None)


@pytest.mark.parametrize("change, fragment", [
    ({}, None),
    ({"dtype": jnp.float16}, None),
    ({"q_shape": (2, 16, 8, 64), "kv_shape": (2, 64, 2, 64)}, None),
    ({"missing": "tokamax is not installed; pip install tokamax"}, "pip install tokamax"),
    ({"dtype": jnp.float32}, "float16 or bfloat16"),
    ({"has_positions": True}, None),  # Positions become a dense mask.
    ({"q_shape": (2, 64, 8, 128), "kv_shape": (2, 16, 2, 128), "has_positions": True}, None),
    ({"q_shape": (2, 1, 8, 128), "kv_shape": (2, 64, 2, 128), "has_positions": True}, "decoding step"),
    ({"q_shape": (2, 64, 8, 96), "kv_shape": (2, 64, 2, 96)}, "head dims"),
    ({"q_shape": (2, 64, 8, 128), "kv_shape": (2, 16, 2, 128)}, "T > S"),
])
def test_unsupported_reason(change, fragment):
  args = {**_SUPPORTED, **change}
  reason = tokamax_mgpu.unsupported_reason(args.pop("q_shape"), args.pop("kv_shape"), args.pop("dtype"), **args)
  assert reason is None if fragment is None else fragment in reason


def test_explicit_tokamax_says_what_to_install_where_it_cannot_run():
  x = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  if tokamax_mgpu.missing_reason() is None:
    pytest.skip("tokamax is installed here")
  with pytest.raises(ValueError, match="impl='tokamax'.*pip install tokamax"):
    attention(x, x, x, impl="tokamax")


@pytest.mark.parametrize("capability, cudnn_ok, pallas_ok, tokamax_ok, expected", [
    ((9, 0), True, True, True, "cudnn"),  # cuDNN serves: it stays.
    ((9, 0), False, True, True, "pallas"),  # cuDNN refuses: the Triton kernels, checked on GPUs, before tokamax.
    ((9, 0), False, False, True, "tokamax"),  # Both refuse (explicit positions): tokamax on Hopper.
    ((10, 0), False, False, True, "tokamax"),
    ((9, 0), False, False, False, "xla"),  # tokamax refuses too (missing, float32).
    ((8, 0), False, False, True, "xla"),  # No Mosaic GPU before sm_90.
    (None, False, False, True, "xla"),  # A deviceless compilation: the target is unknown.
])
def test_auto_takes_tokamax_on_hopper_where_cudnn_and_pallas_refuse(capability, cudnn_ok, pallas_ok, tokamax_ok,
                                                                   expected, monkeypatch):
  # capability None is asked of the default device: make it the CPU of a deviceless compilation on every host.
  monkeypatch.setattr(kernel_backend, "device_capability", lambda: None)
  reason = lambda ok: (lambda: None if ok else "refused")
  reasons = {"cudnn": reason(cudnn_ok), "tokamax": reason(tokamax_ok), "pallas": reason(pallas_ok)}
  assert _auto_gpu("window", 64, reasons, TRITON, capability) == expected


def test_auto_without_triton_takes_tokamax_or_xla():
  reasons = {"cudnn": lambda: "refused", "tokamax": lambda: None, "pallas": lambda: None}
  without = GpuLowering("xla", None)
  assert _auto_gpu("causal", 128, reasons, without, (9, 0)) == "tokamax"
  assert _auto_gpu("causal", 128, {**reasons, "tokamax": lambda: "missing"}, without, (9, 0)) == "xla"


# --- The compiled kernels on a Hopper GPU (`pytest -m gpu`; skips elsewhere). ---

# (B, T, S, Hq, Hkv, D), causal, window, segment ids (two packed sequences per row).
GPU_CASES = {
    "window_gqa_d64": ((2, 256, 256, 8, 2, 64), True, 64, False),
    "causal_gqa_d128": ((2, 256, 256, 8, 2, 128), True, None, False),
    "end_aligned_window": ((1, 128, 384, 4, 1, 64), True, 200, False),
    "segments_window": ((2, 256, 256, 4, 2, 64), True, 96, True),
    "non_causal_cross": ((2, 128, 256, 4, 4, 128), False, None, False),
    "ragged_window": ((1, 200, 200, 4, 2, 64), True, 50, False),
    "blocked_window_gqa": ((1, 1000, 1000, 8, 2, 64), True, 100, False),
    "blocked_segments_window_d128": ((1, 600, 600, 4, 2, 128), True, 130, True),
    "cache_window": ((2, 128, 512, 8, 2, 64), True, 200, False),  # Positions as `cache_positions` makes them.
}
# The custom call of a Pallas kernel lowered through Triton (XLA's own Triton fusions are not custom calls).
PALLAS_TRITON_CALL = "__gpu$xla.gpu.triton"
# bfloat16 kernels against float64 on the same rounded inputs, relative to max |expected|
# (tests/ops/test_gpu_kernels.py's).
BF16_RTOL = 2.0**-5


def _on_hopper_with_tokamax() -> str | None:
  capability = kernel_backend.device_capability()
  if capability is None or capability < kernel_backend.MOSAIC_GPU_SINCE:
    return f"needs an sm_90+ GPU, the default device is {jax.devices()[0].device_kind}"
  return tokamax_mgpu.missing_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_compiled_kernels_match_float64_on_hopper(name):
  reason = _on_hopper_with_tokamax()
  if reason:
    pytest.skip(reason)
  (b, t, s, hq, hkv, d), causal, window, segmented = GPU_CASES[name]
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
             for shape in ((b, t, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
  ids = np.where(np.arange(t)[None] < rng.integers(t // 4, 3 * t // 4, (b, 1)), 0, 1).astype(np.int32)
  segments = jnp.asarray(ids) if segmented else None
  q_pos = kv_pos = None
  if name.startswith("cache"):
    q_pos, kv_pos = cache_positions(rng, b, t, s)
  mask = reference_mask(b, t, s, causal=causal, window=window, q_pos=q_pos, kv_pos=kv_pos,
                        q_seg=ids if segmented else None, kv_seg=ids if segmented else None)
  positions = {} if q_pos is None else dict(q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(kv_pos))
  fn = lambda q, k, v: attention(q, k, v, causal=causal, window=window, segment_ids=segments, impl="tokamax",
                                 **positions)
  compiled = jax.jit(lambda q, k, v, c: jax.vjp(fn, q, k, v)[1](c)).lower(q, k, v, cotangent).compile().as_text()
  assert "mosaic_gpu" in compiled and PALLAS_TRITON_CALL not in compiled
  out, grads = value_and_grads(fn, q, k, v, cotangent)
  ref, ref_grads = reference_value_and_grads(q, k, v, mask, d**-0.5, cotangent)
  for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{name} {what}"
    np.testing.assert_allclose(got, want, rtol=0, atol=BF16_RTOL * np.max(np.abs(want)), err_msg=f"{name} {what}")


@pytest.mark.gpu
def test_auto_takes_tokamax_for_explicit_positions_on_hopper():
  """Explicit positions (a chunk over a key/value cache), which cuDNN and the Pallas kernels refuse: on sm_90+ with
  tokamax, `auto` compiles Mosaic GPU kernels, no Triton."""
  reason = _on_hopper_with_tokamax()
  if reason:
    pytest.skip(reason)
  x = jnp.ones((1, 128, 4, 64), jnp.bfloat16)
  positions = jnp.arange(128, dtype=jnp.int32)[None]
  compiled = jax.jit(lambda x: attention(x, x, x, q_positions=positions, kv_positions=positions)
                     ).lower(x).compile().as_text()
  assert "mosaic_gpu" in compiled and PALLAS_TRITON_CALL not in compiled
