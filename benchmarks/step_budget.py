#!/usr/bin/env python3
"""Time budget of one train step, op by op: the compiled step's kernels with FLOPs, bytes and a roofline time each.

    .venv-aot/bin/python benchmarks/step_budget.py --config configs/small_rwkv7.py    # H100, deviceless (sm_90a)
    python benchmarks/step_budget.py --config configs/base_125m_rwkv7.py --measured-ms 300   # on a GPU: + measured
    python benchmarks/step_budget.py --config configs/small_rwkv7.py --profile 3   # on a GPU: + each kernel measured
    python benchmarks/step_budget.py --quick                                           # toy config, any machine

Compiles the real train step (ltm_jax.train.step, AdamW included) at the config's batch_size x seq_len and reads the
optimized HLO: every kernel the step launches (each fusion, each custom call: Pallas/Triton kernels, cuBLAS gemms,
cuDNN; each unfused copy, transpose, reduce, ...), with loop bodies counted once per trip. FLOPs and bytes are
counted from the HLO's shapes: a dot 2 x output x contraction, every other arithmetic instruction one per output
element (a reduce one per input element); bytes are the kernel's operands plus its outputs (a fusion reading slices
of an operand reads the slices; one updating a slice of a buffer in place reads and writes the update). A Pallas
kernel's FLOPs are not counted (its HLO is one opaque call), except the fused-epilogue matmul's
(ltm_pallas.matmul_mgpu), which is priced as a matmul at --matmul-tflops (an assumption that it runs at cuBLAS's
rate; an H200 measured it slower), and the attention kernels' (below).

Each kernel's roofline time is max(FLOPs / compute ceiling, bytes / copy bandwidth): bf16/f16/f8 dots against
--matmul-tflops, float32 dots at XLA's default precision (TF32 on tensor cores) against --tf32-matmul-tflops, those
at full float32 precision against --f32-matmul-tflops, everything else against --vector-tflops, bytes against
--copy-tbps (read + write). The WKV-7 kernels also get a time scaled by their element count from the kernel
benchmark's measured rows (--wkv-fwd-ns, --wkv-bwd-ns); the prediction takes the larger of the two. Each kernel
launch adds --launch-us (an assumption, not a measurement). The ceilings default to those measured on one H100, or
on one H200 for --target h200-aot or on an H200 (MACHINES); a flag overrides one. Kernels fall into categories:
matmul, WKV kernel, attention kernel, elementwise/fusion, reductions/norms (with the Pallas kernels of the RWKV-7
output stage, key side, block norm and time-mix input stage, priced by their bytes, a buffer given twice read once),
copies/transposes, optimizer (the AdamW update: instructions whose source is optax or ltm_jax/train), other.
Attention kernels get FLOPs from q's and k's shapes (4 per query-key pair and head channel forward, 10 backward;
self-attention taken as causal) and, like the WKV-7 kernels, a time from measured rows: cuDNN's, which `auto` runs
on Hopper, whichever kernel the program holds (--attn-fwd-ns, --attn-bwd-ns, per pair and head channel).

Where it compiles: with the CUDA plugin installed and no GPU, for an H100 without a device (benchmarks/gpu_aot.py's
target description), or for an H200 with --target h200-aot (the same sm_90a chip; XLA sees its 141 GB, which bounds
how much of a large step it rematerializes, and its bandwidth); on a machine with a GPU, for that GPU, and then it
also times the step; elsewhere for the host CPU (the budget is then of the CPU program, with the same ceilings: a dry
run of the script).

With --profile N on a device, N more steps run under jax.profiler and every kernel row gets its measured time beside
the prediction (benchmarks/kernel_profile.py: the trace's events summed by HLO instruction), as do the categories
and source lines; the trace's device time that names no instruction of the step is reported as unmatched.

Prints the per-category table, the top kernels and the top source lines, and writes
benchmarks/results/step-budget-<config>-<device>.json.gz (or --out).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import glob
import gzip
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import sys
import time
from unittest import mock

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for _p in (str(ROOT), str(BENCH)):
  if _p not in sys.path:
    sys.path.insert(0, _p)

CATEGORIES = ("matmul", "WKV kernel", "attention kernel", "elementwise/fusion", "reductions/norms",
              "copies/transposes", "optimizer", "other")

# Measured on one H100 80GB HBM3 (benchmarks/gpu_sweep.py, shared gpu-results of 2026-11-25): copy 2.18 TB/s
# (read + write), bf16 matmul 642 TFLOP/s; the chunked WKV-7 Pallas kernels at (8, 4096, 4096, 64) bf16 take 2.36 ms
# forward and 12.27 ms forward + backward, i.e. per element of r [B, T, H, N]: 2.36e6 / 2^27 ns and
# (12.27 - 2.36)e6 / 2^27 ns; the sequential ones (wkv7_forward, wkv7_backward) 10.67 and 75.64 ms. float32 and
# vector rates are the datasheet's (H100 SXM: 67 TFLOP/s fp32 non-tensor); TF32 is half the measured bf16 rate, as
# the datasheet's dense TF32 (495) is half its bf16 (989): an assumption, not measured. Attention kernels at cuDNN's
# measured rate, what `auto` runs on Hopper (a deviceless compilation takes the Pallas kernels: cuDNN needs a device),
# per query-key pair times head size: causal, D 64, (B, H, T) = (8, 32, 2048), 0.592 ms forward and 1.951 forward +
# backward (benchmarks/results/attention-d64-nvidia-h100-80gb-hbm3.json).
_ATTENTION_H100_UNITS = 8 * 32 * 64 * 2048 * 2049 / 2
DEFAULTS = {"matmul_tflops": 642.0, "copy_tbps": 2.18, "f32_matmul_tflops": 67.0, "tf32_matmul_tflops": 321.0,
            "vector_tflops": 67.0,
            "wkv_fwd_ns": 2.36e6 / (8 * 4096 * 4096), "wkv_bwd_ns": (12.27 - 2.36) * 1e6 / (8 * 4096 * 4096),
            "wkv_seq_fwd_ns": 10.67e6 / (8 * 4096 * 4096), "wkv_seq_bwd_ns": (75.64 - 10.67) * 1e6 / (8 * 4096 * 4096),
            "attn_fwd_ns": 0.592e6 / _ATTENTION_H100_UNITS,
            "attn_bwd_ns": (1.951 - 0.592) * 1e6 / _ATTENTION_H100_UNITS,
            "launch_us": 2.0}
# Measured on one H200 (`train.py --mfu` for three configs, each process measuring its own ceilings; the WKV-7 kernel
# benchmark): bf16 matmul 611-630 TFLOP/s and copy 2.80-3.23 TB/s, the medians taken; the chunked WKV-7 kernels at
# (8, 4096, 4096, 64) bf16 2.40 ms forward, 12.47 forward + backward (as the H100's: not bound by memory). TF32 is
# half the bf16 rate, as for the H100; the rest as the H100's: the same SMs and clocks (the datasheets' fp32 rates
# agree); the sequential WKV-7 kernels were not measured there. cuDNN's attention as profiled in small_rwkv7's step
# (two causal layers, D 64, (B, H, T) = (32, 8, 1024): 0.230 ms forward, 0.737 backward;
# benchmarks/results/step-budget-small_rwkv7-nvidia-h200.json.gz).
_ATTENTION_H200_UNITS = 2 * 32 * 8 * 64 * 1024 * 1025 / 2
H200 = dict(DEFAULTS, matmul_tflops=626.0, copy_tbps=3.02, tf32_matmul_tflops=313.0,
            wkv_fwd_ns=2.40e6 / (8 * 4096 * 4096), wkv_bwd_ns=(12.47 - 2.40) * 1e6 / (8 * 4096 * 4096),
            attn_fwd_ns=0.230e6 / _ATTENTION_H200_UNITS, attn_bwd_ns=0.737e6 / _ATTENTION_H200_UNITS)
MACHINES = {"h100": DEFAULTS, "h200": H200}
# --target for a deviceless compilation -> the machine it compiles for and prices at (gpu_aot.DEVICELESS).
AOT_TARGETS = {"h100-aot": "h100", "h200-aot": "h200"}

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
                "u64": 8, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "token": 0}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\((.*)$")
# Instructions that launch nothing (views, tuples, control), and the arithmetic ones (one FLOP per output element).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
         "opt-barrier", "add-dependency", "domain", "async-done", "copy-done", "send-done", "recv-done", "fusion-done",
         "all-reduce-done", "all-gather-done", "collective-permute-done"}
_MOVES = {"copy", "transpose", "reshape", "bitcast", "broadcast", "slice", "dynamic-slice", "dynamic-update-slice",
          "concatenate", "pad", "reverse", "parameter", "constant", "tuple", "get-tuple-element", "iota", "gather",
          "scatter", "convert", "copy-start", "copy-done", "bitcast-convert"}
_ARITH = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "exponential-minus-one", "log",
          "log-plus-one", "tanh", "logistic", "rsqrt", "sqrt", "cbrt", "power", "negate", "abs", "select", "compare",
          "clamp", "sign", "floor", "ceil", "round-nearest-even", "round-nearest-afz", "remainder", "atan2", "sine",
          "cosine", "and", "or", "xor", "not", "erf", "is-finite", "tan", "shift-left", "shift-right-logical",
          "shift-right-arithmetic", "convert"}


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(text)]


def _nbytes(shapes) -> float:
  return sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in shapes)


def _split_call(rest: str) -> tuple[str, str]:
  """'a, b), attrs' -> ('a, b', 'attrs'): the operand list up to its closing parenthesis, then the attributes."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


@dataclasses.dataclass
class Instr:
  name: str
  opcode: str
  out: list
  operands: list
  operand_text: str
  attrs: str
  root: bool = False


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str, dict[int, str]]:
  """Optimized HLO text -> ({computation: [instructions]}, name of the entry computation, {stack frame id: the
  innermost file:line of this package or optax on that frame's stack}). Operands printed without their shapes get
  them from the instruction of that name in the same computation."""
  comps, entry, current, shapes = {}, None, None, {}
  for line in text.splitlines():
    if current is None:
      if m := _HEADER.match(line):
        current, shapes = comps.setdefault(m.group(2), []), {}
        if m.group(1):
          entry = m.group(2)
      continue
    if line.strip() == "}":
      current = None
      continue
    if m := _INSTR.match(line):
      operand_text, attrs = _split_call(m.group(5))
      out = _shapes(m.group(3))
      operands = _shapes(operand_text) or [s for name in re.findall(r"%([\w.\-]+)", operand_text)
                                           for s in shapes.get(name, [])]
      shapes[m.group(2)] = out
      current.append(Instr(m.group(2), m.group(4), out, operands, operand_text, attrs, bool(m.group(1))))
  return comps, entry, _stack_frames(text)


_OURS = ("ltm_jax/", "ltm_pallas/", "pallas/", "optax/", "benchmarks/")


def _stack_frames(text: str) -> dict[int, str]:
  """Frame id -> 'file:line' of the innermost frame on its stack in ltm_jax, ltm_pallas or optax (else the innermost
  frame), from the module's FileNames / FileLocations / StackFrames tables."""
  tables = collections.defaultdict(dict)
  section = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
      continue
    if section is None:
      continue
    if not line.strip():
      section = None
      continue
    key, _, rest = line.partition(" ")
    if key.isdigit():
      tables[section][int(key)] = rest
  files = {k: _short_path(v.strip('"')) for k, v in tables["FileNames"].items()}
  locations = {}
  for k, v in tables["FileLocations"].items():
    f, ln = re.search(r"file_name_id=(\d+)", v), re.search(r"\bline=(\d+)", v)
    locations[k] = f"{files.get(int(f.group(1)), '?') if f else '?'}:{ln.group(1) if ln else '?'}"
  frames = {}
  for k, v in tables["StackFrames"].items():
    loc, parent = re.search(r"file_location_id=(\d+)", v), re.search(r"parent_frame_id=(\d+)", v)
    frames[k] = (locations.get(int(loc.group(1)), "?") if loc else "?", int(parent.group(1)) if parent else 0)
  where = {}
  for k in frames:
    chain, seen, frame = [], set(), k
    while frame in frames and frame not in seen:
      seen.add(frame)
      chain.append(frames[frame][0])
      frame = frames[frame][1]
    ours = [c for c in chain if c.startswith(_OURS)]
    where[k] = ours[0] if ours else (chain[0] if chain else "")
  return where


def _short_path(path: str) -> str:
  for marker in ("ltm_jax/", "ltm_pallas/", "pallas/", "optax/", "flax/", "benchmarks/", "jax/"):
    if marker in path:
      return marker + path.rsplit(marker, 1)[1]
  return path


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(key + r"=%?([\w.\-]+)", attrs)
  return m.group(1) if m else None


def _dims(attrs: str, key: str) -> list[int]:
  """Dimension numbers from either `lhs_contracting_dims={2}` (HLO) or "lhs_contracting_dimensions":["2"] (JSON)."""
  if m := re.search(key + r"_dims=\{([\d,]*)\}", attrs):
    return [int(x) for x in m.group(1).split(",") if x]
  if m := re.search('"' + key + r'_dimensions":\[([^\]]*)\]', attrs):
    return [int(x) for x in re.findall(r"\d+", m.group(1))]
  return []


def _dot_dtype(ins: Instr) -> str:
  """The widest operand dtype of a dot, "tf32" for a float32 dot at XLA's default precision: its GPU emitters
  multiply those on tensor cores in TF32 (the sm_90a PTX of such a Triton GEMM holds mma.sync ... tf32), unless the
  dot asks for full precision (operand_precision highest, or a float32 algorithm)."""
  dtype = max([d for d, _ in ins.operands[:2]] or [""], key=lambda d: _DTYPE_BYTES.get(d, 0))
  full = re.search(r"highest|HIGHEST|dot_f32_f32_f32|ALG_DOT_F32_F32_F32", ins.attrs)
  return "tf32" if dtype == "f32" and not full else dtype


def _dot_flops(ins: Instr) -> float:
  if not ins.out or not ins.operands:
    return 0.0
  lhs = ins.operands[0][1]
  k = math.prod(lhs[d] for d in _dims(ins.attrs, "lhs_contracting") if d < len(lhs))
  return 2.0 * math.prod(ins.out[0][1]) * k


def _source(attrs: str, frames: dict[int, str]) -> tuple[str, str]:
  """(op_name, file:line) from the instruction's metadata: source_file/source_line, else its stack frame."""
  op = re.search(r'op_name="([^"]*)"', attrs)
  f = re.search(r'source_file="([^"]*)"', attrs)
  ln = re.search(r"source_line=(\d+)", attrs)
  frame = re.search(r"stack_frame_id=(\d+)", attrs)
  where = ""
  if frame and frames.get(int(frame.group(1))):
    where = frames[int(frame.group(1))]
  elif f:
    where = f"{_short_path(f.group(1))}:{ln.group(1) if ln else '?'}"
  op_name = op.group(1) if op else ""
  if where and not where.startswith(_OURS) and (scope := _module_scope(op_name)):
    where = f"{where} {scope}"  # A library line (a flax Dense, a norm): say which module of the model called it.
  return op_name, where


def _module_scope(op_name: str) -> str:
  """'jit(step)/.../LM._forward/block_3/mixer/receptance/dot_general' -> 'mixer/receptance' (the model's module path
  below the block, without the primitive)."""
  tail = op_name.split("_forward/", 1)[1] if "_forward/" in op_name else ""
  parts = [p for p in tail.split("/")[:-1] if not re.fullmatch(r"block_\d+|jit\(.*\)|cond|branch_\d+_fun|while|body", p)]
  parts = [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]]  # flax repeats a module's own name.
  return "/".join(parts[:3])


def _content(comps, name: str, seen=None) -> collections.Counter:
  """Opcode counts of a fused computation and the computations it calls."""
  seen = seen if seen is not None else set()
  counts = collections.Counter()
  if name in seen or name not in comps:
    return counts
  seen.add(name)
  for ins in comps[name]:
    counts[ins.opcode] += 1
    for key in ("calls", "to_apply"):
      if (sub := _attr(ins.attrs, key)) and ins.opcode != "reduce":
        counts += _content(comps, sub, seen)
  return counts


def _fused_cost(comps, name: str) -> tuple[float, float, str]:
  """(FLOPs, dot FLOPs, widest dot operand dtype) of a fused computation."""
  flops = dot_flops = 0.0
  dot_dtype = ""
  for ins in comps.get(name, []):
    if ins.opcode in ("dot", "convolution"):
      f = _dot_flops(ins)
      flops, dot_flops = flops + f, dot_flops + f
      dot_dtype = max([dot_dtype, _dot_dtype(ins)], key=lambda d: _DTYPE_BYTES.get(d.replace("tf32", "f32"), 0))
    elif ins.opcode in _ARITH and ins.out:
      flops += math.prod(ins.out[0][1])
    elif ins.opcode in ("reduce", "reduce-window") and ins.operands:
      flops += math.prod(ins.operands[0][1])
    elif ins.opcode == "fusion" and (sub := _attr(ins.attrs, "calls")):
      f, d, t = _fused_cost(comps, sub)
      flops, dot_flops = flops + f, dot_flops + d
      dot_dtype = t or dot_dtype
  return flops, dot_flops, dot_dtype


def _kernel_name(ins: Instr, op_name: str) -> str:
  """A Pallas kernel's name: the backend config's, else the name scope around its pallas_call (Triton) or mpmd_map
  (Mosaic GPU)."""
  if m := re.search(r'"name":\s*"([^"]+)"', ins.attrs):
    return m.group(1)
  if m := re.search(r"([\w.\-]+)/(?:anonymous/)?(?:pallas_call|mpmd_map)", op_name):
    return m.group(1)
  return ""


# An attention kernel's FLOPs per query-key pair and head channel: forward (q k and p v), backward (the forward's
# scores again and four products), which the Pallas backward splits over two kernels (dq, dkv).
ATTENTION_FLOPS = {"fwd": 4.0, "bwd": 10.0}


def _attention_pass(name: str) -> str:
  return "bwd" if any(w in name.lower() for w in ("backward", "bwd", "_dq", "_dkv")) else "fwd"


def _attention_flops(ins: Instr, name: str, cudnn: bool) -> float:
  """An attention kernel's FLOPs: its query-key pairs times head size (q and k its first two operands, [B, T, H, D]
  for the Pallas kernels, [B, H, T, D] for cuDNN's; self-attention, T = S, counts the causal pairs T (T + 1) / 2:
  every config's is causal, cuDNN's calls say so in their config, a window is priced as causal; other calls all
  T S), times ATTENTION_FLOPS of its pass (half the backward's for each Pallas backward kernel)."""
  (_, q), (_, k) = ins.operands[:2]
  if len(q) != 4 or len(k) != 4:
    return 0.0
  (b, h, t, d), s = (q, k[2]) if cudnn else ((q[0], q[2], q[1], q[3]), k[1])
  causal = "CAUSAL" in ins.attrs if cudnn else t == s
  units = b * h * d * (t * (t + 1) / 2 if causal else t * s)
  split = 0.5 if any(w in name.lower() for w in ("_dq", "_dkv")) else 1.0
  return float(units * ATTENTION_FLOPS[_attention_pass(name)] * split)


def _is_optimizer(op_name: str, where: str) -> bool:
  """The optimizer update: optax's transforms (not its losses) and the train step's own update code."""
  return (where.startswith(("optax/", "ltm_jax/train/optimizer", "ltm_jax/train/step"))
          and not where.startswith("optax/losses"))


def classify(comps, ins: Instr, op_name: str, where: str) -> tuple[str, float, float, str, str]:
  """(category, FLOPs, dot FLOPs, dot dtype, detail) of one launched instruction."""
  if ins.opcode == "custom-call":
    target = _attr(ins.attrs, "custom_call_target") or re.search(r'custom_call_target="([^"]*)"', ins.attrs).group(1)
    name = _kernel_name(ins, op_name)
    lowered = (name + target).lower()
    # RWKV-7's output stage, key side, block norm (residual add + norm) and the time mix's norm with its mixes:
    # norms, not a WKV.
    if lowered.startswith(("rwkv7_out", "rwkv7_key", "add_norm", "norm_mix")):
      return "reductions/norms", 0.0, 0.0, "", name
    if lowered.startswith("matmul_epilogue"):  # ltm_pallas.matmul_mgpu: a [M, K] @ b [K, G * N], priced as a matmul.
      (dtype, (m, k)), (_, (_, columns)) = ins.operands[:2]
      f = 2.0 * m * k * columns
      return "matmul", f, f, dtype, name
    if "wkv" in lowered:
      return "WKV kernel", 0.0, 0.0, "", name or target
    if "fmha" in lowered or "attention" in lowered or "flash" in lowered:
      f = _attention_flops(ins, name or target, cudnn="cudnn" in lowered)
      return "attention kernel", f, f, "bf16", name or target
    if "gemm" in lowered or "matmul" in lowered:
      f = _dot_flops(ins)
      return "matmul", f, f, _dot_dtype(ins), target
    return "other", 0.0, 0.0, "", name or target
  if ins.opcode in ("dot", "convolution"):
    f = _dot_flops(ins)
    return "matmul", f, f, _dot_dtype(ins), ins.opcode
  if ins.opcode in ("fusion", "fusion-start"):
    sub = _attr(ins.attrs, "calls")
    flops, dot_flops, dot_dtype = _fused_cost(comps, sub)
    content = _content(comps, sub)
    kind = _attr(ins.attrs, "kind") or ""
    detail = kind
    if m := re.search(r'"kind":\s*"([^"]+)"', ins.attrs):
      detail += " " + m.group(1)
    if dot_flops:
      return "matmul", flops, dot_flops, dot_dtype, detail
    if _is_optimizer(op_name, where):
      return "optimizer", flops, 0.0, "", detail
    if set(content) <= _MOVES:
      return "copies/transposes", flops, 0.0, "", detail
    if content["reduce"] or content["reduce-window"]:
      return "reductions/norms", flops, 0.0, "", detail
    return "elementwise/fusion", flops, 0.0, "", detail
  if _is_optimizer(op_name, where):
    return "optimizer", 0.0, 0.0, "", ins.opcode
  if ins.opcode in _MOVES:
    return "copies/transposes", 0.0, 0.0, "", ins.opcode
  if ins.opcode in ("reduce", "reduce-window"):
    return "reductions/norms", float(math.prod(ins.operands[0][1])) if ins.operands else 0.0, 0.0, "", ins.opcode
  if ins.opcode in _ARITH:
    return "elementwise/fusion", float(math.prod(ins.out[0][1])) if ins.out else 0.0, 0.0, "", ins.opcode
  return "other", 0.0, 0.0, "", ins.opcode


def _trip_count(ins: Instr) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
  return int(m.group(1)) if m else None


def kernels(comps, entry: str, frames: dict[int, str], ceilings: dict) -> tuple[list[dict], list[str]]:
  """Every kernel the entry computation launches (loop bodies expanded by trip count; a conditional as its cheapest
  branch under `ceilings`, the fast path), with roofline times, and notes on what is unknown."""
  rows, notes = [], []

  def walk(comp: str, times: int, path: str, out: list):
    for ins in comps.get(comp, []):
      if ins.opcode in _FREE:
        continue
      if ins.opcode == "while":
        n = _trip_count(ins)
        if n is None:
          notes.append(f"{ins.name}: loop without a known trip count, counted once")
        walk(_attr(ins.attrs, "body"), times * (n or 1), f"{path}{ins.name}/", out)
        continue
      if ins.opcode == "conditional":
        names = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
        subs = [s.strip().lstrip("%") for s in names.group(1).split(",")] if names else [
            _attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation")]
        branches = []
        for sub in filter(None, subs):
          branch_rows = []
          walk(sub, times, f"{path}{ins.name}/{sub}/", branch_rows)
          branches.append((sub, branch_rows))
        if branches:
          costs = [sum(r["predicted_ms"] for r in roofline(b, ceilings)) for _, b in branches]
          best = costs.index(min(costs))
          out.extend(branches[best][1])
          notes.append(f"{ins.name}: conditional, counted as its cheapest branch {branches[best][0]} "
                       f"({costs[best]:.3f} of {', '.join(f'{c:.3f}' for c in costs)} ms)")
        continue
      if ins.opcode in ("call", "async-start") or (
          ins.opcode not in ("fusion", "fusion-start", "custom-call", "reduce", "scatter", "sort", "map", "select-and-scatter",
                             "reduce-window", "all-reduce") and _attr(ins.attrs, "calls")):
        for sub in filter(None, [_attr(ins.attrs, k) for k in ("to_apply", "calls")]):
          walk(sub, times, f"{path}{ins.name}/", out)
        continue
      op_name, where = _source(ins.attrs, frames)
      category, flops, dot_flops, dot_dtype, detail = classify(comps, ins, op_name, where)
      out.append({"name": path + ins.name, "opcode": ins.opcode, "detail": detail, "category": category,
                   "times": times, "flops": flops, "dot_flops": dot_flops, "dot_dtype": dot_dtype,
                   "bytes": _launch_bytes(comps, ins), "out": _fmt_shape(ins.out),
                   "elements": math.prod(ins.operands[0][1]) if ins.operands else 0,
                   "backward": "transpose(" in op_name, "op_name": op_name, "where": where})

  walk(entry, 1, "", rows)
  return roofline(rows, ceilings), notes


_SLICES = ("slice", "dynamic-slice")
# Ops whose every output element reads the element of each operand at the same index (the same shape): they read the
# share of each operand that their users read of them.
_PER_ELEMENT = _ARITH | {"bitcast", "reshape", "copy", "bitcast-convert"}


def _in_place_update(comps, ins: Instr) -> float | None:
  """The bytes written by a fusion whose root is a dynamic-update-slice of one of its parameters (else None): XLA's
  GPU emitter writes such an update into the operand's buffer, which is the output's, so the kernel reads and writes
  only the update, however large the buffer (a loop filling a stacked array slice by slice)."""
  sub = _attr(ins.attrs, "calls") if ins.opcode in ("fusion", "fusion-start") else None
  body = comps.get(sub, []) if sub else []
  root = next((i for i in body if i.root), None)
  if root is None or root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
    return None
  buffer = re.findall(r"%([\w.\-]+)", root.operand_text)[0]
  if not any(i.name == buffer and i.opcode == "parameter" for i in body):
    return None
  return _nbytes(root.operands[1:2])


def _launch_bytes(comps, ins: Instr) -> float:
  """Bytes a launch reads (`_operand_bytes`) and writes: its outputs; for an asynchronous fusion (fusion-start, whose
  result tuple also holds its operands and a context) only the fusion's own output; for an in-place update only the
  update."""
  update = _in_place_update(comps, ins)
  out = ins.out[len(ins.operands):] if ins.opcode == "fusion-start" else ins.out
  return _operand_bytes(comps, ins, in_place=update is not None) + (_nbytes(out) if update is None else update)


def _operand_bytes(comps, ins: Instr, in_place: bool = False) -> float:
  """Bytes a launch reads: each operand whole (a custom call's repeated operand once), except where a fusion's
  computation reads only part of an operand, through slices, alone or after elementwise ops (a kernel reading one
  leaf of a flattened tree). The share read flows from the root (all of it) back through elementwise ops (the share
  their users read) and slices (the slice's share of their operand); any other use reads the operand whole, as does a
  share above one. `in_place`: the root updates its first operand in place, which it does not read."""
  sub = _attr(ins.attrs, "calls") if ins.opcode in ("fusion", "fusion-start") else None
  body = comps.get(sub, []) if sub else []
  params = {int(i.operand_text): i.name for i in body if i.opcode == "parameter" and i.operand_text.strip().isdigit()}
  if ins.opcode == "custom-call":
    # A kernel given one buffer twice (two block layouts over it, as a Pallas call may take) reads it once: the
    # second layout's blocks are the first's elements again, or a few of them.
    names = re.findall(r"%([\w.\-]+)", ins.operand_text)
    if len(names) == len(ins.operands):
      return _nbytes([shape for k, shape in enumerate(ins.operands) if names[k] not in names[:k]])
  if not params or len(params) != len(ins.operands):
    return _nbytes(ins.operands)
  share = collections.defaultdict(float)  # name -> the share of its elements that the kernel reads (root: 1).
  for i in reversed(body):
    if i.root:
      share[i.name] = 1.0
    used = min(share[i.name], 1.0)
    names = re.findall(r"%([\w.\-]+)", i.operand_text)
    for k, name in enumerate(names):
      if in_place and i.root and k == 0:
        continue  # The buffer updated in place: only the update and the indices are read.
      if i.opcode in _SLICES and k == 0 and i.operands:
        size = math.prod(i.operands[0][1]) or 1
        share[name] += used * math.prod(i.out[0][1]) / size if i.out else 1.0
      elif i.opcode in _PER_ELEMENT and i.out and i.operands and len(i.operands) == len(names) and (
          i.operands[k][1] == i.out[0][1] or i.opcode in ("bitcast", "reshape")):
        share[name] += used
      else:
        share[name] += 1.0
  return sum(_nbytes([shape]) * min(share[params[index]], 1.0) for index, shape in enumerate(ins.operands))


def _fmt_shape(shapes) -> str:
  return ",".join(f"{d}[{'x'.join(map(str, dims))}]" for d, dims in shapes[:2])


def roofline(rows: list[dict], c: dict) -> list[dict]:
  """Adds roofline_ms, kernel_ms (the WKV kernels' benchmark-scaled time) and predicted_ms to each row (per step)."""
  for r in rows:
    compute = {"f32": c["f32_matmul_tflops"], "f64": c["f32_matmul_tflops"],
               "tf32": c["tf32_matmul_tflops"]}.get(r["dot_dtype"], c["matmul_tflops"])
    t_compute = r["dot_flops"] / (compute * 1e12) + (r["flops"] - r["dot_flops"]) / (c["vector_tflops"] * 1e12)
    t_bytes = r["bytes"] / (c["copy_tbps"] * 1e12)
    r["bound"] = "compute" if t_compute > t_bytes else "bytes"
    r["roofline_ms"] = r["times"] * max(t_compute, t_bytes) * 1e3
    r["kernel_ms"] = None
    if r["category"] == "WKV kernel":
      kind = "bwd" if "backward" in r["detail"] else "fwd"
      ns = c[f"wkv_{kind}_ns"] if "chunked" in r["detail"] else c[f"wkv_seq_{kind}_ns"]
      r["kernel_ms"] = r["times"] * r["elements"] * ns * 1e-6
    elif r["category"] == "attention kernel" and r["flops"]:  # At cuDNN's measured rate, whichever kernel it is.
      kind = _attention_pass(r["detail"])
      r["kernel_ms"] = r["times"] * r["flops"] / ATTENTION_FLOPS[kind] * c[f"attn_{kind}_ns"] * 1e-6
    r["predicted_ms"] = max(r["roofline_ms"], r["kernel_ms"] or 0.0) + r["times"] * c["launch_us"] * 1e-3
  return rows


def summarize(rows: list[dict], key: str) -> list[dict]:
  groups = collections.OrderedDict()
  for r in rows:
    g = groups.setdefault(r[key], {key: r[key], "kernels": 0, "gflops": 0.0, "gbytes": 0.0, "roofline_ms": 0.0,
                                   "predicted_ms": 0.0})
    g["kernels"] += r["times"]
    g["gflops"] += r["times"] * r["flops"] / 1e9
    g["gbytes"] += r["times"] * r["bytes"] / 1e9
    g["roofline_ms"] += r["roofline_ms"]
    g["predicted_ms"] += r["predicted_ms"]
    if "measured_ms" in r:  # Profiled (--profile).
      g["measured_ms"] = g.get("measured_ms", 0.0) + r["measured_ms"]
  return list(groups.values())


# ----------------------------------------------------------------------------------------------------------------
# Compiling and (with a GPU) measuring.


# What no fusion of the memory-bound kernels removes: the products and the sequence kernels (priced by measurement).
FLOOR_CATEGORIES = ("matmul", "WKV kernel", "attention kernel")


def _floor(categories: list[dict], total: dict, model_flops: float, matmul_tflops: float) -> dict:
  """The step's floor: the predicted time of FLOOR_CATEGORIES alone, and the fraction of the matmul rate the model's
  FLOPs would reach at it (the most any fusion of the other kernels can give) and at the predicted step."""
  ms = sum(g["predicted_ms"] for g in categories if g["category"] in FLOOR_CATEGORIES)
  fraction = lambda step_ms: model_flops / (step_ms * 1e-3) / (matmul_tflops * 1e12) if step_ms else 0.0
  return {"categories": list(FLOOR_CATEGORIES), "ms": ms, "max_fraction": fraction(ms),
          "predicted_fraction": fraction(total["predicted_ms"])}


def _has_cuda_plugin() -> bool:
  return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def _gpu_present() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def choose_target(requested: str) -> str:
  """'device' (the local accelerator), 'h100-aot' or 'h200-aot' (deviceless) or 'host'; call before importing
  jax."""
  if requested != "auto":
    return requested
  if _has_cuda_plugin() and not _gpu_present() and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    return "h100-aot"
  return "device"


def machine(target: str, device_kind: str) -> str:
  """Whose measured rates price the kernels: the H200's for its deviceless target or on one (device_kind as jax
  names it), the H100's elsewhere."""
  if target in AOT_TARGETS:
    return AOT_TARGETS[target]
  return "h200" if target == "device" and "H200" in device_kind else "h100"


def load(args):
  from ltm_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  overrides = [o for o in args.overrides if o]
  if args.batch:
    overrides.append(f"train.batch_size={args.batch}")
  if args.seq:
    overrides.append(f"train.seq_len={args.seq}")
  cfg = config_lib.load_config(args.config, overrides)
  if args.quick:
    import common  # pylint: disable=g-import-not-at-top
    cfg = common.toy_config(cfg)
  return cfg


def compile_step(cfg, target: str):
  """(compiled, state, batch): the train step compiled for the device with its initial state and a random batch, or
  for a deviceless H100 or H200 (state and batch None)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if target not in AOT_TARGETS:
    import common  # pylint: disable=g-import-not-at-top
    compiled, state, batch, _ = common.compiled_train_step(cfg)
    return compiled, state, batch

  from ltm_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from ltm_jax.state import abstract_train_state  # pylint: disable=g-import-not-at-top
  from ltm_jax.train.optimizer import learning_rate, make_optimizer  # pylint: disable=g-import-not-at-top
  from ltm_jax.train.step import make_train_step  # pylint: disable=g-import-not-at-top

  t = cfg.train
  optimizer = make_optimizer(t)
  step = make_train_step(model_lib.LM(cfg.model, cfg.latent), optimizer, learning_rate(t), t.grad_accum)
  import gpu_aot  # pylint: disable=g-import-not-at-top  (benchmarks/gpu_aot.py: the targets' descriptions)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_aot.DEVICELESS[AOT_TARGETS[target]][1],
                                          topology="1x1x1")
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  sharding = NamedSharding(mesh, PartitionSpec())
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  state = jax.tree.map(place, abstract_train_state(cfg, optimizer))
  batch = {k: place(jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32)) for k in ("inputs", "targets")}
  use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
  # Mosaic GPU kernels compile as a Hopper host runs them: this CPU host's default would interpret them
  # (ltm_pallas.backend.mosaic_gpu_call), and the interpreter's host callbacks cannot be lowered for a GPU.
  from ltm_pallas import backend as kernel_backend  # pylint: disable=g-import-not-at-top
  compiled_kernels = mock.patch.object(kernel_backend, "mosaic_gpu_call", lambda build, interpret: build(False))
  with use_mesh(mesh.abstract_mesh) if use_mesh else contextlib.nullcontext(), compiled_kernels:
    lowered = jax.jit(step).trace(state, batch).lower()
  return lowered.compile(), None, None


# ----------------------------------------------------------------------------------------------------------------
# Output.


def _print(rows: list[dict], columns: list[tuple[str, str, int]]) -> None:
  print("  ".join(f"{title:>{w}}" if i else f"{title:<{w}}" for i, (_, title, w) in enumerate(columns)))
  for r in rows:
    cells = []
    for i, (key, _, w) in enumerate(columns):
      v = r.get(key)
      s = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
      cells.append(f"{s[:w]:>{w}}" if i else f"{s[:w]:<{w}}")
    print("  ".join(cells))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(ROOT / "configs" / "small_rwkv7.py"))
  parser.add_argument("overrides", nargs="*", help="key=value config overrides (e.g. model.remat=minimal)")
  parser.add_argument("--batch", type=int, default=None, help="train.batch_size (default: the config's)")
  parser.add_argument("--seq", type=int, default=None, help="train.seq_len (default: the config's)")
  parser.add_argument("--quick", action="store_true", help="the config at toy sizes (common.toy_config)")
  parser.add_argument("--target", default="auto", choices=("auto", "device", *AOT_TARGETS),
                      help="auto: deviceless H100 where the CUDA plugin is installed and there is no GPU, else the "
                      "default device (a GPU if there is one, else the host CPU)")
  parser.add_argument("--measured-ms", type=float, default=None, help="a measured step time to set the sum against")
  parser.add_argument("--steps", type=int, default=10, help="timed steps on a device (after 2 warm-up steps)")
  parser.add_argument("--profile", type=int, default=0, help="on a device: steps traced after the timed ones, each "
                      "kernel's measured time put beside its prediction (0: none)")
  for key in DEFAULTS:
    parser.add_argument("--" + key.replace("_", "-"), type=float, default=None,
                        help=f"default: the H200's {key} on an H200 or for h200-aot, else the H100's")
  parser.add_argument("--top", type=int, default=25, help="kernels and source lines printed")
  parser.add_argument("--out", default=None, help="results file (default benchmarks/results/step-budget-<config>-"
                      "<device>.json.gz, or under LTM_BENCH_RESULTS; gzipped when the name ends in .gz)")
  args = parser.parse_args(argv)

  target = choose_target(args.target)
  if target in AOT_TARGETS:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax  # pylint: disable=g-import-not-at-top

  cfg = load(args)
  if target in AOT_TARGETS:
    import gpu_aot  # pylint: disable=g-import-not-at-top
    device = target
    device_desc = gpu_aot.DEVICELESS[AOT_TARGETS[target]][0] + ", deviceless"
  else:
    import common  # pylint: disable=g-import-not-at-top
    device, device_desc = common.device_name(), jax.devices()[0].device_kind
  rates = MACHINES[machine(target, device_desc)]
  ceilings = {k: rates[k] if getattr(args, k) is None else getattr(args, k) for k in DEFAULTS}
  print(f"# {cfg.name}: batch {cfg.train.batch_size} x {cfg.train.seq_len}, dtype {cfg.model.dtype}, remat "
        f"{cfg.model.remat}, wkv7_impl {cfg.model.wkv7_impl}; target {device_desc}", flush=True)

  started = time.perf_counter()
  compiled, state, batch = compile_step(cfg, target)
  compile_s = time.perf_counter() - started
  hlo_text = compiled.as_text()
  comps, entry, frames = parse_hlo(hlo_text)
  rows, notes = kernels(comps, entry, frames, ceilings)
  xla_cost = None
  with contextlib.suppress(Exception):
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    xla_cost = {k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in cost}

  memory = None
  with contextlib.suppress(Exception):
    m = compiled.memory_analysis()
    memory = {k: getattr(m, f"{k}_size_in_bytes") / 2**30 for k in ("temp", "argument", "output", "alias")}
  if memory:
    print("# compiled memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in memory.items()), flush=True)

  measured_step, step_times, run_error, timed = args.measured_ms, None, None, {}
  if state is not None:
    try:
      state, _, timed = common.time_train_steps(compiled, state, batch, args.steps)
      measured_step, step_times = timed["step_ms"], timed["step_times_ms"]
    except Exception as e:  # noqa: BLE001  (out of memory, say: the budget of the compiled program still stands)
      run_error = " ".join(f"{type(e).__name__}: {e}".split())[:1000]
      print(f"# the step did not run: {run_error}", flush=True)
  profile = None
  if state is not None and run_error is None and args.profile > 0:
    import kernel_profile  # pylint: disable=g-import-not-at-top
    carried = [state]

    def run_step():
      carried[0], metrics = compiled(carried[0], batch)
      jax.block_until_ready(metrics)

    profile = kernel_profile.measure(run_step, kernel_profile.module_name(hlo_text), args.profile)
    if profile.source == "host" and jax.default_backend() != "cpu":
      notes.append("the trace has no device plane (no CUPTI?): the measured times are the host's launch events, "
                   "not the kernels'")
    for r in rows:  # A row's name is its instruction's, behind the loops and branches it sits in.
      r["measured_ms"] = profile.per_op_ms.get(r["name"].rsplit("/", 1)[-1], 0.0)

  categories = summarize(rows, "category")
  categories.sort(key=lambda g: CATEGORIES.index(g["category"]))
  keys = ("kernels", "gflops", "gbytes", "roofline_ms", "predicted_ms") + (("measured_ms",) if profile else ())
  total = {k: sum(g[k] for g in categories) for k in keys}
  for g in categories:
    g["share"] = g["predicted_ms"] / total["predicted_ms"] if total["predicted_ms"] else 0.0
  passes = summarize([dict(r, **{"pass": "backward" if r["backward"] else "forward/other"}) for r in rows], "pass")
  lines = [r for r in rows if r["where"]]
  by_source = sorted(summarize(lines, "where"), key=lambda g: -g["predicted_ms"])
  top = sorted(rows, key=lambda r: -r["predicted_ms"])

  print(f"# compiled in {compile_s:.1f} s; {len(rows)} kernel instructions, {total['kernels']} launches a step")
  for n in notes[:5]:
    print(f"# note: {n}")
  print("\nper category (ms a step; predicted = max(roofline, kernel benchmark) + launches):")
  measured_col = [("measured_ms", "measured", 9)] if profile else []
  cols = [("category", "category", 20), ("kernels", "kernels", 7), ("gflops", "GFLOP", 9), ("gbytes", "GB", 8),
          ("roofline_ms", "roofline", 9), ("predicted_ms", "predicted", 9), *measured_col, ("share", "share", 6)]
  _print(categories + [{"category": "total", **total, "share": 1.0}], cols)
  profile_summary = None
  if profile:
    matched = sum(1 for r in rows if r["measured_ms"] > 0)
    # Instructions of the step that no row holds: a conditional's branch other than the one the budget counts.
    elsewhere = sum(profile.per_op_ms.values()) - total["measured_ms"]
    profile_summary = {"steps": profile.runs, "source": profile.source, "kernels_ms": total["measured_ms"],
                       "other_instructions_ms": elsewhere, "device_ms": profile.device_ms,
                       "unmatched_ms": profile.unmatched_ms, "rows_measured": matched, "rows": len(rows)}
    device_note = (f"; device busy {profile.device_ms:.2f} ms, of it {profile.unmatched_ms:.2f} ms in no kernel of "
                   "the step" if profile.device_ms is not None else " (host threads: a dry run)")
    print(f"profiled {profile.runs} steps: the budget's kernels measured {total['measured_ms']:.2f} ms a step, "
          f"instructions outside its rows {elsewhere:.2f} ms{device_note}; {matched} of {len(rows)} kernel "
          "instructions seen")
    if profile.idle is not None:  # Where the step's wall time outruns its kernels: many short gaps, or a few stalls.
      gaps = profile.idle
      profile_summary["idle"] = dataclasses.asdict(gaps)
      print(f"device idle between the step's kernels: {gaps.idle_ms:.2f} ms a step (the gaps between steps too); "
            + ", ".join(f"{name} {n:.0f} gaps {ms:.2f} ms" for name, (n, ms) in gaps.buckets.items())
            + "; longest: " + ", ".join(f"{us:.0f} us {before} -> {after}" for us, before, after in gaps.largest[:6]))
  print("by pass: " + ", ".join(f"{g['pass']} {g['predicted_ms']:.2f} ms ({g['kernels']} launches)" for g in passes))
  from ltm_jax.info import model_info  # pylint: disable=g-import-not-at-top
  info = model_info(cfg)
  floor = _floor(categories, total, info["flops_per_step_train"], ceilings["matmul_tflops"])
  print(f"floor: the matmuls and the WKV and attention kernels alone take {floor['ms']:.2f} ms: with every other "
        f"kernel free, at most {floor['max_fraction']:.3f} of the {ceilings['matmul_tflops']:g} TFLOP/s matmul rate "
        f"(predicted {floor['predicted_fraction']:.3f})")
  if measured_step:
    print(f"measured step {measured_step:.2f} ms: predicted {total['predicted_ms']:.2f} ms is "
          f"{total['predicted_ms'] / measured_step:.2f} of it; roofline {total['roofline_ms'] / measured_step:.2f}")
  if timed:
    print(f"pipelined (steps back to back, as the training loop runs them): {timed['step_ms_pipelined']:.2f} ms a "
          f"step; the host enqueues one in {timed['dispatch_ms']:.2f} ms")
  print(f"\ntop {args.top} kernels:")
  kcols = [("name", "instruction", 34), ("category", "category", 18), ("detail", "detail", 22), ("times", "x", 3),
           ("out", "output", 26), ("bound", "bound", 7), ("roofline_ms", "roofline", 8), ("kernel_ms", "kernel", 8),
           ("predicted_ms", "predicted", 9), *measured_col, ("where", "source", 34)]
  _print(top[:args.top], kcols)
  print(f"\ntop {args.top} source lines:")
  _print(by_source[:args.top], [("where", "source", 44), ("kernels", "kernels", 7), ("gbytes", "GB", 8),
                                ("roofline_ms", "roofline", 9), ("predicted_ms", "predicted", 9), *measured_col])

  result = {
      "config": cfg.name, "config_file": args.config, "overrides": args.overrides, "quick": args.quick,
      "device": device, "target": device_desc, "batch": f"{cfg.train.batch_size}x{cfg.train.seq_len}",
      "params": info["params"], "model_flops_per_step": info["flops_per_step_train"],
      "ceilings_of": machine(target, device_desc), "ceilings": ceilings, "compile_s": round(compile_s, 1),
      "xla_cost_analysis": xla_cost, "memory_gib": memory,
      "notes": notes, "total": total, "floor": floor, "measured_step_ms": measured_step, "step_times_ms": step_times,
      "pipelined_step_ms": timed.get("step_ms_pipelined"), "dispatch_ms": timed.get("dispatch_ms"),
      "run_error": run_error, "profile": profile_summary, "categories": categories, "passes": passes,
      "sources": by_source[:100],
      "kernels": [dict(r, op_name=r["op_name"][-160:]) for r in top],
      "packages": {"jax": jax.__version__}, "python": platform.python_version(),
      "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }
  import common  # pylint: disable=g-import-not-at-top  (its RESULTS: LTM_BENCH_RESULTS or benchmarks/results)
  path = pathlib.Path(args.out or common.RESULTS / f"step-budget-{cfg.name}{'-quick' if args.quick else ''}-"
                      f"{device}.json.gz")
  path.parent.mkdir(parents=True, exist_ok=True)
  text = json.dumps(result, indent=1) + "\n"
  if path.suffix == ".gz":  # A row per kernel: 0.3-1.8 MB of JSON, a fortieth of that compressed.
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
  else:
    path.write_text(text)
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
