"""benchmarks/step_budget.py: the HLO reading on a hand-written module, and a --quick run of the tiny config, profiled
(benchmarks/kernel_profile.py: the host trace stands in for a GPU's, a dry run of the plumbing)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from conftest import ROOT

_spec = importlib.util.spec_from_file_location("step_budget", ROOT / "benchmarks" / "step_budget.py")
step_budget = importlib.util.module_from_spec(_spec)
sys.modules["step_budget"] = step_budget  # Its dataclasses look their module up.
_spec.loader.exec_module(step_budget)

# A loop of 3 trips over a cuBLAS gemm, a Pallas WKV kernel, the Mosaic GPU fused-epilogue matmul (a [8, 16] @ b [16,
# 2 x 16]) and a reduction fusion, then a copy; operands of the
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
  %m = (bf16[8,32]{1,0}, bf16[8,16]{1,0}) custom-call(bf16[8,16]{1,0} %y, bf16[16,32]{1,0} %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/jvp(LM)/ffn/matmul_epilogue/anonymous/mpmd_map"}
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
  assert set(by) == {"g", "k", "m", "s", "cp"}
  assert [by[n]["times"] for n in ("g", "k", "m", "s", "cp")] == [3, 3, 3, 3, 1]
  assert (by["g"]["category"], by["g"]["dot_flops"]) == ("matmul", 2 * 8 * 16 * 16)
  assert by["g"]["bytes"] == 8 * 16 * 4 + 16 * 16 * 2 + 8 * 16 * 2 + 64  # Operands by name, then the outputs.
  assert (by["k"]["category"], by["k"]["detail"], by["k"]["elements"]) == ("WKV kernel", "wkv7_chunked_backward", 128)
  assert (by["m"]["category"], by["m"]["detail"], by["m"]["dot_flops"]) == ("matmul", "matmul_epilogue", 2 * 8 * 16 * 32)
  assert (by["s"]["category"], by["s"]["flops"]) == ("reductions/norms", 128)
  assert by["s"]["where"] == "ltm_jax/layers/norms.py:42"  # The innermost frame of this package, not flax's.
  assert by["cp"]["category"] == "copies/transposes"
  assert by["g"]["roofline_ms"] == pytest.approx(3 * by["g"]["bytes"] / 2.18e12 * 1e3)
  assert by["k"]["predicted_ms"] == pytest.approx(3 * 128 * ceilings["wkv_bwd_ns"] * 1e-6)


def test_quick_run_writes_the_budget(tmp_path):
  """Also profiled: the kernel rows, loop bodies' included (named behind their loop), find their instructions in the
  trace, and the categories' measured times add up to the total."""
  out = tmp_path / "budget.json"
  assert step_budget.main(["--quick", "--config", str(ROOT / "configs" / "tiny.py"), "--steps", "1",
                           "--measured-ms", "1", "--out", str(out), "--top", "3", "--profile", "1",
                           "--launch-us", "3"]) == 0
  result = json.loads(out.read_text())
  assert result["ceilings_of"] == "h100"
  assert result["ceilings"] == dict(step_budget.DEFAULTS, launch_us=3.0)  # The machine's rates, one flag over them.
  names = [c["category"] for c in result["categories"]]
  assert "matmul" in names and "optimizer" in names
  assert result["total"]["predicted_ms"] == pytest.approx(sum(c["predicted_ms"] for c in result["categories"]))
  assert result["total"]["gflops"] > 0 and result["measured_step_ms"] > 0
  floor = result["floor"]
  assert 0 < floor["ms"] < result["total"]["predicted_ms"]
  assert floor["max_fraction"] == pytest.approx(floor["predicted_fraction"] * result["total"]["predicted_ms"]
                                                / floor["ms"])
  profile = result["profile"]
  assert profile["source"] == "host" and profile["steps"] == 1 and profile["device_ms"] is None
  in_loops = [k for k in result["kernels"] if "/" in k["name"]]
  assert in_loops and sum(k["measured_ms"] > 0 for k in in_loops) >= 0.9 * len(in_loops)
  assert profile["rows_measured"] >= 0.9 * profile["rows"]
  assert result["total"]["measured_ms"] == pytest.approx(sum(c["measured_ms"] for c in result["categories"]))
  assert result["total"]["measured_ms"] == pytest.approx(profile["kernels_ms"]) and profile["kernels_ms"] > 0


def test_the_ceilings_are_the_machines():
  assert step_budget.machine("device", "NVIDIA H200") == "h200"
  assert step_budget.machine("device", "NVIDIA H100 80GB HBM3") == "h100"
  assert step_budget.machine("h200-aot", "NVIDIA H200 (sm_90a), deviceless") == "h200"
  assert step_budget.machine("h100-aot", "NVIDIA H100 80GB HBM3 (sm_90a), deviceless") == "h100"
  assert step_budget.machine("host", "cpu") == "h100"
  assert step_budget.H200["copy_tbps"] > step_budget.DEFAULTS["copy_tbps"]
  import gpu_aot
  for target in (gpu_aot.H100_TARGET_CONFIG, gpu_aot.H200_TARGET_CONFIG):  # Only the memory differs.
    assert "core_count: 132" in target and "major: 9" in target
  assert gpu_aot.H200_TARGET_CONFIG.count("150754820096") == 1 and "NVIDIA H200" in gpu_aot.H200_TARGET_CONFIG


def test_kernel_profile_counts_the_instructions_of_its_module_only(tmp_path):
  """Two programs run inside one trace: only the named module's instructions are counted, each is an instruction of
  that module's optimized HLO, and its product (the bulk of its work) is among them."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kernel_profile

  rng = np.random.default_rng(0)
  x, y = (jnp.asarray(rng.normal(size=(256, 256)), jnp.float32) for _ in range(2))
  def product(a, b):
    return jnp.tanh(a @ b).sum(0)

  def sine(a):
    return jnp.sin(a) * 3.0

  f, g = jax.jit(product).lower(x, y).compile(), jax.jit(sine).lower(x).compile()
  module = kernel_profile.module_name(f.as_text())
  assert module != kernel_profile.module_name(g.as_text())
  instructions = set(re.findall(r"%([\w.-]+) = ", f.as_text()))

  def run():
    jax.block_until_ready((f(x, y), g(x)))

  run()
  profile = kernel_profile.measure(run, module, runs=2, trace_dir=str(tmp_path))
  assert profile.source == "host" and profile.runs == 2
  assert profile.per_op_ms and set(profile.per_op_ms) <= instructions
  assert all(ms > 0 for ms in profile.per_op_ms.values())
  dots = [name for name in profile.per_op_ms if "dot" in name or "ynn" in name or "gemm" in name]
  assert dots, f"no product among {sorted(profile.per_op_ms)}"
  assert list(tmp_path.rglob("*.xplane.pb"))  # The trace stays where it was asked to go.
  with pytest.raises(ValueError, match="runs"):
    kernel_profile.measure(run, module, runs=0)
  with pytest.raises(ValueError, match="module name"):
    kernel_profile.module_name("ENTRY %main () -> f32[] {}")


def test_kernel_profile_idle_is_the_gaps_of_the_kernels_union():
  """Gaps between kernels on a device's streams, fresh random layouts: a kernel overlapping another (a second stream)
  closes no gap; each gap lands in its length's bucket, named by the instructions around it; per run."""
  import numpy as np
  import kernel_profile

  rng = np.random.default_rng()
  for _ in range(20):
    gaps_ns = rng.choice([1_000, 3_000, 7_000, 50_000, 400_000], size=30) + rng.integers(0, 900, size=30)
    busy_ns = rng.integers(2_000, 90_000, size=31)
    intervals, t = [], int(rng.integers(0, 10**9))
    for i, busy in enumerate(busy_ns):
      intervals.append((t, t + int(busy), f"k{i}"))
      if rng.random() < 0.3:  # A shorter kernel on another stream inside this one: no gap of its own.
        intervals.append((t + 10, t + int(busy) // 2, f"s{i}"))
      t += int(busy) + (int(gaps_ns[i]) if i < len(gaps_ns) else 0)
    runs = int(rng.integers(1, 4))
    got = kernel_profile.idle([intervals[i] for i in rng.permutation(len(intervals))], runs)
    assert got.idle_ms == pytest.approx(gaps_ns.sum() / runs / 1e6)
    for name, lo, hi in (("<5us", 0, 5e3), ("5-20us", 5e3, 2e4), ("20-100us", 2e4, 1e5), (">=100us", 1e5, 1e12)):
      chosen = gaps_ns[(gaps_ns >= lo) & (gaps_ns < hi)]
      assert got.buckets[name] == pytest.approx((len(chosen) / runs, chosen.sum() / runs / 1e6))
    longest = int(np.argmax(gaps_ns))
    assert got.largest[0] == (pytest.approx(gaps_ns[longest] / 1e3), f"k{longest}", f"k{longest + 1}")


# One fusion reads a quarter of a flat buffer through an elementwise op and a slice, a whole second operand, and a
# third operand through a broadcast (read whole); a second fusion slices half of its operand directly.
SLICED = """HloModule m

%fused_leaf (p0: f32[64], p1: f32[16], p2: f32[4]) -> f32[16] {
  %p0 = f32[64]{0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %p2 = f32[4]{0} parameter(2)
  %n = f32[64]{0} negate(f32[64]{0} %p0)
  %sl = f32[16]{0} slice(f32[64]{0} %n), slice={[16:32]}
  %b = f32[16]{0} broadcast(f32[4]{0} %p2), dimensions={}
  %m = f32[16]{0} multiply(f32[16]{0} %sl, f32[16]{0} %p1)
  ROOT %r = f32[16]{0} add(f32[16]{0} %m, f32[16]{0} %b)
}

%fused_half (q0: f32[64]) -> f32[32] {
  %q0 = f32[64]{0} parameter(0)
  ROOT %h = f32[32]{0} slice(f32[64]{0} %q0), slice={[0:32]}
}

ENTRY %main (a: f32[64], b: f32[16], c: f32[4]) -> (f32[16], f32[32]) {
  %a = f32[64]{0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %c = f32[4]{0} parameter(2)
  %leaf = f32[16]{0} fusion(f32[64]{0} %a, f32[16]{0} %b, f32[4]{0} %c), kind=kLoop, calls=%fused_leaf
  %half = f32[32]{0} fusion(f32[64]{0} %a), kind=kLoop, calls=%fused_half
  ROOT %t = (f32[16]{0}, f32[32]{0}) tuple(%leaf, %half)
}
"""


def test_a_fusion_reading_slices_of_an_operand_counts_the_slices():
  comps, entry, frames = step_budget.parse_hlo(SLICED)
  rows, _ = step_budget.kernels(comps, entry, frames, dict(step_budget.DEFAULTS))
  by = {r["name"]: r for r in rows}
  assert by["leaf"]["bytes"] == 4 * (16 + 16 + 4) + 4 * 16  # A quarter of a, all of b and c; then the output.
  assert by["half"]["bytes"] == 4 * 32 + 4 * 32


# A loop body's two asynchronous fusions as XLA's GPU pipeline prints them: one reads a [1, 16] slice of a [4, 16]
# buffer (its result tuple repeats its operands before the output and a context word), the other writes an update
# [16] into a slice of that buffer in place; a third, plain fusion adds two whole buffers.
UPDATED = """HloModule m

%fused_slice (p0: f32[4,16], p1: s32[]) -> f32[1,16] {
  %p0 = f32[4,16]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,16]{1,0} dynamic-slice(f32[4,16]{1,0} %p0, s32[] %p1, s32[] %z), dynamic_slice_sizes={1,16}
}

%fused_update (q0: f32[4,16], q1: f32[16], q2: s32[]) -> f32[4,16] {
  %q0 = f32[4,16]{1,0} parameter(0)
  %q1 = f32[16]{0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %b = f32[1,16]{1,0} bitcast(f32[16]{0} %q1)
  ROOT %dus = f32[4,16]{1,0} dynamic-update-slice(f32[4,16]{1,0} %q0, f32[1,16]{1,0} %b, s32[] %q2, s32[] %z)
}

%fused_add (r0: f32[4,16], r1: f32[4,16]) -> f32[4,16] {
  %r0 = f32[4,16]{1,0} parameter(0)
  %r1 = f32[4,16]{1,0} parameter(1)
  ROOT %s = f32[4,16]{1,0} add(f32[4,16]{1,0} %r0, f32[4,16]{1,0} %r1)
}

ENTRY %main (a: f32[4,16], u: f32[16], i: s32[]) -> f32[4,16] {
  %a = f32[4,16]{1,0} parameter(0)
  %u = f32[16]{0} parameter(1)
  %i = s32[] parameter(2)
  %read = ((f32[4,16]{1,0}, s32[]), f32[1,16]{1,0}, u32[]) fusion-start(f32[4,16]{1,0} %a, s32[] %i), kind=kLoop, calls=%fused_slice
  %write = ((f32[4,16]{1,0}, f32[16]{0}, s32[]), f32[4,16]{1,0}, u32[]) fusion-start(f32[4,16]{1,0} %a, f32[16]{0} %u, s32[] %i), kind=kLoop, calls=%fused_update
  ROOT %sum = f32[4,16]{1,0} fusion(f32[4,16]{1,0} %a, f32[4,16]{1,0} %a), kind=kLoop, calls=%fused_add
}
"""


def test_slices_read_and_in_place_updates_count_only_the_slice():
  comps, entry, frames = step_budget.parse_hlo(UPDATED)
  rows, _ = step_budget.kernels(comps, entry, frames, dict(step_budget.DEFAULTS))
  by = {r["name"]: r for r in rows}
  # The slice read, its index, then the slice written and the context word; not the operands in the result tuple.
  assert by["read"]["bytes"] == 4 * 16 + 4 + 4 * 16 + 4
  # The update and its index read, the update written; the [4, 16] buffer neither read nor written whole.
  assert by["write"]["bytes"] == 4 * 16 + 4 + 4 * 16
  assert by["sum"]["bytes"] == 3 * 4 * 4 * 16  # A plain fusion still reads and writes whole buffers.


# A kernel (custom call) given one buffer twice, as a Pallas call with two block layouts over it.
TWICE = """HloModule m

ENTRY %main (a: f32[4,16], b: f32[16]) -> f32[4,16] {
  %a = f32[4,16]{1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  ROOT %k = f32[4,16]{1,0} custom-call(f32[4,16]{1,0} %a, f32[16]{0} %b, f32[4,16]{1,0} %a), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_a_kernel_given_a_buffer_twice_reads_it_once():
  comps, entry, frames = step_budget.parse_hlo(TWICE)
  rows, _ = step_budget.kernels(comps, entry, frames, dict(step_budget.DEFAULTS))
  assert rows[0]["bytes"] == 4 * (64 + 16) + 4 * 64  # a and b read once each, then the output.


# Attention kernels: cuDNN's forward ([B, H, T, D], causal by its config) and its backward without a mask; a Pallas
# forward over T = S (causal) and a Pallas dq kernel attending to S = 12 keys ([B, T, H, D]).
ATTENTION = """HloModule m

ENTRY %main (q: bf16[2,4,8,16], k: bf16[2,4,8,16], p: bf16[2,8,4,16], pk: bf16[2,12,4,16]) -> bf16[2,8,4,16] {
  %q = bf16[2,4,8,16]{3,2,1,0} parameter(0)
  %k = bf16[2,4,8,16]{3,2,1,0} parameter(1)
  %p = bf16[2,8,4,16]{3,2,1,0} parameter(2)
  %pk = bf16[2,12,4,16]{3,2,1,0} parameter(3)
  %f = (bf16[2,4,8,16]{3,2,1,0}, u8[0]{0}) custom-call(bf16[2,4,8,16]{3,2,1,0} %q, bf16[2,4,8,16]{3,2,1,0} %k, bf16[2,4,8,16]{3,2,1,0} %k), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  %b = (bf16[2,4,8,16]{3,2,1,0}, u8[0]{0}) custom-call(bf16[2,4,8,16]{3,2,1,0} %q, bf16[2,4,8,16]{3,2,1,0} %k, bf16[2,4,8,16]{3,2,1,0} %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"NO_MASK"}}
  %g = bf16[2,8,4,16]{3,2,1,0} custom-call(bf16[2,8,4,16]{3,2,1,0} %p, bf16[2,8,4,16]{3,2,1,0} %p, bf16[2,8,4,16]{3,2,1,0} %p), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_attention_forward"}
  ROOT %d = bf16[2,8,4,16]{3,2,1,0} custom-call(bf16[2,8,4,16]{3,2,1,0} %p, bf16[2,12,4,16]{3,2,1,0} %pk, bf16[2,12,4,16]{3,2,1,0} %pk), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_attention_dq"}
}
"""


def test_attention_kernels_are_priced_by_their_pairs_at_the_measured_rates():
  """FLOPs from the query-key pairs (causal T (T + 1) / 2 for cuDNN's causal config and for self-attention, T S
  otherwise) times head size: 4 forward, 10 backward, half of that for each of the Pallas backward's two kernels; the
  time from the attention rates, per pair and head channel."""
  comps, entry, frames = step_budget.parse_hlo(ATTENTION)
  rates = dict(step_budget.H200)
  rows, _ = step_budget.kernels(comps, entry, frames, rates)
  by = {r["detail"]: r for r in rows}
  causal, full = 2 * 4 * 16 * (8 * 9 // 2), 2 * 4 * 16 * (8 * 12)
  expected = {"__cudnn$fmhaSoftmax": (4 * causal, causal * rates["attn_fwd_ns"]),
              "__cudnn$fmhaSoftmaxBackward": (10 * 2 * 4 * 16 * 64, 2 * 4 * 16 * 64 * rates["attn_bwd_ns"]),
              "flash_attention_forward": (4 * causal, causal * rates["attn_fwd_ns"]),
              "flash_attention_dq": (5 * full, full / 2 * rates["attn_bwd_ns"])}
  assert set(by) == set(expected)
  for detail, (flops, ns) in expected.items():
    assert by[detail]["category"] == "attention kernel"
    assert by[detail]["flops"] == by[detail]["dot_flops"] == flops, detail
    assert by[detail]["kernel_ms"] == pytest.approx(ns * 1e-6), detail


# Two float32 dots of the same shape: one at XLA's default precision (TF32 on tensor cores), one asking for full
# float32 precision; and a bfloat16 one.
PRECISIONS = """HloModule m

ENTRY %main (a: f32[64,32], b: f32[32,16], c: bf16[64,32], d: bf16[32,16]) -> f32[64,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  %c = bf16[64,32]{1,0} parameter(2)
  %d = bf16[32,16]{1,0} parameter(3)
  %tf = f32[64,16]{1,0} dot(f32[64,32]{1,0} %a, f32[32,16]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %full = f32[64,16]{1,0} dot(f32[64,32]{1,0} %a, f32[32,16]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
  %half = f32[64,16]{1,0} dot(bf16[64,32]{1,0} %c, bf16[32,16]{1,0} %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %s = f32[64,16]{1,0} add(f32[64,16]{1,0} %tf, f32[64,16]{1,0} %full)
}
"""


def test_float32_dots_are_priced_by_their_precision():
  comps, entry, frames = step_budget.parse_hlo(PRECISIONS)
  ceilings = dict(step_budget.DEFAULTS, copy_tbps=1e9, launch_us=0.0)  # Compute-bound: time is FLOPs / rate.
  rows, _ = step_budget.kernels(comps, entry, frames, ceilings)
  by = {r["name"]: r for r in rows}
  assert [by[n]["dot_dtype"] for n in ("tf", "full", "half")] == ["tf32", "f32", "bf16"]
  flops = 2 * 64 * 16 * 32
  for name, rate in (("tf", "tf32_matmul_tflops"), ("full", "f32_matmul_tflops"), ("half", "matmul_tflops")):
    assert by[name]["roofline_ms"] == pytest.approx(flops / (ceilings[rate] * 1e12) * 1e3), name
