#!/usr/bin/env python3
"""Compiles the Pallas kernels and whole model programs for an H100 without a GPU, and reports each kernel's
resources: warps, registers, spills, shared memory, grid, an occupancy estimate and the block-wide barriers a trip
of its main loop waits on.

  make gpu-aot                                    # builds .venv-aot, runs every case, writes the results file
  .venv-aot/bin/python benchmarks/gpu_aot.py      # the same; --group kernels|models|controls, --cases REGEX,
                                                  #   --list, --markdown (the table of docs/benchmarks.md), --jobs N
  .venv-aot/bin/python benchmarks/gpu_aot.py --mgpu [--baseline REV]   # the Mosaic GPU kernels (below)

Runs in `.venv-aot` (jax, jaxlib, jax-cuda13-plugin and jax-cuda13-pjrt of one version, and nvidia-cuda-nvcc for
ptxas; the Makefile builds it), never in the main venv: with the CUDA plugin installed a plain `import jax` tries to
start it.

How: JAX's deviceless ahead-of-time path. The CUDA PJRT plugin is given the target description of an H100 SXM
(`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`), arguments are placed on a mesh
of that topology, and `jax.jit(f).trace(...).lower().compile()` runs XLA's whole GPU pipeline, Triton included, to
PTX and cubin. `JAX_PLATFORMS=cpu` and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1` keep the plugin from looking for a GPU and
cuDNN; from jax 0.11 the lowering runs under the topology's abstract mesh, where the Pallas Triton lowering finds its
target. XLA's dump (`--xla_dump_to`, `--xla_dump_emitter_re=ptx`) gives the PTX and the thunk sequence (grid, threads
and dynamic shared memory of every launch); `ptxas -arch=sm_90a -v` on the PTX gives registers, spills and stack;
the PTX itself the `bar.sync` count of each kernel's longest loop (a latency proxy for kernels that walk a sequence).

Cases are `benchmarks/aot_cases.py`: the kernels at their default tiles and at the models' shapes, the models' train
steps and generation, and two controls that must fail (tiles too large for shared memory, tiles that must spill).
Each case compiles in its own process with its own dump directory and timeout, `--jobs` at a time.

Mosaic GPU kernels (`--mgpu`, cases `MGPU_CASES`: the WKV-7 forward and backward, `ltm_pallas.wkv7_mgpu`) compile
inside the CUDA plugin, not through XLA's PTX emitter, so the dump above never holds them. For them the worker sets
MOSAIC_GPU_DUMP_TO, where Mosaic GPU writes ptxas' report (`*.ptxas`: registers, spills, stack) and the kernel's
module before layout inference (`*.before_layout_inference.txt`: the launch's grid, threads and dynamic shared
memory). `--baseline REV` also compiles the kernel file as it was at git revision REV, to compare with (the cases
whose function that file has). Writes benchmarks/results/gpu-aot-h100-wkv7-mgpu.json when every case ran; a current
kernel that spills fails.

Writes benchmarks/results/gpu-aot-h100.json when every case ran (or to --json). Exit status 1 when a case fails to
compile, a kernel is missing from its program, a kernel spills (except in the cases marked as known spills, whose
default settings are listed in ltm_pallas.attention.config.SPILLING_DEFAULTS), or a control does not fail as it must; 2
when the environment lacks the plugin or ptxas.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import glob
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "gpu-aot-h100.json"
MGPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu-aot-h100-wkv7-mgpu.json"
MGPU_KERNEL_FILE = "pallas/wkv7_mgpu.py"

# XLA's GPU target description of an H100 SXM 80GB: sm_90, 132 SMs, 227 KiB of shared memory per block (opt-in).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    minor: 0
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 12
}
runtime_version {
  major: 13
  minor: 0
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TARGET = "NVIDIA H100 80GB HBM3 (sm_90a)"
# An H200 is the same sm_90a chip with more and faster memory (141 GB of HBM3e at 4.8 TB/s): what XLA reads of it is
# the device memory, which bounds its rematerialization of a large program, and the bandwidth.
H200_TARGET_CONFIG = (H100_TARGET_CONFIG.replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 4800000000000")
                      .replace("device_memory_size: 84929347584", "device_memory_size: 150754820096")
                      .replace('"NVIDIA H100 80GB HBM3"', '"NVIDIA H200"'))
H200_TARGET = "NVIDIA H200 (sm_90a)"
# machine -> (its description, XLA's target description of it), for deviceless compilations.
DEVICELESS = {"h100": (TARGET, H100_TARGET_CONFIG), "h200": (H200_TARGET, H200_TARGET_CONFIG)}

# Per-SM limits of sm_90 for the occupancy estimate. Registers are allocated per warp in units of 256; the CUDA
# runtime reserves 1 KiB of shared memory per resident block.
SM90 = {"regs_per_sm": 65536, "reg_unit": 256, "threads_per_sm": 2048, "blocks_per_sm": 32, "smem_per_sm": 233472,
        "smem_reserved_per_block": 1024}
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-nvcc")
RESULT_TAG = "@@AOT-RESULT@@"


# ----------------------------------------------------------------------------------------------------------------
# Worker: one case in this process.


def _h100_mesh():
  """A one-device mesh of the H100 target (no device needed)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
  return topologies.make_mesh(topology, (1,), ("x",))


def _compile(mesh, fn, args, result: dict) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  result["stage"] = "lower"
  # The Pallas Triton lowering of jax >= 0.11 asks the abstract mesh for the target GPU when the process has none.
  use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
  with use_mesh(mesh.abstract_mesh) if use_mesh else contextlib.nullcontext():
    lowered = jax.jit(fn).trace(*args).lower()
  result["stage"] = "compile"
  lowered.compile()
  result.update(stage="done", ok=True)


def _abstract_on(mesh):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  sharding = NamedSharding(mesh, PartitionSpec())
  return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _worker(name: str, block_sizes: str | None) -> int:
  result = {"stage": "setup", "ok": False}
  started = time.time()
  try:
    import aot_cases  # pylint: disable=g-import-not-at-top

    case = aot_cases.all_cases()[name]
    mesh = _h100_mesh()
    tiles = None
    if block_sizes:
      from ltm_pallas.attention import BlockSizes  # pylint: disable=g-import-not-at-top
      tiles = BlockSizes(**json.loads(block_sizes))
    result["stage"] = "build"
    fn, args = case.build(_abstract_on(mesh), block_sizes=tiles)
    _compile(mesh, fn, args, result)
  except Exception as e:  # pylint: disable=broad-except  (reported in the case's row)
    result["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:2000]
  result["seconds"] = round(time.time() - started, 1)
  print(RESULT_TAG + json.dumps(result), flush=True)
  return 0


# ----------------------------------------------------------------------------------------------------------------
# Reading a dump.

_THUNK = re.compile(r"\s(\w+) grid: \[([^\]]*)\] threads: \[([^\]]*)\]\s+shared_memory: (\d+) bytes")


def _launches(dump: str) -> dict[str, dict]:
  """Kernel name -> grid, threads per block and dynamic shared memory, from XLA's thunk sequence."""
  launches = {}
  for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
    with open(path) as f:
      for line in f:
        if m := _THUNK.search(line):
          x, y, z = (int(v) for v in m.group(3).split(","))
          launches.setdefault(m.group(1), {"grid": m.group(2).replace(" ", ""), "threads": x * y * z,
                                           "dyn_smem": int(m.group(4))})
  return launches


def _is_ours(entry: str) -> bool:
  from aot_cases import KERNEL_PREFIXES  # pylint: disable=g-import-not-at-top
  return entry.startswith(KERNEL_PREFIXES)


def _base_name(entry: str) -> str:
  """The kernel's name without the _1, _2, ... XLA appends to copies."""
  return re.sub(r"_\d+$", "", entry)


def loop_barriers(ptx: str) -> dict[str, int]:
  """Entry -> the block-wide barriers (`bar.sync`) in the body of its longest loop, as written in the PTX: a kernel
  that walks its chunks in a serial loop waits on each once per iteration (each stages a tile through shared memory
  between tensor-core products or reductions). Entries without a loop are left out."""
  counts = {}
  for entry, body in re.findall(r"\.entry\s+(\w+)\((.*?)(?=\.entry\s|\Z)", ptx, flags=re.S):
    lines = body.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\$L__\w+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)) and labels.get(m.group(1), i) < i]
    if loops:
      start, end = max(loops, key=lambda span: span[1] - span[0])
      counts[entry] = sum("bar.sync" in line for line in lines[start:end + 1])
  return counts


def _ptxas(ptxas: str, dump: str) -> dict[str, dict]:
  """Entry -> registers, spill stores/loads, stack and static shared memory from `ptxas -v`, and the barriers of its
  longest loop (`loop_barriers`), for every kernel of this package in the dumped PTX."""
  facts = {}
  for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
    with open(path) as f:
      ptx = f.read()
    entries = [e for e in re.findall(r"\.entry\s+(\w+)\(", ptx) if _is_ours(e)]
    if not entries:
      continue
    for entry, count in loop_barriers(ptx).items():
      if _is_ours(entry):
        facts.setdefault(entry, {})["loop_barriers"] = count
    proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    current = None
    for line in (proc.stdout + proc.stderr).splitlines():
      if m := re.search(r"Compiling entry function '(\w+)'", line):
        current = facts.setdefault(m.group(1), {}) if _is_ours(m.group(1)) else None
      elif current is None:
        continue
      elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
        current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
      elif m := re.search(r"Used (\d+) registers", line):
        smem = re.search(r"(\d+) bytes smem", line)
        current.update(registers=int(m.group(1)), static_smem=int(smem.group(1)) if smem else 0)
    if proc.returncode:
      for entry in entries:
        facts.setdefault(entry, {})["error"] = "ptxas: " + ((proc.stderr.strip().splitlines() or ["?"])[-1])
  return facts


def occupancy(registers: int, threads: int, smem: int) -> tuple[int, str]:
  """(resident blocks per SM, what bounds them: registers, threads, smem or blocks) on sm_90."""
  warps = -(-threads // 32)
  unit = SM90["reg_unit"]
  regs_per_warp = -(-max(registers, 1) * 32 // unit) * unit
  limits = {
      "registers": SM90["regs_per_sm"] // (regs_per_warp * warps),
      "threads": SM90["threads_per_sm"] // threads,
      "smem": SM90["smem_per_sm"] // (smem + SM90["smem_reserved_per_block"]) if smem else SM90["blocks_per_sm"],
      "blocks": SM90["blocks_per_sm"],
  }
  bound = min(limits, key=limits.get)
  return limits[bound], bound


# ----------------------------------------------------------------------------------------------------------------
# Parent: one case per subprocess, then its dump.


def _worker_result(cmd: list[str], timeout: float, **env_extra: str) -> dict:
  """The result a compile worker (`cmd`, this file in a subprocess on the CPU platform) printed after RESULT_TAG, or
  a failed result saying why there is none (a crash with the output's tail, or the timeout)."""
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PYTHONDONTWRITEBYTECODE="1",
             TF_CPP_MIN_LOG_LEVEL=env.get("TF_CPP_MIN_LOG_LEVEL", "2"), **env_extra)
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {"ok": False, "stage": "timeout", "error": f"no result within {timeout} s"}
  tagged = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_TAG)]
  if tagged:
    return json.loads(tagged[-1][len(RESULT_TAG):])
  tail = [l for l in (proc.stdout + proc.stderr).splitlines() if l.strip()][-3:]
  return {"ok": False, "stage": "crash", "error": f"worker exited {proc.returncode}: " + " | ".join(tail)}


def _run_case(case, args, ptxas: str, dump_root: str) -> tuple[dict, list[dict]]:
  dump = os.path.join(dump_root, case.name)
  shutil.rmtree(dump, ignore_errors=True)
  os.makedirs(dump)
  xla_flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_emitter_re=ptx".strip()
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", case.name]
  if args.block_sizes:
    cmd += ["--block-sizes", args.block_sizes]
  res = _worker_result(cmd, args.timeout, XLA_FLAGS=xla_flags)

  summary = {"case": case.name, "group": case.group, "description": case.description, "expect": case.expect,
             "seconds": res.get("seconds"), "compiled": bool(res.get("ok")), "stage": res.get("stage"),
             "error": res.get("error")}
  rows = []
  if res.get("ok"):
    launches, facts = _launches(dump), _ptxas(ptxas, dump)
    for entry in sorted(facts, key=lambda e: (_base_name(e), len(e), e)):
      rows.append(_row(case, entry, launches.get(entry), facts[entry]))
    found = {_base_name(r["entry"]) for r in rows}
    summary["missing_kernels"] = [k for k in case.kernels if k not in found]
  if not args.keep_dumps:
    shutil.rmtree(dump, ignore_errors=True)
  summary["status"] = _case_status(summary, rows)
  return summary, rows


def _row(case, entry: str, launch: dict | None, facts: dict) -> dict:
  row = {"case": case.name, "group": case.group, "kernel": _base_name(entry), "entry": entry, "dtype": case.dtype,
         "head_dim": case.head_dim, **{k: v for k, v in facts.items() if k != "static_smem"}}
  return _with_launch(row, launch, facts)


def _with_launch(row: dict, launch: dict | None, facts: dict) -> dict:
  """`row` with the launch's grid, threads and shared memory (dynamic + static), the occupancy they and the
  registers allow, and the spilled bytes (stores + loads)."""
  if launch:
    smem = launch["dyn_smem"] + facts.get("static_smem", 0)
    row.update(grid=launch["grid"], threads=launch["threads"], warps=launch["threads"] // 32, smem=smem)
    if "registers" in facts:
      blocks, bound = occupancy(facts["registers"], launch["threads"], smem)
      row.update(blocks_per_sm=blocks, occupancy_pct=round(100 * blocks * launch["threads"] / SM90["threads_per_sm"]),
                 occupancy_bound=bound)
  row["spills"] = (facts.get("spill_stores") or 0) + (facts.get("spill_loads") or 0)
  return row


def _case_status(summary: dict, rows: list[dict]) -> str:
  """PASS, or FAIL with the reason; for a control, PASS means it failed as it must."""
  spilled = [r["entry"] for r in rows if r["spills"]]
  broken = [f"{r['entry']}: {r['error']}" for r in rows if r.get("error")]
  if summary["expect"] == "compile_error":
    return "PASS (did not compile)" if not summary["compiled"] else "FAIL: compiled, but must not"
  if summary["expect"] == "spill":
    if not summary["compiled"]:
      return f"FAIL: did not compile ({summary['stage']})"
    return f"PASS (spills: {', '.join(spilled)})" if spilled else "FAIL: no kernel spilled, but one must"
  if not summary["compiled"]:
    return f"FAIL: {summary['stage']}: {summary['error']}"
  problems = broken + ([f"missing kernels {summary['missing_kernels']}"] if summary["missing_kernels"] else [])
  if summary["expect"] != "known_spill":
    problems += [f"spills in {', '.join(spilled)}"] if spilled else []
  if problems:
    return "FAIL: " + "; ".join(problems)
  if summary["expect"] == "known_spill":
    return f"PASS (known spill: {', '.join(spilled)})" if spilled else "PASS (no spill any more: drop the row from SPILLING_DEFAULTS)"
  return "PASS"


# ----------------------------------------------------------------------------------------------------------------
# Mosaic GPU kernels (--mgpu).

# name -> (head size N, dtype of the inputs and y, description); inputs [B, T, C / N, N] at B 8, T 4096, C 4096. The
# cases without "_pipe_" compile each chunk's loads before its products (`pipelined=False`, the only form at N = 128);
# those with it overlap them with the previous chunk's products (`pipelined=True`, the default at N = 64). Those with
# "_xbar_" take only the kernel's own barriers (`explicit_barriers=True`) instead of one before and after every
# shared-memory store.
MGPU_CASES = {
    "wkv7_mgpu_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU forward bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU forward bf16 B8 T4096 C4096 N128"),
    "wkv7_mgpu_n128_f32": (128, "float32", "wkv7 Mosaic GPU forward f32 B8 T4096 C4096 N128 (float32 y tile)"),
    "wkv7_mgpu_ckpt_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU forward with chunk states bf16 B8 T4096 C4096 N128"),
    "wkv7_mgpu_bwd_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU backward bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_bwd_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU backward bf16 B8 T4096 C4096 N128"),
    "wkv7_mgpu_bwd_n128_f32": (128, "float32", "wkv7 Mosaic GPU backward f32 B8 T4096 C4096 N128 (float32 dv tile)"),
    "wkv7_mgpu_pipe_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU forward, loads overlapped, bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_pipe_n64_f32": (64, "float32", "wkv7 Mosaic GPU forward, loads overlapped, f32 B8 T4096 C4096 N64 "
                               "(float32 y tile)"),
    "wkv7_mgpu_pipe_ckpt_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU forward with chunk states, loads overlapped, "
                                     "bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_pipe_bwd_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU backward, loads overlapped, bf16 B8 T4096 C4096 "
                                    "N64"),
    "wkv7_mgpu_pipe_bwd_n64_f32": (64, "float32", "wkv7 Mosaic GPU backward, loads overlapped, f32 B8 T4096 C4096 N64 "
                                   "(float32 dv tile)"),
    "wkv7_mgpu_xbar_pipe_n64_f32": (64, "float32", "wkv7 Mosaic GPU forward, loads overlapped, own barriers only, "
                                    "f32 B8 T4096 C4096 N64 (float32 y tile)"),
    "wkv7_mgpu_xbar_pipe_ckpt_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU forward with chunk states, loads "
                                          "overlapped, own barriers only, bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_xbar_pipe_bwd_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU backward, loads overlapped, own barriers "
                                         "only, bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_xbar_pipe_bwd_n64_f32": (64, "float32", "wkv7 Mosaic GPU backward, loads overlapped, own barriers "
                                        "only, f32 B8 T4096 C4096 N64 (float32 dv tile)"),
    "wkv7_mgpu_xbar_bwd_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU backward, own barriers only, bf16 B8 T4096 "
                                     "C4096 N128"),
    # The state-only kernels of the segmented form (`end_states`, `state_gradients`): loads before products.
    "wkv7_mgpu_end_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU end states bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_end_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU end states bf16 B8 T4096 C4096 N128"),
    "wkv7_mgpu_trans_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU transitions (no values) bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_trans_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU transitions (no values) bf16 B8 T4096 C4096 N128"),
    "wkv7_mgpu_sgrad_n64_bf16": (64, "bfloat16", "wkv7 Mosaic GPU state gradients bf16 B8 T4096 C4096 N64"),
    "wkv7_mgpu_sgrad_n128_bf16": (128, "bfloat16", "wkv7 Mosaic GPU state gradients bf16 B8 T4096 C4096 N128"),
}
MGPU_SHAPE = (8, 4096, 4096)  # Batch, tokens, channels.


def _mgpu_entry(name: str) -> str:
  """The kernel function a case compiles: forward, forward with chunk states, backward, end states, transitions or
  state gradients."""
  for mark, entry in (("_bwd_", "backward"), ("_ckpt_", "checkpoints"), ("_end_", "end_states"),
                      ("_trans_", "transitions"), ("_sgrad_", "state_gradients")):
    if mark in name:
      return entry
  return "forward"


def _mgpu_has_entry(kernel_file: str, name: str) -> bool:
  """Whether the kernel module at `kernel_file` has case `name`'s function (a baseline revision may predate the
  backward, the chunk states' output or the overlapped loads)."""
  marks = {"forward": "def forward(", "checkpoints": "checkpoints: bool", "backward": "def backward(",
           "end_states": "def end_states(", "transitions": "def end_states(", "state_gradients": "def state_gradients("}
  text = pathlib.Path(kernel_file).read_text()
  return (marks[_mgpu_entry(name)] in text and ("_pipe_" not in name or "pipelined: bool" in text)
          and ("_xbar_" not in name or "explicit_barriers: bool" in text))


def _mgpu_worker(name: str, kernel_file: str) -> int:
  """Compiles case `name` of MGPU_CASES with the kernel module at `kernel_file` (the current one or a baseline)."""
  result = {"stage": "setup", "ok": False}
  started = time.time()
  try:
    import importlib.util  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    spec = importlib.util.spec_from_file_location("wkv7_mgpu_compiled", kernel_file)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    size, dtype, _ = MGPU_CASES[name]
    batch, length, channels = MGPU_SHAPE
    mesh = _h100_mesh()
    abstract = _abstract_on(mesh)
    inputs = [abstract((batch, length, channels // size, size), jnp.dtype(dtype)) for _ in range(6)]
    state = abstract((batch, channels // size, size, size), jnp.float32)
    result["stage"] = "build"
    entry = _mgpu_entry(name)

    def chunk_residuals(residuals_type):
      """The forward's residuals as `residuals_type` (`Residuals`) builds them, or (a baseline without them) the
      chunk states alone."""
      states = abstract((batch, channels // size, length // kernel.CHUNK, size, size), jnp.bfloat16)
      if residuals_type is None:
        return states
      decayed = (abstract(inputs[0].shape, jnp.bfloat16) for _ in range(4))
      return residuals_type(states, *decayed, abstract(inputs[0].shape, jnp.float32))

    # The form the case names, where the file has both (an older one has only the loads before the products).
    text = pathlib.Path(kernel_file).read_text()
    form = {"pipelined": "_pipe_" in name} if "pipelined: bool" in text else {}
    if "explicit_barriers: bool" in text:
      form["explicit_barriers"] = "_xbar_" in name
    if entry in ("end_states", "transitions"):
      values = entry == "end_states"
      fn = lambda w, k, v, a, b, s: kernel.end_states(w, k if values else None, v if values else None, a, b, s,
                                                      interpret=False)
      _compile(mesh, fn, (*inputs[1:], state), result)
    elif entry == "state_gradients" and hasattr(kernel, "Residuals"):  # The forward's residuals, dy, ds.
      fn = lambda residuals, dy, ds: kernel.state_gradients(residuals, dy, ds, interpret=False)
      _compile(mesh, fn, (chunk_residuals(kernel.Residuals), inputs[0], state), result)
    elif entry == "state_gradients":  # r, w, a, b, dy and the leaving state's gradient.
      fn = lambda r, w, a, b, dy, ds: kernel.state_gradients(r, w, a, b, dy, ds, interpret=False)
      _compile(mesh, fn, (*inputs[:2], *inputs[4:6], inputs[0], state), result)
    elif entry == "backward":  # Inputs, the forward's residuals (or chunk states), dy and the final state's gradient.
      ckpt = chunk_residuals(getattr(kernel, "Residuals", None))
      fn = lambda r, w, k, v, a, b, c, dy, ds: kernel.backward(r, w, k, v, a, b, c, dy, ds, interpret=False, **form)
      _compile(mesh, fn, (*inputs, ckpt, inputs[0], state), result)
    else:
      fn = lambda r, w, k, v, a, b, s: kernel.forward(r, w, k, v, a, b, s, interpret=False, **form,
                                                      **({"checkpoints": True} if entry == "checkpoints" else {}))
      _compile(mesh, fn, (*inputs, state), result)
  except Exception as e:  # pylint: disable=broad-except  (reported in the case's row)
    result["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:2000]
  result["seconds"] = round(time.time() - started, 1)
  print(RESULT_TAG + json.dumps(result), flush=True)
  return 0


_LAUNCH = re.compile(r"gpu\.launch .*?blocks\([^)]*\) in \(([^)]*)\) threads\([^)]*\) in \(([^)]*)\)"
                     r" dynamic_shared_memory_size %c(\d+)_i32")


def _mgpu_facts(dump: str) -> dict:
  """Registers, spills and stack from ptxas' report, the barriers of the kernel's longest loop (`loop_barriers`: one
  chunk) from its PTX, and grid, threads and dynamic shared memory from the launch, in a Mosaic GPU dump directory
  holding one kernel."""
  facts = {}
  for path in glob.glob(os.path.join(dump, "*.ptx")):
    counts = loop_barriers(pathlib.Path(path).read_text())
    if counts:
      facts["loop_barriers"] = max(counts.values())
  for path in glob.glob(os.path.join(dump, "*.ptxas")):
    text = pathlib.Path(path).read_text()
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text):
      facts.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    if m := re.search(r"Used (\d+) registers", text):
      facts["registers"] = int(m.group(1))
    if m := re.search(r"Used \d+ registers.*?(\d+) bytes smem", text):
      facts["static_smem"] = int(m.group(1))
  for path in glob.glob(os.path.join(dump, "*.before_layout_inference.txt")):
    if m := _LAUNCH.search(pathlib.Path(path).read_text()):
      sizes = lambda text: [int(v) for v in re.findall(r"= %c(\d+)", text)]
      grid, threads = sizes(m.group(1)), sizes(m.group(2))
      facts.update(grid=",".join(map(str, grid)), threads=threads[0] * threads[1] * threads[2],
                   dyn_smem=int(m.group(3)))
  return facts


def _run_mgpu_case(name: str, variant: str, kernel_file: str, args, dump_root: str) -> tuple[dict, list[dict]]:
  dump = os.path.join(dump_root, f"{name}-{variant.split()[0]}")
  shutil.rmtree(dump, ignore_errors=True)
  os.makedirs(dump)
  cmd = [sys.executable, os.path.abspath(__file__), "--mgpu-worker", name, "--kernel-file", kernel_file]
  res = _worker_result(cmd, args.timeout, MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTXAS="1")
  size, dtype, description = MGPU_CASES[name]
  summary = {"case": name, "group": "mgpu", "variant": variant, "description": description,
             "seconds": res.get("seconds"), "compiled": bool(res.get("ok")), "stage": res.get("stage"),
             "error": res.get("error")}
  rows = []
  if res.get("ok"):
    facts = _mgpu_facts(dump)
    kernel = "wkv7_mgpu_backward" if _mgpu_entry(name) == "backward" else "wkv7_mgpu"
    row = {"case": name, "group": "mgpu", "variant": variant, "kernel": kernel, "entry": kernel,
           "dtype": dtype, "head_dim": size, **{k: v for k, v in facts.items() if k not in ("static_smem", "dyn_smem",
                                                                                          "threads", "grid")}}
    rows.append(_with_launch(row, facts if "dyn_smem" in facts else None, facts))
  if not args.keep_dumps:
    shutil.rmtree(dump, ignore_errors=True)
  if not summary["compiled"]:
    summary["status"] = f"FAIL: {summary['stage']}: {summary['error']}"
  elif not rows or "registers" not in rows[0] or "smem" not in rows[0]:
    summary["status"] = "FAIL: no ptxas report or launch in the Mosaic GPU dump"
  elif rows[0]["spills"] and variant == "current":
    summary["status"] = f"FAIL: spills {rows[0]['spills']} B"
  else:
    summary["status"] = "PASS" + (f" (spills {rows[0]['spills']} B)" if rows[0]["spills"] else "")
  return summary, rows


def _mgpu_main(args, versions: dict, ptxas_version: list[str]) -> int:
  """--mgpu: the Mosaic GPU cases, for the current kernel file and, with --baseline REV, the file at REV."""
  names = [n for n in MGPU_CASES if args.cases is None or re.search(args.cases, n)]
  if not names:
    print(f"gpu_aot: no Mosaic GPU case matches {args.cases!r}", file=sys.stderr)
    return 2
  if args.list:
    for n in names:
      print(f"{n:<26} mgpu      {MGPU_CASES[n][2]}")
    return 0
  dump_root = args.keep_dumps or tempfile.mkdtemp(prefix="gpu-aot-mgpu-")
  variants = [("current", str(ROOT / MGPU_KERNEL_FILE))]
  if args.baseline:
    source = subprocess.run(["git", "show", f"{args.baseline}:{MGPU_KERNEL_FILE}"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    baseline_file = os.path.join(dump_root, "wkv7_mgpu_baseline.py")
    pathlib.Path(baseline_file).write_text(source)
    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    variants.insert(0, (f"baseline {commit}", baseline_file))
  print(f"# target {TARGET}; {versions}; ptxas {ptxas_version[-1] if ptxas_version else '?'}")
  print("# Mosaic GPU kernels; smem = dynamic (launch) + static (ptxas) shared memory per block")
  started = time.time()
  jobs = [(n, v, f) for v, f in variants for n in names if v == "current" or _mgpu_has_entry(f, n)]
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
    done = list(pool.map(lambda job: _run_mgpu_case(*job, args, dump_root), jobs))
  if not args.keep_dumps:
    shutil.rmtree(dump_root, ignore_errors=True)
  summaries = [s for s, _ in done]
  rows = [r for _, case_rows in done for r in case_rows]
  elapsed = round(time.time() - started, 1)
  print(f"{'variant':<16}  " + "  ".join(f"{title:<{width}}" for _, title, width in _COLUMNS))
  for r in rows:
    values = [r.get(key) for key, _, _ in _COLUMNS]
    cells = (f"{'-' if v is None else v!s:<{w}}" for v, (_, _, w) in zip(values, _COLUMNS))
    print(f"{r['variant']:<16}  " + "  ".join(cells))
  print()
  for s in summaries:
    print(f"{s['variant']:<16}  {s['case']:<26}  {s['seconds'] or 0:>6.1f} s  {s['status']}")
  failed = [f"{s['case']} ({s['variant']})" for s in summaries if not s["status"].startswith("PASS")]
  print(f"# {len(summaries)} compilations in {elapsed} s: " + (f"FAILED {', '.join(failed)}" if failed else "all pass"))
  path = args.json or (str(MGPU_RESULTS) if args.cases is None else None)
  if path:
    with open(path, "w") as f:
      json.dump({
          "target": TARGET, "packages": versions, "ptxas": ptxas_version[-1] if ptxas_version else None,
          "python": platform.python_version(), "host_cpus": os.cpu_count(), "jobs": args.jobs,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "kernel_file": MGPU_KERNEL_FILE, "shape": {"batch": MGPU_SHAPE[0], "tokens": MGPU_SHAPE[1],
                                                     "channels": MGPU_SHAPE[2]},
          "note": "deviceless sm_90a compile facts (ptxas -v and the launch); nothing ran on a GPU",
          "seconds": elapsed, "passed": not failed, "failed": failed, "cases": summaries, "kernels": rows,
      }, f, indent=1)
      f.write("\n")
    print(f"# wrote {path}")
  return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------------
# Output.

_COLUMNS = [("kernel", "kernel", 23), ("case", "case", 26), ("dtype", "dtype", 8), ("head_dim", "D", 4),
            ("warps", "warps", 5), ("registers", "regs", 4), ("spills", "spill B", 7), ("smem", "smem B", 7),
            ("occupancy_pct", "occ%", 4), ("occupancy_bound", "bound", 9), ("grid", "grid", 12),
            ("loop_barriers", "bar/loop", 8)]


def _print_rows(rows: list[dict], summaries: list[dict]) -> None:
  print("  ".join(f"{title:<{width}}" for _, title, width in _COLUMNS))
  for r in rows:
    values = [r["entry"] if key == "kernel" else r.get(key) for key, _, _ in _COLUMNS]
    line = "  ".join(f"{'-' if v is None else v!s:<{w}}" for v, (_, _, w) in zip(values, _COLUMNS))
    print(line + ("  SPILLS" if r["spills"] else "") + (f"  {r['error']}" if r.get("error") else ""))
  print()
  for s in summaries:
    print(f"{s['case']:<26}  {s['seconds'] or 0:>6.1f} s  {s['status']}")


def markdown(rows: list[dict]) -> str:
  """The kernel table of docs/benchmarks.md: one line per kernel of the kernel cases (model programs repeat the same
  kernels)."""
  lines = ["| kernel | case | dtype | D | warps | registers | spills (B) | smem (KiB) | grid | occupancy | barriers a "
           "loop trip |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["group"] != "kernels":
      continue
    smem = "-" if r.get("smem") is None else f"{r['smem'] / 1024:.0f}"
    occ = "-" if r.get("occupancy_pct") is None else f"{r['occupancy_pct']}% ({r['occupancy_bound']})"
    lines.append(f"| {r['kernel']} | {r['case']} | {r['dtype']} | {r['head_dim'] or '-'} | {r.get('warps', '-')} | "
                 f"{r.get('registers', '-')} | {r['spills']} | {smem} | {r.get('grid', '-')} | {occ} | "
                 f"{r.get('loop_barriers', '-')} |")
  return "\n".join(lines)


def _find_ptxas(explicit: str | None) -> str | None:
  if explicit:
    return explicit
  import site  # pylint: disable=g-import-not-at-top
  for root in site.getsitepackages() + [site.getusersitepackages()]:
    for pattern in ("nvidia/cu13/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas", "nvidia/cu12/bin/ptxas"):
      if hits := glob.glob(os.path.join(root, pattern)):
        return hits[0]
  return shutil.which("ptxas")


def _versions() -> dict[str, str]:
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return versions


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--group", default="all", help="all, or a comma list of kernels, models, controls")
  parser.add_argument("--cases", default=None, help="regex over case names (within --group)")
  parser.add_argument("--jobs", type=int, default=2, help="cases compiled at once")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per case")
  parser.add_argument("--json", default=None, help=f"results file (default: {RESULTS.relative_to(ROOT)} when every "
                      "case ran, else none)")
  parser.add_argument("--markdown", action="store_true", help="also print the kernel table of docs/benchmarks.md")
  parser.add_argument("--block-sizes", default=None,
                      help="attention settings for every attention case (controls keep theirs), as BlockSizes "
                      'fields in JSON, e.g. \'{"dkv_k": 32, "dkv_warps": 4}\'')
  parser.add_argument("--keep-dumps", default=None, help="keep the XLA dumps (PTX, HLO, Triton IR) under this dir")
  parser.add_argument("--ptxas", default=None)
  parser.add_argument("--list", action="store_true")
  parser.add_argument("--mgpu", action="store_true", help="the Mosaic GPU kernels (MGPU_CASES) instead of the cases of "
                      "aot_cases; --cases, --jobs, --json, --keep-dumps, --list apply")
  parser.add_argument("--baseline", default=None, help="with --mgpu: also compile the kernel file at this git revision")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--mgpu-worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--kernel-file", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # This process never needs a device; with the plugin, never start it.
  if args.worker:
    return _worker(args.worker, args.block_sizes)
  if args.mgpu_worker:
    return _mgpu_worker(args.mgpu_worker, args.kernel_file)

  if args.mgpu and args.list:
    return _mgpu_main(args, {}, [])
  if not args.mgpu:
    import aot_cases  # pylint: disable=g-import-not-at-top
    groups = {"kernels", "models", "controls"} if args.group == "all" else set(args.group.split(","))
    cases = [c for c in aot_cases.all_cases().values()
             if c.group in groups and (args.cases is None or re.search(args.cases, c.name))]
    if not cases:
      print(f"gpu_aot: no case in groups {sorted(groups)} matches {args.cases!r}", file=sys.stderr)
      return 2
    if args.list:
      for c in cases:
        print(f"{c.name:<26} {c.group:<9} {c.description}")
      return 0
  versions = _versions()
  if "jax-cuda13-plugin" not in versions:
    print("gpu_aot: jax-cuda13-plugin is not installed in this Python (run `make gpu-aot`, which builds .venv-aot)",
          file=sys.stderr)
    return 2
  ptxas = _find_ptxas(args.ptxas)
  if not ptxas:
    print("gpu_aot: ptxas not found (pip install --no-deps nvidia-cuda-nvcc, or pass --ptxas)", file=sys.stderr)
    return 2
  ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
  if args.mgpu:
    return _mgpu_main(args, versions, ptxas_version)
  print(f"# target {TARGET}; {versions}; ptxas {ptxas_version[-1] if ptxas_version else '?'}")
  print(f"# {len(cases)} cases, {args.jobs} at a time; smem = dynamic (XLA launch) + static (ptxas) shared memory per "
        "block; occ% = resident threads / 2048 per SM, an estimate")

  started = time.time()
  dump_root = args.keep_dumps or tempfile.mkdtemp(prefix="gpu-aot-")
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
    done = list(pool.map(lambda c: _run_case(c, args, ptxas, dump_root), cases))
  if not args.keep_dumps:
    shutil.rmtree(dump_root, ignore_errors=True)
  summaries = [s for s, _ in done]
  rows = [r for _, case_rows in done for r in case_rows]
  elapsed = round(time.time() - started, 1)

  _print_rows(rows, summaries)
  failed = [s["case"] for s in summaries if not s["status"].startswith("PASS")]
  print(f"# {len(summaries)} cases, {len(rows)} kernels in {elapsed} s: "
        + (f"FAILED {', '.join(failed)}" if failed else "all pass"))
  if args.markdown:
    print("\n" + markdown(rows))

  everything = args.group == "all" and args.cases is None and not args.block_sizes
  path = args.json or (str(RESULTS) if everything else None)
  if path:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
      json.dump({
          "target": TARGET, "packages": versions, "ptxas": ptxas_version[-1] if ptxas_version else None,
          "python": platform.python_version(), "host_cpus": os.cpu_count(), "jobs": args.jobs,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "seconds": elapsed, "passed": not failed, "failed": failed, "cases": summaries, "kernels": rows,
      }, f, indent=1)
      f.write("\n")
    print(f"# wrote {path}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
