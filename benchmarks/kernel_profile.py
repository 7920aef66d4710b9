"""The measured time of each kernel of a compiled program: runs it under `jax.profiler` and sums the trace's events by
the HLO instruction they execute, so that a step budget's predicted rows (benchmarks/step_budget.py) get measured
times beside them.

    profile = kernel_profile.measure(run_one_step, module="jit_step", runs=3)
    profile.per_op_ms["loop_add_fusion.32"]   # ms per run of that instruction's kernels

Every event XLA's runtime records for an instruction carries the stats `hlo_op` (the instruction's name) and
`hlo_module` (its module's). On a GPU the trace's device planes hold one event per kernel execution on its stream
(CUPTI; XLA runs a command buffer's kernels one at a time while a profiler is active, so each keeps its annotation):
an instruction's time is the sum of its events, and the device time of events that name no instruction of the module
(copies between host and device, other programs) is reported as unmatched. On the host (the CPU backend) an
instruction is one event on the executor's thread, and its parallel parts repeat it on worker threads: there the
thread on which it took longest counts, and no device total is given. A dry run of the plumbing, not a CPU profiler.

Programs are told apart by their module names, which jit takes from the function's (`jit_step`): trace only the
program measured, or others named otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable

import jax


GAP_BUCKETS_US = (5.0, 20.0, 100.0)  # Idle gaps by length: launch latency, launch-bound stretches, stalls.


@dataclasses.dataclass(frozen=True)
class Idle:
  """When the device ran none of the module's kernels, from the first of its kernels to the last over all runs (so
  the runs - 1 gaps between runs are in it; each shows as a largest gap from the step's last kernel to its first).

  idle_ms: ms per run; buckets: per GAP_BUCKETS_US bucket ("<5us", "5-20us", "20-100us", ">=100us"), the gaps per
  run and their ms per run; largest: the longest gaps, (us, the instruction before, the instruction after)."""
  idle_ms: float
  buckets: dict[str, tuple[float, float]]
  largest: list[tuple[float, str, str]]


def idle(intervals: list[tuple[int, int, str]], runs: int, top: int = 12) -> Idle:
  """The Idle of kernels that ran over `intervals` (start_ns, end_ns, instruction), on any streams: the gaps of their
  union (kernels that overlap on two streams are busy time once)."""
  bounds = [f"<{GAP_BUCKETS_US[0]:g}us"] + [f"{a:g}-{b:g}us" for a, b in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])]
  names = bounds + [f">={GAP_BUCKETS_US[-1]:g}us"]
  counts, total_ns, gaps = [0] * len(names), [0] * len(names), []
  end, last_op = None, ""
  for start, stop, op in sorted(intervals):
    if end is not None and start > end:
      gap = start - end
      bucket = sum(gap >= us * 1e3 for us in GAP_BUCKETS_US)
      counts[bucket] += 1
      total_ns[bucket] += gap
      gaps.append((gap / 1e3, last_op, op))
    if end is None or stop > end:
      end, last_op = stop, op
  largest = sorted(gaps, key=lambda g: -g[0])[:top]
  return Idle(sum(total_ns) / runs / 1e6, {n: (c / runs, ns / runs / 1e6) for n, c, ns in zip(names, counts, total_ns)},
              largest)


@dataclasses.dataclass(frozen=True)
class Profile:
  """per_op_ms: instruction name -> ms per run. source: "device" (GPU stream events) or "host". device_ms: all device
  events' ms per run, unmatched_ms: those naming no instruction of the module, idle: when none of the module's
  kernels ran (None on the host)."""
  per_op_ms: dict[str, float]
  source: str
  runs: int
  device_ms: float | None = None
  unmatched_ms: float | None = None
  idle: Idle | None = None


def module_name(hlo_text: str) -> str:
  """The module name an optimized HLO text declares (`HloModule jit_step, ...`), which its events carry."""
  match = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text)
  if match is None:
    raise ValueError("kernel_profile: the HLO text declares no module name")
  return match.group(1)


def measure(run: Callable[[], object], module: str, runs: int = 3, trace_dir: str | None = None) -> Profile:
  """Traces `runs` calls of `run` (each must block until its results are ready; warm it up first, so no compilation
  is traced) and returns the instructions of `module` with their time per run. The trace is written to `trace_dir`
  (for TensorBoard's profile plugin), else to a temporary folder that is removed."""
  if runs < 1:
    raise ValueError(f"kernel_profile: runs must be at least 1; got {runs}")
  with tempfile.TemporaryDirectory() as scratch:
    folder = trace_dir or scratch
    with jax.profiler.trace(folder):
      for _ in range(runs):
        run()
    paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not paths:
      raise RuntimeError(f"kernel_profile: the profiler wrote no trace under {folder}")
    return read(max(paths, key=os.path.getmtime), module, runs)


def read(path: str, module: str, runs: int) -> Profile:
  """The Profile of `module` in the trace file `path` (an .xplane.pb) covering `runs` runs (module docstring)."""
  data = jax.profiler.ProfileData.from_file(path)
  device = [p for p in data.planes if p.name.startswith("/device:")]
  planes = device or [p for p in data.planes if p.name.startswith("/host:")]
  per_op = collections.Counter()
  total = unmatched = 0.0
  intervals = []
  for plane in planes:
    lines = list(plane.lines)
    if device:  # Kernel executions lie on the stream lines; other lines (if any) summarise them again.
      lines = [line for line in lines if line.name.startswith("Stream")] or lines
    for line in lines:
      on_line = collections.Counter()
      for event in line.events:
        stats = dict(event.stats)
        op, owner = stats.get("hlo_op"), stats.get("hlo_module")
        total += event.duration_ns
        if op is None or owner != module:
          unmatched += event.duration_ns
          continue
        on_line[op] += event.duration_ns
        intervals.append((event.start_ns, event.end_ns, op))
      for op, ns in on_line.items():
        per_op[op] = per_op[op] + ns if device else max(per_op[op], ns)
  per_run = lambda ns: ns / runs / 1e6
  return Profile({op: per_run(ns) for op, ns in per_op.items()}, "device" if device else "host", runs,
                 per_run(total) if device else None, per_run(unmatched) if device else None,
                 idle(intervals, runs) if device else None)
