"""The Mosaic GPU WKV-7 kernels (`ltm_pallas.wkv7_mgpu`, impl="pallas_mgpu"), forward, backward and the state-only
kernels, and the op through segments, against the float64 reference and its gradients.

Platform: the kernels run in Mosaic GPU interpret mode on the CPU, which needs jax >= 0.11 (Python 3.12): the AOT
venv's (.venv-aot, built by `make test`/`make gpu-aot`). tests/ops/wkv7_mgpu_worker.py runs them there in a
subprocess and saves inputs, outputs and gradients; the references are computed here, in float64 (the whole file
about 60 s on 2 cores). Without .venv-aot the tests skip. On a Hopper GPU, `.venv-aot/bin/python tests/ops/wkv7_mgpu_worker.py
--compiled OUT.npz` runs the cases compiled, and WKV7_MGPU_RESULTS=OUT.npz has these tests check that file instead.
Without such a file, compiled runs are not covered here; the deviceless sm_90a compile is (`benchmarks/gpu_aot.py
--mgpu`: registers, spills and shared memory, see COMPILED_CASES).
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, aot_worker_output, cpu_only_env
from wkv7_reference import wkv7_reference

AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
WORKER = ROOT / "tests" / "ops" / "wkv7_mgpu_worker.py"
# Relative to max |expected| of each array. Every product takes bfloat16 operands (the decayed keys, the state, U, the
# pair matrices and the powers of the [64, 64] inverse), float32 inputs included, with float32 accumulation; bfloat16
# outputs add one rounding. Measured: y 3.9e-3 to 5.0e-3, final state 2.3e-3 to 3.6e-3 over these cases; this is
# the chunked Triton kernels' bfloat16 tolerance (tests/ops/test_wkv7_chunked_pallas.py).
RTOL = 2.0**-6
# Gradients through the op (the forward kernel with chunk states, then the backward kernel): the same bfloat16
# operands, the chunk states stored in bfloat16 (the forward's operand itself), dU and dX rounded to bfloat16 before
# their products, bfloat16 gradients for bfloat16 inputs. Measured over OP_GRAD_CASES and FORM_CASES: 1.8e-3 (the
# state's gradient) to 8.0e-3 (bfloat16 da), the forward's tolerance holds with 1.9x to spare.
GRAD_RTOL = RTOL
OP_GRAD_CASES = ("op_grad_f32", "op_grad_bf16", "op_grad_bf16_n128")
# The kernels called directly in the form that loads each chunk before its products (the default at N = 128) at
# N = 64, where the default overlaps the loads with the previous chunk's products (the cases above at N = 64); and
# with the kernels' own barriers only (`explicit_barriers`: in interpret mode the same program, compiled on a GPU the
# check that no barrier is missing).
FORM_CASES = ("grad_bf16_serial", "grad_bf16_xbar")
# The strong-decay case runs the float32 "chunked" backend both ways: float32 error only (measured 2.3e-7 to 3.8e-7).
F32_RTOL = 1e-5
KERNEL_CASES = ("kernel_f32_ragged", "kernel_bf16", "kernel_f32_n128", "kernel_bf16_n128")
# The state-only kernels (`end_states` with and without values, `state_gradients`): the forward's and backward's
# operands and products, so the forward's tolerance.
STATE_CASES = ("states_f32_ragged", "states_bf16_n128")
# The op through two segments (`wkv7_segmented` with the Mosaic GPU kernels): the state-only kernels, the scans in
# float32, then the forward and backward kernels from each segment's entering state; the op's tolerances.
SEGMENTED_CASES = ("op_grad_segmented_bf16",)
# The compiled cases of benchmarks/gpu_aot.py --mgpu checked here: the forward with the most shared memory in each form
# (N = 128 float32 y; N = 64 float32 y with the loads overlapped), the backward at N = 128 (the most shared memory)
# and with the loads overlapped at N = 64 float32 (the most registers), and the end-state kernel at N = 128 (the
# state-only kernels' most shared memory and registers).
COMPILED_CASES = ("wkv7_mgpu_n128_f32", "wkv7_mgpu_pipe_n64_f32", "wkv7_mgpu_bwd_n128_bf16",
                  "wkv7_mgpu_pipe_bwd_n64_f32", "wkv7_mgpu_end_n128_bf16")
# The forms with the kernels' own barriers only (`explicit_barriers`), beside their twins above.
EXPLICIT_BARRIER_CASES = {"wkv7_mgpu_xbar_pipe_n64_f32": "wkv7_mgpu_pipe_n64_f32",
                          "wkv7_mgpu_xbar_pipe_bwd_n64_f32": "wkv7_mgpu_pipe_bwd_n64_f32"}
SMEM_PER_BLOCK = 232448  # Hopper's opt-in shared memory per block, 227 KiB.


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  if given := os.environ.get("WKV7_MGPU_RESULTS"):  # The worker's output from elsewhere (--compiled on a GPU).
    with np.load(given) as saved:
      return dict(saved)
  return aot_worker_output(tmp_path_factory, WORKER, "wkv7_mgpu-results")


def _case(results, name):
  inputs = [results[f"{name}/in{i}"] for i in range(7)]
  return inputs, results[f"{name}/y"], results[f"{name}/state"]


def _reference(inputs):
  with jax.enable_x64(True):
    y, state = jax.jit(wkv7_reference)(*(jnp.asarray(x, jnp.float64) for x in inputs))
    return np.asarray(y), np.asarray(state)


def _assert_close(actual, expected, rtol, what):
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_the_reference(results, name):
  inputs, y, state = _case(results, name)
  y_ref, state_ref = _reference(inputs)
  assert y.shape == y_ref.shape and state.shape == state_ref.shape
  assert str(results[f"{name}/y_dtype"]) == ("bfloat16" if "bf16" in name else "float32")
  _assert_close(y, y_ref, RTOL, f"{name}: y")
  _assert_close(state, state_ref, RTOL, f"{name}: final state")


def test_the_tolerance_separates_the_kernel_from_a_wrong_result(results):
  """The check above can fail: against the reference for r scaled by 1.05 (y is linear in r: 5% off everywhere), the
  kernel's y is out of tolerance."""
  inputs, y, _ = _case(results, "kernel_f32_ragged")
  inputs[0] = inputs[0] * 1.05
  y_off, _ = _reference(inputs)
  with pytest.raises(AssertionError):
    _assert_close(y, y_off, RTOL, "y against a perturbed reference")


def _reference_gradients(inputs, cot):
  """The float64 reference's gradients of sum(cot[0] · y) + sum(cot[1] · final state) in all seven inputs."""
  def loss(*x):
    y, s = wkv7_reference(*x)
    return jnp.sum(jnp.asarray(cot[0], jnp.float64) * y) + jnp.sum(jnp.asarray(cot[1], jnp.float64) * s)

  with jax.enable_x64(True):
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*(jnp.asarray(x, jnp.float64) for x in inputs))
  return [np.asarray(g) for g in grads]


def _check_op(results, name, rtol, grad_rtol):
  inputs, y, state = _case(results, name)
  y_ref, state_ref = _reference(inputs)
  _assert_close(y, y_ref, rtol, f"{name}: y")
  _assert_close(state, state_ref, rtol, f"{name}: final state")
  grads_ref = _reference_gradients(inputs, [results[f"{name}/cot{i}"] for i in range(2)])
  dtype = str(results[f"{name}/y_dtype"])
  for i, label in enumerate(("r", "w", "k", "v", "a", "b", "state")):
    grad = results[f"{name}/grad{i}"]
    assert grad.shape == grads_ref[i].shape, label
    assert str(results[f"{name}/grad_dtype{i}"]) == ("float32" if label == "state" else dtype), label
    _assert_close(grad, grads_ref[i], grad_rtol, f"{name}: gradient of {label}")


@pytest.mark.parametrize("name", OP_GRAD_CASES)
def test_op_values_and_gradients(results, name):
  """impl="pallas_mgpu" through ops.wkv7: y and the state by the forward kernel (writing the chunk states), the
  gradients of r, w, k, v, a, b and the entering state by the backward kernel."""
  _check_op(results, name, RTOL, GRAD_RTOL)


@pytest.mark.parametrize("name", STATE_CASES)
def test_state_kernels_match_the_reference(results, name):
  """`end_states` from a random state, the transition (from the identity without values: S_end = S_start A) and
  `state_gradients` (the gradient of the entering state given dy and the leaving state's gradient)."""
  inputs, _, end = _case(results, name)
  _, end_ref = _reference(inputs)
  _assert_close(end, end_ref, RTOL, f"{name}: end state")
  identity = np.broadcast_to(np.eye(inputs[6].shape[-1]), inputs[6].shape)
  _, transition_ref = _reference(inputs[:3] + [np.zeros_like(inputs[3])] + inputs[4:6] + [identity])
  _assert_close(results[f"{name}/transition"], transition_ref, RTOL, f"{name}: transition")
  state_grad_ref = _reference_gradients(inputs, [results[f"{name}/cot{i}"] for i in range(2)])[6]
  _assert_close(results[f"{name}/state_grad"], state_grad_ref, RTOL, f"{name}: state gradient")


@pytest.mark.parametrize("name", SEGMENTED_CASES)
def test_segmented_op_values_and_gradients(results, name):
  """impl="pallas_mgpu" through ops.wkv7 where the segment rule gives S = 2 (MIN_SEGMENT lowered to 128 at T = 256):
  y, the state and the seven gradients through the segmented path."""
  assert int(results[f"{name}/segments"]) == 2
  _check_op(results, name, RTOL, GRAD_RTOL)


def test_segmented_op_keeps_little_for_its_backward(results):
  """Differentiated, the segmented op keeps its inputs, the kernels' chunk and segment states and the forward's
  decayed operands and cumulative log-decays (`wkv7_mgpu.Residuals`: 12 bytes a token and channel, as many as the
  six bfloat16 inputs), 2.2x the inputs' bytes here; not the XLA fallback's per-chunk intermediates: a lax.cond
  keeps both branches' residuals, the branch taken writing zeros for the other's (48x the inputs here when the
  fallback is not rematerialised)."""
  name = SEGMENTED_CASES[0]
  kept, inputs = int(results[f"{name}/residual_bytes"]), int(results[f"{name}/input_bytes"])
  assert 2 * inputs < kept < 3 * inputs, (kept, inputs)


@pytest.mark.parametrize("name", FORM_CASES)
def test_other_forms_values_and_gradients(results, name):
  """`forward(..., checkpoints=True)` then `backward` in the form the case names (loads before products; own barriers
  only): y, the state and the seven gradients, as through the op."""
  _check_op(results, name, RTOL, GRAD_RTOL)


@pytest.mark.parametrize("name", FORM_CASES)
def test_the_forward_hands_the_backward_its_log_decays_and_decayed_operands(results, name):
  """The forward's residuals against float64: g, each chunk's running sum of w (the kernel's product of w's three
  bfloat16 parts with the ones below the diagonal), within 4 float32 ulps of max |g| (measured in interpret mode:
  0.2; w's high part alone misses by ~2^-9 |g|), and R̂ = r e^g, Ǩ = k e^-g, Â = a e^(g - w), B̌ = b e^-g each within a bfloat16
  rounding of its own value (2^-8 relative: the operand's and the product's roundings)."""
  r, w, k, _, a, b, _ = (np.asarray(x, np.float64) for x in _case(results, name)[0])
  g = results[f"{name}/residual_g"]
  padded, chunk = g.shape[1], 64
  pad = lambda x: np.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
  r, w, k, a, b = (pad(x) for x in (r, w, k, a, b))
  g_ref = np.cumsum(w.reshape(w.shape[0], -1, chunk, *w.shape[2:]), axis=2).reshape(w.shape)
  np.testing.assert_allclose(g, g_ref, rtol=0, atol=4 * 2.0**-23 * np.max(np.abs(g_ref)), err_msg=f"{name}: g")
  expected = {"r_hat": r * np.exp(g_ref), "k_check": k * np.exp(-g_ref), "a_hat": a * np.exp(g_ref - w),
              "b_check": b * np.exp(-g_ref)}
  for field, value in expected.items():
    np.testing.assert_allclose(results[f"{name}/residual_{field}"], value, rtol=2.0**-8, atol=0,
                               err_msg=f"{name}: {field}")


def test_the_gradient_tolerance_separates_the_kernel_from_a_wrong_result(results):
  """The gradient check can fail: the backward's w gradient against the reference's for the y cotangent scaled by
  1.05 (every gradient but the state's own share is linear in it) is out of tolerance."""
  name = "op_grad_bf16_n128"
  inputs, _, _ = _case(results, name)
  cot = [results[f"{name}/cot0"] * 1.05, results[f"{name}/cot1"]]
  with pytest.raises(AssertionError):
    _assert_close(results[f"{name}/grad1"], _reference_gradients(inputs, cot)[1], GRAD_RTOL, "dw, perturbed")


def test_a_bound_within_the_range_leaves_out_the_check(results):
  """op_grad_bf16 ran with the op's w_min at the kernels' limit (its values and gradients are checked above): it
  reads no minimum of w, nor does the segmented op given the bound; the op without one checks w."""
  assert int(results["op_grad_bf16/range_checks"]) == 0
  assert int(results["op_grad_segmented_bf16/bounded_range_checks"]) == 0
  assert int(results["op_grad_f32/range_checks"]) > 0 and int(results["op_grad_segmented_bf16/range_checks"]) > 0


def test_op_beyond_the_kernels_decay_range_runs_chunked(results):
  """With w = -2 in one channel the op runs "chunked" forward and backward: float32 error."""
  inputs, _, _ = _case(results, "op_strong_decay_f32")
  assert inputs[1].min() == -2.0
  _check_op(results, "op_strong_decay_f32", F32_RTOL, F32_RTOL)


def test_op_refuses_other_head_sizes():
  x = jnp.ones((1, 8, 1, 32), jnp.float32)
  from ltm_jax.ops.wkv7 import wkv7  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="pallas_mgpu.*64, 128"):
    wkv7(x, -x, x, x, x, x, impl="pallas_mgpu")


@pytest.mark.long
@pytest.mark.optimized_compile  # Registers and spills of the build users get.
def test_compiles_for_h100_without_spills(tmp_path):
  """The kernels compile for sm_90a (deviceless, about 60-90 s for the seven cases on 2 cores, so `make test-long`)
  with no register spills and within Hopper's shared memory; with the kernels' own barriers only, a chunk waits at
  fewer than half the barriers of the default form (Pallas' barrier around every shared-memory store left out)."""
  if not (ROOT / ".venv-aot" / ".installed").exists():
    pytest.skip("needs .venv-aot (the CUDA plugin and ptxas; `make gpu-aot` builds it)")
  report_path = tmp_path / "mgpu.json"
  cases = f"^({'|'.join(COMPILED_CASES + tuple(EXPLICIT_BARRIER_CASES))})$"
  proc = subprocess.run([str(AOT_PYTHON), "benchmarks/gpu_aot.py", "--mgpu", "--cases", cases, "--jobs", "2", "--json",
                         str(report_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  rows = json.loads(report_path.read_text())["kernels"]
  assert sorted(r["case"] for r in rows) == sorted(COMPILED_CASES + tuple(EXPLICIT_BARRIER_CASES))
  for row in rows:
    assert row["spills"] == 0 and row["stack"] == 0, row
    assert 0 < row["registers"] <= 255 and 0 < row["smem"] <= SMEM_PER_BLOCK, row
  barriers = {r["case"]: r["loop_barriers"] for r in rows}
  for explicit, default in EXPLICIT_BARRIER_CASES.items():
    assert 0 < 2 * barriers[explicit] < barriers[default], barriers


# Compiles the op's gradient for an H100 without one (the CUDA plugin, sm_90a) with the kernels compiled
# (interpret=False, what a Hopper host's default gives) and prints the custom calls of the optimised program.
_OP_COMPILE = """
import collections, json, re, sys
sys.path[:0] = ["benchmarks", "."]
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec
import gpu_aot
from ltm_jax.ops.wkv7 import pallas_mgpu
topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_aot.H100_TARGET_CONFIG, topology="1x1x1")
mesh = topologies.make_mesh(topology, (1,), ("x",))
placed = NamedSharding(mesh, PartitionSpec())
for shape in ((2, 256, 2, 64), (1, 32768, 64, 64)):
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed) for _ in range(6)]
  args.append(jax.ShapeDtypeStruct((shape[0], shape[2], shape[3], shape[3]), jnp.float32, sharding=placed))
  loss = lambda *x: jnp.sum(pallas_mgpu.wkv7(*x, interpret=False)[0].astype(jnp.float32))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    text = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*args).lower().compile().as_text()
  print(json.dumps(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))))
"""


@pytest.mark.long
def test_the_op_gradient_compiles_to_mosaic_gpu_kernels_for_h100():
  """The op's forward and gradient as a Hopper host runs them (kernels compiled, not interpreted), compiled for
  sm_90a without a GPU (40 s on 2 cores, so `make test-long`): 2 Mosaic GPU kernels at (2, 256, 2, 64) (forward with chunk states, backward), 5 at
  (1, 32768, 64, 64), where the op runs 8 segments (end states and transitions, state gradients, forward, backward),
  and no host callback (the interpreter's) in either program."""
  if not (ROOT / ".venv-aot" / ".installed").exists():
    pytest.skip("needs .venv-aot (the CUDA plugin; `make gpu-aot` builds it)")
  proc = subprocess.run([str(AOT_PYTHON), "-c", _OP_COMPILE], cwd=ROOT, env=cpu_only_env(), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  assert len(lines) == 2, proc.stdout
  for line, kernels in zip(lines, (2, 5)):
    calls = json.loads(line)
    assert calls.get("mosaic_gpu_v2") == kernels, line
    assert not any("callback" in target for target in calls), line
