"""The deviceless H100 compile check (benchmarks/gpu_aot.py, cases in benchmarks/aot_cases.py).

The case list is checked here in the main venv (every case traces against the kernels as they are). The compile
itself runs in .venv-aot, which holds the CUDA plugin and ptxas (the Makefile builds it; `make test` tries to): the
kernel cases of `aot_cases.SUITE_CASES` (every kernel once) and both controls, under a minute on 2 cores. The other
kernel cases (the same kernels at other dtypes, shapes and tile rows) and the model cases (whole train steps and
generation) run in `make gpu-aot` only, to keep the suite within its time budget.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import jax
import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("aot_cases", ROOT / "benchmarks" / "aot_cases.py")
aot_cases = importlib.util.module_from_spec(_spec)
sys.modules["aot_cases"] = aot_cases  # Its dataclasses look their module up.
_spec.loader.exec_module(aot_cases)

AOT_VENV = ROOT / ".venv-aot"
AOT_LOG = ROOT / ".venv-aot.log"
IN_SUITE = sorted([*aot_cases.SUITE_CASES, *(n for n, c in aot_cases.all_cases().items() if c.group == "controls")])


def _abstract(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("name", [n for n, c in aot_cases.all_cases().items() if c.group != "models"])
def test_case_traces(name):
  """Every kernel and control case builds and traces (abstractly, on any backend) with the kernels it names."""
  case = aot_cases.all_cases()[name]
  fn, args = case.build(_abstract)
  jaxpr = jax.make_jaxpr(fn)(*args)
  names = {str(eqn.params["name"]) for eqn in _pallas_calls(jaxpr.jaxpr)}
  assert set(case.kernels) <= names, (case.kernels, names)


def _pallas_calls(jaxpr):
  """Every pallas_call equation of a jaxpr, nested ones (custom_vjp, cond, loops) included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr holds its Jaxpr.
        if hasattr(sub, "eqns"):
          yield from _pallas_calls(sub)


def _skip_reason() -> str | None:
  if (AOT_VENV / ".installed").exists():
    return None
  if not AOT_LOG.exists():
    return "GPU AOT check skipped: .venv-aot is not built (`make test` or `make gpu-aot` builds it)"
  errors = [l.strip() for l in AOT_LOG.read_text(errors="replace").splitlines() if l.startswith("ERROR")]
  detail = f" ({errors[-1][:200]})" if errors else ""
  return ("GPU AOT check skipped: .venv-aot could not be built, so the CUDA plugin wheels (jax-cuda13-plugin, "
          f"jax-cuda13-pjrt) could not be installed; see .venv-aot.log{detail}")


@pytest.mark.slow
@pytest.mark.optimized_compile  # Registers and spills of the build users get.
def test_kernels_compile_for_h100_without_spills(tmp_path):
  """The in-suite kernel cases compile for an H100 without spilling, and both controls fail as they must."""
  reason = _skip_reason()
  if reason:
    pytest.skip(reason)
  results = tmp_path / "gpu-aot.json"
  proc = subprocess.run([str(AOT_VENV / "bin" / "python"), "benchmarks/gpu_aot.py", "--group", "kernels,controls", "--cases", f"^({'|'.join(IN_SUITE)})$",
                         "--jobs", "2", "--timeout", "600", "--json", str(results)],
                        cwd=ROOT, capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
  report = json.loads(results.read_text())
  assert report["passed"]
  assert sorted(c["case"] for c in report["cases"]) == IN_SUITE
  # The chunked WKV-7 backward walks its chunks in a loop that stages tiles through shared memory between products.
  walks = [k for k in report["kernels"] if k["kernel"] == "wkv7_chunked_backward"]
  assert walks and all(k["loop_barriers"] > 10 for k in walks), walks


PTX = """
.visible .entry outer_and_inner(
  .param .u64 p
)
{
  bar.sync 0;
$L__BB0_1:
  bar.sync 0;
  ld.shared.f32 %f1, [%r1];
$L__BB0_2:
  bar.sync 0;
  @%p1 bra $L__BB0_2;
  bar.sync 0;
  @%p2 bra $L__BB0_1;
  bar.sync 0;
  ret;
}
.visible .entry straight(
  .param .u64 p
)
{
  bar.sync 0;
$L__BB1_1:
  @%p1 bra $L__BB1_2;
  bar.sync 0;
$L__BB1_2:
  ret;
}
"""


def test_loop_barriers_count_the_longest_loop_of_each_entry():
  """The outer loop's three barriers (its inner loop's included; none before or after it); a kernel whose only
  branch goes forward has no loop."""
  spec = importlib.util.spec_from_file_location("gpu_aot", ROOT / "benchmarks" / "gpu_aot.py")
  gpu_aot = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gpu_aot)
  assert gpu_aot.loop_barriers(PTX) == {"outer_and_inner": 3}


def test_the_in_suite_cases_compile_every_kernel():
  """The suite's subset of `make gpu-aot` names every kernel that any kernel case names, and only kernel cases."""
  cases = aot_cases.all_cases()
  assert all(cases[name].group == "kernels" for name in aot_cases.SUITE_CASES)
  every = {k for c in cases.values() if c.group == "kernels" for k in c.kernels}
  assert every == {k for name in aot_cases.SUITE_CASES for k in cases[name].kernels}
