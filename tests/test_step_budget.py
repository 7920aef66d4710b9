"""benchmarks/step_budget.py: the HLO reading on a hand-written module, and a --quick run of the tiny config."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("step_budget", ROOT / "benchmarks" / "step_budget.py")
step_budget = importlib.util.module_from_spec(_spec)
sys.modules["step_budget"] = step_budget  # Its dataclasses look their module up.
_spec.loader.exec_module(step_budget)

# A loop of 3 trips over a cuBLAS gemm, a Pallas WKV kernel and a reduction fusion, then a copy; operands of the
# loop body are printed without shapes (as the CPU backend prints them), the rest with.
HLO = """HloModule m

%fused_reduce (p0: f32[8,16]) -> f32[8] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(f32[8,16]{1,0} %p0, f32[] %c), dimensions={1}, to_apply=%add
}

%body (arg: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %arg = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[16,16]{1,0} constant({...})
  %g = (bf16[8,16]{1,0}, s8[64]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %k = bf16[2,4,2,8]{3,2,1,0} custom-call(bf16[2,4,2,8]{3,2,1,0} %y), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(LM))/wkv7_chunked_backward/pallas_call"}
  %s = f32[8]{0} fusion(%x), kind=kInput, calls=%fused_reduce, metadata={op_name="jit(step)/jvp(LM)/norm" stack_frame_id=2}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %x)
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %wh = (s32[], f32[8,16]{1,0}) while((s32[], f32[8,16]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %cp = f32[8,16]{0,1} copy(f32[8,16]{1,0} %a)
}

FileNames
1 "/somewhere/ltm_jax/layers/norms.py"
2 "/somewhere/site-packages/flax/linen/module.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=2}
2 {file_name_id=2 function_name_id=1 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
"""


def test_reads_kernels_costs_and_sources_from_hlo():
  comps, entry, frames = step_budget.parse_hlo(HLO)
  ceilings = dict(step_budget.DEFAULTS, launch_us=0.0)
  rows, notes = step_budget.kernels(comps, entry, frames, ceilings)
  assert entry == "main" and not notes
  by = {r["name"].split("/")[-1]: r for r in rows}
  assert set(by) == {"g", "k", "s", "cp"}
  assert [by[n]["times"] for n in ("g", "k", "s", "cp")] == [3, 3, 3, 1]
  assert (by["g"]["category"], by["g"]["dot_flops"]) == ("matmul", 2 * 8 * 16 * 16)
  assert by["g"]["bytes"] == 8 * 16 * 4 + 16 * 16 * 2 + 8 * 16 * 2 + 64  # Operands by name, then the outputs.
  assert (by["k"]["category"], by["k"]["detail"], by["k"]["elements"]) == ("WKV kernel", "wkv7_chunked_backward", 128)
  assert (by["s"]["category"], by["s"]["flops"]) == ("reductions/norms", 128)
  assert by["s"]["where"] == "ltm_jax/layers/norms.py:42"  # The innermost frame of this package, not flax's.
  assert by["cp"]["category"] == "copies/transposes"
  assert by["g"]["roofline_ms"] == pytest.approx(3 * by["g"]["bytes"] / 2.18e12 * 1e3)
  assert by["k"]["predicted_ms"] == pytest.approx(3 * 128 * ceilings["wkv_bwd_ns"] * 1e-6)


def test_quick_run_writes_the_budget(tmp_path):
  out = tmp_path / "budget.json"
  assert step_budget.main(["--quick", "--config", str(ROOT / "configs" / "tiny.py"), "--steps", "1", "--no-profile",
                           "--measured-ms", "1", "--out", str(out), "--top", "3"]) == 0
  result = json.loads(out.read_text())
  names = [c["category"] for c in result["categories"]]
  assert "matmul" in names and "optimizer" in names
  assert result["total"]["predicted_ms"] == pytest.approx(sum(c["predicted_ms"] for c in result["categories"]))
  assert result["total"]["gflops"] > 0 and result["measured_step_ms"] > 0
