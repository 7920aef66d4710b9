"""The Mosaic GPU matmul with a fused epilogue (`ltm_pallas.matmul_mgpu`) against float64 references: relu^2 and SwiGLU
feed-forward epilogues, forward and backward.

Platform: the kernel runs in Mosaic GPU interpret mode on the CPU, which needs jax >= 0.11 (Python 3.12): the AOT
venv's (.venv-aot). tests/ops/matmul_mgpu_worker.py runs the cases there in one subprocess (about 13 s: each case in
both of the kernel's forms, "pipelined" and "warp_specialized") and saves inputs and outputs; the references are
computed here in float64 from the same (bfloat16) inputs. Without .venv-aot the tests skip. On a Hopper GPU,
`.venv-aot/bin/python tests/ops/matmul_mgpu_worker.py --compiled OUT.npz` runs the cases compiled, and
MATMUL_MGPU_RESULTS=OUT.npz has these tests check that file instead.
"""

from __future__ import annotations

import os
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, aot_worker_output, cpu_only_env
from ffn_reference import reference as ffn_reference

AOT_PYTHON = ROOT / ".venv-aot" / "bin" / "python"
WORKER = ROOT / "tests" / "ops" / "matmul_mgpu_worker.py"
# Relative to max |expected| of each output. The products accumulate bfloat16 inputs exactly in float32; the error is
# the outputs' bfloat16 rounding (2^-9 relative) and, where the epilogue works from bfloat16-rounded pre-activations,
# that rounding carried through relu^2 or silu. Measured (both forms, bit-equal): 7.3e-6 (the rounded gate/up
# themselves) to 2.2e-3 (silu(g) u) for the bfloat16 outputs, 9.3e-8 for the float32 relu^2 backward; against gate
# and up swapped, 0.95 and 1.05.
RTOL = 2.0**-7
F32_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  if given := os.environ.get("MATMUL_MGPU_RESULTS"):  # The worker's output from elsewhere (--compiled on a GPU).
    with np.load(given) as saved:
      return dict(saved)
  return aot_worker_output(tmp_path_factory, WORKER, "matmul_mgpu-results")


def _bf16(x):
  """x rounded to bfloat16 (round to nearest even), in float64."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
  return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _inputs(results, name, count):
  return [results[f"{name}/in{i}"].astype(np.float64) for i in range(count)]


def _products(a, b):
  """a @ b[:, g, :] for each group g, [M, G, N] in float64."""
  return np.einsum("mk,kgn->mgn", a, b)


def relu2_forward_reference(results, name="relu2_forward"):
  a, b = _inputs(results, name, 2)
  z = _bf16(_products(a, b))
  return [z, np.maximum(z, 0.0) ** 2]


def relu2_backward_reference(results, name="relu2_backward"):
  a, b, pre = _inputs(results, name, 3)
  return [_products(a, b) * 2.0 * np.maximum(pre, 0.0)]


def swiglu_forward_reference(results, name="swiglu_forward", swap=False):
  a, b = _inputs(results, name, 2)
  gate_up = _bf16(_products(a, b))
  g, u = gate_up[:, :1], gate_up[:, 1:]
  if swap:
    g, u = u, g
  return [gate_up, _silu(g) * u]


def swiglu_backward_reference(results, name="swiglu_backward", swap=False):
  a, b, gate_up = _inputs(results, name, 3)
  dh = _products(a, b)
  g, u = gate_up[:, :1], gate_up[:, 1:]
  if swap:
    g, u = u, g
  sig = 1.0 / (1.0 + np.exp(-g))
  return [np.concatenate([dh * u * sig * (1.0 + g * (1.0 - sig)), dh * _silu(g)], axis=1)]


REFERENCES = {
    "relu2_forward": (relu2_forward_reference, (RTOL, RTOL)),
    "relu2_backward": (relu2_backward_reference, (F32_RTOL,)),
    "swiglu_forward": (swiglu_forward_reference, (RTOL, RTOL)),
    "swiglu_backward": (swiglu_backward_reference, (RTOL,)),
}


def _assert_close(actual, expected, rtol, what):
  assert actual.shape == expected.shape, what
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


# The kernel's forms and the suffixes of their cases' names in the worker's results.
FORMS = {"pipelined": "", "warp_specialized": "_ws"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", REFERENCES)
def test_matches_the_float64_reference(results, case, form):
  reference, rtols = REFERENCES[case]
  name = case + FORMS[form]
  expected = reference(results, name)
  assert len(expected) == len(rtols) and f"{name}/out{len(expected)}" not in results
  for i, (want, rtol) in enumerate(zip(expected, rtols)):
    assert np.max(np.abs(want)) > 1.0, f"{name}: output {i} is nearly zero"
    _assert_close(results[f"{name}/out{i}"], want, rtol, f"{name}: output {i}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ["swiglu_forward", "swiglu_backward"])
def test_the_tolerance_catches_swapped_gate_and_up(results, case, form):
  """The check above can fail: against the reference with gate and up swapped in the epilogue, the kernel's SwiGLU
  output is out of tolerance."""
  reference, rtols = REFERENCES[case]
  name = case + FORMS[form]
  wrong = reference(results, name, swap=True)[-1]
  with pytest.raises(AssertionError):
    _assert_close(results[f"{name}/out{len(rtols) - 1}"], wrong, rtols[-1], f"{name}: against swapped gate and up")


# The op's outputs and gradients: bfloat16 roundings of z, h, y, dz and the gradients (the xla backend's tolerance in
# tests/ops/test_ffn_op.py). Measured 3.3e-3 to 6.0e-3 (the xla backend: 3.5e-3 to 6.9e-3).
OP_RTOL = 2.0**-6


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case, activation", [("op_relu2", "relu2"), ("op_swiglu", "swiglu")])
def test_the_op_through_the_kernels_matches_the_float64_reference(results, case, activation, form):
  """ltm_jax.ops.ffn's pallas_mgpu backend: y and the gradients of x, W_in and W_out."""
  name = case + FORMS[form]
  inputs = [results[f"{name}/in{i}"].astype(np.float64) for i in range(4)]
  for i, (label, want) in enumerate(zip(("y", "dx", "dW_in", "dW_out"), ffn_reference(*inputs, activation))):
    assert np.max(np.abs(want)) > 1.0, f"{name}: {label} is nearly zero"
    _assert_close(results[f"{name}/out{i}"], want, OP_RTOL, f"{name}: {label}")


def test_the_two_forms_agree(results):
  """The warp-specialised form splits each tile's rows between two warpgroups but multiplies and rounds as the
  pipelined form does: compiled on a GPU, every kernel and op output is bit-identical. In interpret mode each
  warpgroup's product is a CPU dot of its own row count, which some CPUs sum in an order that depends on it: there an
  element of z may differ by one bfloat16 rounding and the activations made from it by a few (within 2^-5 of the
  element, or 1e-6 near zero; outputs are O(1); a wrong row split would differ by O(1))."""
  names = [k for k in results if "/out" in k and "_ws/" not in k and not k.startswith("model/")]
  assert len(names) >= 12
  compiled = str(results["device"]) != "cpu"
  for name in names:
    case, out = name.split("/")
    split, whole = results[f"{case}_ws/{out}"], results[name]
    if compiled:
      np.testing.assert_array_equal(split, whole, err_msg=name)
    else:
      np.testing.assert_allclose(split, whole, rtol=2.0**-5, atol=1e-6, err_msg=name)


@pytest.mark.long
def test_a_model_with_the_fused_ffn_is_as_close_to_float32_as_the_xla_form(tmp_path_factory):
  """(The worker's --model run: three compilations of the model and the kernels interpreted, about 25 s, so `make
  test-long`.) A two-block model (RWKV-7 + relu^2 channel mix, attention + SwiGLU; bfloat16 compute and residual stream, as
  configs/small_rwkv7.py) with model.ffn_impl=pallas_mgpu: its loss and every parameter's gradient are no further
  from the float32 model's than the bfloat16 model's with the XLA form (relative L2 per parameter; measured ratios
  0.38 to 1.17, below 1 where jax 0.11's CPU einsum accumulates the XLA form's bfloat16 products in bfloat16; the
  fused run's gaps 0.4% to 4.3%). A wrong epilogue (gate and up swapped, relu^2's factor 2 lost) moves
  the FFN's gradients by O(1)."""
  results = aot_worker_output(tmp_path_factory, WORKER, "matmul_mgpu-model", "--model")
  loss = {run: float(results[f"model/loss_{run}"]) for run in ("xla", "pallas_mgpu", "float32")}
  assert abs(loss["pallas_mgpu"] - loss["float32"]) <= 1e-3 * abs(loss["float32"]), loss
  assert loss["pallas_mgpu"] != loss["xla"], "the fused run fell back to the XLA form"
  names = [k.removeprefix("model/grad_float32/") for k in results if k.startswith("model/grad_float32/")]
  assert len(names) > 30 and any("ffn" in name and "gate" in name for name in names)
  for name in names:
    exact = results[f"model/grad_float32/{name}"]
    assert np.linalg.norm(exact) > 0, name
    gap = {run: np.linalg.norm(results[f"model/grad_{run}/{name}"] - exact) / np.linalg.norm(exact)
           for run in ("xla", "pallas_mgpu")}
    assert gap["pallas_mgpu"] <= 1.5 * gap["xla"] + 1e-3, (name, gap)


# The models' feed-forward shapes: M tokens, K and N widths.
MODEL_M, MODEL_WIDTHS = (32768, 131072), (512, 768, 2048, 3072, 3584)


def test_the_default_tiles_take_the_models_shapes_and_refuse_others():
  from ltm_pallas import matmul_mgpu  # pylint: disable=g-import-not-at-top
  for form in FORMS:
    for m in MODEL_M:
      for k in MODEL_WIDTHS:
        for n in MODEL_WIDTHS:
          assert matmul_mgpu.supported(m, k, n, 1, form) and matmul_mgpu.supported(m, k, n, 2, form), (m, k, n, form)
  assert not matmul_mgpu.supported(128, 512, 512, 1, "unknown")
  assert not matmul_mgpu.supported(100, 512, 512, 1)
  assert not matmul_mgpu.supported(128, 96, 512, 1)
  assert not matmul_mgpu.supported(128, 64, 512, 1)  # One K step: the pipeline keeps a step's wgmmas in flight.
  assert not matmul_mgpu.supported(128, 512, 192, 1) and matmul_mgpu.supported(128, 512, 192, 2)
  assert not matmul_mgpu.supported(128, 512, 512, 3)
  a = jnp.zeros((128, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="K 96"):
    matmul_mgpu.matmul_epilogue(a, jnp.zeros((96, 1, 128), jnp.bfloat16), epilogue=lambda accs: (accs,),
                                out_dtypes=(("float32", 1),))
  with pytest.raises(ValueError, match="form"):
    matmul_mgpu.matmul_epilogue(a[:, :64], jnp.zeros((64, 1, 128), jnp.bfloat16), epilogue=lambda accs: (accs,),
                                out_dtypes=(("float32", 1),), form="unknown")
  with pytest.raises(ValueError, match="bfloat16"):
    matmul_mgpu.matmul_epilogue(jnp.zeros((128, 64)), jnp.zeros((64, 1, 128)), epilogue=lambda accs: (accs,),
                                out_dtypes=(("float32", 1),))


# Compiles one kernel of ltm_jax.ops.ffn's pallas_mgpu backend for an H100 without one (the CUDA plugin, sm_90a), as
# a Hopper host runs it (interpret=False): argv the kernel's form, activation, "forward" or "backward", M, d, n. With
# MOSAIC_GPU_DUMP_TO and MOSAIC_GPU_DUMP_PTXAS=1 set, ptxas' report lands in the dump directory.
_KERNEL_COMPILE = """
import sys
sys.path[:0] = ["benchmarks", "."]
import jax.numpy as jnp
import gpu_aot
from ltm_jax.ops import ffn
from ltm_pallas import matmul_mgpu
form, activation, which, m, d, n = *sys.argv[1:4], *map(int, sys.argv[4:])
groups = ffn.ACTIVATIONS[activation]
mesh = gpu_aot._h100_mesh()
abstract = gpu_aot._abstract_on(mesh)
bf16 = jnp.bfloat16
if which == "forward":
  args = (abstract((m, d), bf16), abstract((d, groups, n), bf16))
  fn = lambda x, w: matmul_mgpu.matmul_epilogue(x, w, epilogue=ffn.forward_epilogue(activation, bf16),
                                                out_dtypes=((bf16, groups), (bf16, 1)), interpret=False,
                                                form=form)
else:
  args = (abstract((m, d), bf16), abstract((d, 1, n), bf16), abstract((m, groups, n), bf16))
  fn = lambda dy, w, z: matmul_mgpu.matmul_epilogue(dy, w, (z,), epilogue=ffn.backward_epilogue(activation),
                                                    out_dtypes=((bf16, groups),), interpret=False, form=form)
result = {}
gpu_aot._compile(mesh, fn, args, result)
print(result["stage"])
"""
# (activation, M, d_model, hidden): small_rwkv7's channel mix (32 x 1024 tokens), base_125m's SwiGLU (64 x 2048).
COMPILED_SHAPES = (("relu2", 32768, 512, 2048), ("swiglu", 131072, 768, 3584))


@pytest.mark.long
@pytest.mark.optimized_compile  # Registers and spills of the build users get.
@pytest.mark.parametrize("which", ["forward", "backward"])
@pytest.mark.parametrize("activation, m, d, n", COMPILED_SHAPES)
@pytest.mark.parametrize("form", ["pipelined", "warp_specialized"])
def test_the_ops_kernels_compile_for_h100_without_spills(tmp_path, form, activation, m, d, n, which):
  """The op's kernels with its epilogues at the models' shapes compile for sm_90a without a GPU (a few seconds each,
  several processes: `make test-long`): no register spills or stack, at most 255 registers, within Hopper's shared
  memory per block. Measured, "pipelined" (128 threads): relu2 154 (forward) and 176 registers, SwiGLU 254 (forward)
  and 210; dynamic shared memory 163,880 to 196,648 B. "warp_specialized" (384 threads): 168 registers each (the
  launch's ceiling, 65,536 / 384 rounded down to 8; the consumers raise theirs to 232 and the producer lowers its to
  40 by setmaxnreg), 163,920 to 196,688 B."""
  if not (ROOT / ".venv-aot" / ".installed").exists():
    pytest.skip("needs .venv-aot (the CUDA plugin and ptxas; `make gpu-aot` builds it)")
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import gpu_aot  # pylint: disable=g-import-not-at-top
  env = cpu_only_env(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", MOSAIC_GPU_DUMP_TO=str(tmp_path), MOSAIC_GPU_DUMP_PTXAS="1")
  proc = subprocess.run([str(AOT_PYTHON), "-c", _KERNEL_COMPILE, form, activation, which, str(m), str(d), str(n)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr[-3000:]
  facts = gpu_aot._mgpu_facts(str(tmp_path))  # pylint: disable=protected-access
  assert facts.get("spill_stores") == 0 and facts.get("spill_loads") == 0 and facts.get("stack") == 0, facts
  assert 0 < facts["registers"] <= 255 and 0 < facts["dyn_smem"] <= 232448, facts
