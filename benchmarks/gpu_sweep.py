"""Runs every benchmark sweep on a GPU, peers included where importable, and writes one summary of the run.

  python benchmarks/gpu_sweep.py                          # everything, most valuable first (see --list for estimates)
  python benchmarks/gpu_sweep.py --part 1                 # one of PARTS, each estimated to fit a 10-minute command
  python benchmarks/gpu_sweep.py --resume --deadline 560  # what has not run yet, stopping in time for a 600 s limit
  python benchmarks/gpu_sweep.py --only wkv7 train-small  # a subset, in the default order
  python benchmarks/gpu_sweep.py --plan rwkv7-step --deadline 540  # a named selection (PLANS), in its own order
  python benchmarks/gpu_sweep.py --quick                  # tiny shapes (CPU dry run): every script end to end
  python benchmarks/gpu_sweep.py --list                   # the benchmarks, their parts, estimates and commands

Each benchmark is its script run as a subprocess (its own process, so one that crashes, runs out of memory or hangs
costs only itself) with a timeout; its exit status, time, results file and the tail of its output go into
benchmarks/results/gpu-sweep-<device>.json (gpu-sweep-quick-<device>.json with --quick) and its full output into
--log-dir. A first subprocess (--probe) measures the copy bandwidth and bf16 matmul rate (common.measure_ceilings), the
versions (jax, jaxlib, torch, triton) and which peers import (peers.py); this process itself never imports JAX, so
it holds no GPU memory while the benchmarks run.

The summary is rewritten after every benchmark and merged with the one already there: a sweep split over several
commands (--part, --only, --resume) adds up to one summary. --resume skips what is ok or failed in it and reruns what
never ran or was stopped by --deadline. --archive writes the summary, every results file it names and their logs
into one .tar.gz after every benchmark, for a machine that hands back only the files of one folder; --merge unpacks
such an archive into this checkout and merges its summary, so that the next command's --resume knows what ran. (A
device call that copies the checkout afresh drops the summary an earlier call wrote there: merge that call's archive
here first, or name what is left with --only.)

--wheels DIR installs the wheels of DIR (peers.py --download) into a folder of its own with pip --no-index --no-deps
and puts it on the benchmarks' PYTHONPATH: the GPU image lacks the peers and some of ltm_jax's imports, and reaches
no package index.

Testing hook: LTM_SWEEP_FAIL="name ..." passes those benchmarks a bogus flag, so they fail as a broken script would.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_LOGS = ROOT / "runs" / "gpu-sweep"
SITE = pathlib.Path("/tmp/ltm-sweep-site")  # Where --wheels installs.
QUICK_TIMEOUT_S = 300
TAIL_CHARS = 3000
FORCED_FAILURE_FLAG = "--sweep-forced-failure"  # No script defines it: argparse exits 2.
# JAX takes 75% of the GPU's memory at its first allocation by default; the scripts that also run PyTorch peers in
# the same process (or the official rwkv package in a child) need room beside it.
SHARE_GPU = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
RESULTS_SUFFIXES = (".json", ".json.gz")  # The step budget gzips its row per kernel.


@dataclasses.dataclass(frozen=True)
class Bench:
  """One sweep: `script` with `gpu_args` (or `quick_args` with --quick), writing results/<stem>-<device>.json.

  estimate_s is a guess for one H100 (compile included) that groups the benchmarks into parts and lets --deadline
  stop before a benchmark that would not fit; timeout_s bounds a run (with --deadline, also the time left)."""
  name: str
  script: str
  gpu_args: tuple[str, ...]
  quick_args: tuple[str, ...]
  stem: str
  quick_stem: str
  part: int
  estimate_s: int
  timeout_s: int = 540
  env: tuple[tuple[str, str], ...] = ()

  def args(self, quick: bool) -> tuple[str, ...]:
    return self.quick_args if quick else self.gpu_args

  def results_stem(self, quick: bool) -> str:
    return self.quick_stem if quick else self.stem


def _train(config: str, part: int, estimate_s: int, variants: tuple[str, ...] = ("",)) -> Bench:
  """train.py --mfu on `config`'s variants (the dry run takes the same: each must run off a GPU too)."""
  name = f"train-{config}"
  args = ("--config", f"configs/{config}.py", "--name", name, *(a for v in variants for a in ("--variant", v)), "--mfu")
  return Bench(name, "train.py", args, args + ("--quick",), name, f"{name}-quick", part, estimate_s)


def _attention(head_dim: int, part: int, estimate_s: int) -> Bench:
  name = f"attention-d{head_dim}"
  # One head dimension per run: the full GPU sweep (5 lengths x 2 masks x 2 head dims x 7 backends) would not fit
  # one 10-minute command. The quick run has a single tiny head dimension of its own.
  return Bench(name, "attention.py", ("--shapes", "gpu", "--head-dims", str(head_dim), "--name", name),
               ("--quick", "--name", f"{name}-quick"), name, f"{name}-quick", part, estimate_s,
               env=tuple(SHARE_GPU.items()))


# The chunked WKV-7 backward's launch settings worth timing at RWKV-7's head size 64 (benchmarks/wkv7.py --layouts):
# as tabulated; value blocks of 32 as programs of 4 warps (two a SM) or of 8; blocks of 16 looping on 4 warps; and
# 32-token chunks (blocks of 16 looping on 8 warps: the one such backward that compiles for sm_90a without spills).
WKV7_BACKWARD_LAYOUTS = (
    "default", "backward_block=32,backward_warps=4,backward_loop=0", "backward_block=32,backward_warps=8",
    "backward_block=16,backward_warps=4,backward_loop=1",
    "chunk=32,forward_block=32,backward_block=16,backward_warps=8,backward_loop=1")


# The default order, most valuable first: the kernels against their peers (RWKV-7, then attention), training
# throughput (MFU) of the shipped GPU configs, then the RWKV-4 kernel and decoding.
BENCHMARKS = (
    Bench("wkv7", "wkv7.py", ("--shapes", "gpu"), ("--quick",), "wkv7", "wkv7-quick", 1, 180,
          env=tuple(SHARE_GPU.items())),
    _attention(64, 1, 240),
    _attention(128, 2, 240),
    _train("base_125m", 2, 90),
    # As shipped, and with the norm + token-shift mixes' backward as its Pallas kernel (`auto` took it before an H200
    # timed it). The Mosaic GPU variants (model.wkv7_impl=pallas_mgpu, model.ffn_impl=pallas_mgpu), timed no faster on
    # an H200, cost 40-80 s of compilation each: run them with train.py --variant when their kernels change.
    _train("small_rwkv7", 3, 120, variants=("", "model.norm_mix_impl=pallas")),
    _train("small", 3, 100),
    # What a latent step costs against a plain step of the same decoder (configs/ltm_code.py): as shipped (z in the
    # top block, encoder + 2 inner steps) and with z in every block.
    Bench("latent-cost", "latent.py",
          ("cost", "--variant", "", "--variant", "latent.top_layers=null,latent.n_per_layer=2", "--rounds", "30"),
          ("cost", "--config", "configs/tiny.py", "--variant", "latent.enabled=true,latent.inner_steps=1", "--rounds", "1",
           "--name", "latent-cost-quick"), "latent-cost-code", "latent-cost-quick", 5, 150),
    # `scan` (the sequential reference, ~30x slower than pallas on a GPU) stays the error baseline but is not timed:
    # timing it at 65536 tokens ran the H100 sweep of 2026-11-25 out of time.
    Bench("wkv4", "wkv.py", ("--shapes", "gpu", "--impls", "associative", "pallas"), ("--quick",), "wkv4",
          "wkv4-quick", 5, 240,
          env=tuple(SHARE_GPU.items())),
    # decode.py's sizes are one RWKV-World-sized model per mixer (its "cpu" plan); the official rwkv package runs on
    # the GPU too. Split by section: a partial run writes decode-<sections>-<device>.json.
    Bench("decode-position", "decode.py", ("--sections", "position"), ("--quick", "--sections", "position"),
          "decode-position", "decode-quick-position", 4, 150),
    Bench("decode-rest", "decode.py", ("--sections", "batch", "dtype", "official", "--official-strategy", "cuda fp32"),
          ("--quick", "--sections", "batch", "dtype", "official"), "decode-batch-dtype-official",
          "decode-quick-batch-dtype-official", 4, 180, env=tuple(SHARE_GPU.items())),
    # The RWKV-7 step's own measurements (PLANS["rwkv7-step"] runs them with the configs' steps above).
    # The norm + token-shift mixes' backward at small_rwkv7's and base_125m_rwkv7's shapes: XLA's derivative against
    # the Pallas kernel at its launch settings, gradients checked against XLA's.
    Bench("norm-mix", "norm_mix.py", (), ("--shapes", "tiny"), "norm-mix", "norm-mix-quick", 7, 120,
          env=tuple(SHARE_GPU.items())),
    _train("base_125m_rwkv7", 6, 150, variants=("", "model.norm_mix_impl=pallas")),
    # Each kernel of small_rwkv7's step measured beside the deviceless budget's prediction (benchmarks/kernel_profile
    # .py). Without command buffers: the profiler then attributes every kernel to its HLO instruction.
    Bench("step-budget-small_rwkv7", "step_budget.py", ("--config", "configs/small_rwkv7.py", "--profile", "3"),
          ("--config", "configs/small_rwkv7.py", "--quick", "--profile", "1"), "step-budget-small_rwkv7",
          "step-budget-small_rwkv7-quick", 6, 90, env=(("XLA_FLAGS", "--xla_gpu_enable_command_buffer="),)),
    # The same for base_125m (attention): its attention kernels' measured time against their FLOPs' price.
    Bench("step-budget-base_125m", "step_budget.py", ("--config", "configs/base_125m.py", "--profile", "2"),
          ("--config", "configs/base_125m.py", "--quick", "--profile", "1"), "step-budget-base_125m",
          "step-budget-base_125m-quick", 6, 100, env=(("XLA_FLAGS", "--xla_gpu_enable_command_buffer="),)),
    # The Mosaic GPU WKV-7 kernels' forms at small_rwkv7's layer shape (and N = 128): loads serial or overlapped,
    # Pallas' barriers or the kernels' own; every form's outputs against the first's (a race shows as a difference).
    Bench("wkv7-mgpu-forms", "wkv7.py",
          ("--mode", "mgpu", "--shape", "32,1024,512,64", "--runs", "10", "--name", "wkv7-mgpu-forms"),
          ("--mode", "mgpu", "--shape", "1,128,128,64", "--runs", "1", "--name", "wkv7-mgpu-forms-quick"),
          "wkv7-mgpu-forms", "wkv7-mgpu-forms-quick", 7, 150, env=tuple(SHARE_GPU.items())),
    # The chunked WKV-7 backward's launch settings at small_rwkv7's and base_125m_rwkv7's layer shapes, among them
    # 32-token chunks (exact under RWKV-7's decay bound); gradients checked against XLA's chunked form.
    Bench("wkv7-backward-layouts", "wkv7.py",
          ("--mode", "backward", "--shape", "32,1024,512,64", "--name", "wkv7-backward-layouts", "--layouts",
           *WKV7_BACKWARD_LAYOUTS),
          ("--mode", "backward", "--shape", "1,64,128,64", "--runs", "1", "--name", "wkv7-backward-layouts-quick",
           "--layouts", *WKV7_BACKWARD_LAYOUTS[:2]), "wkv7-backward-layouts", "wkv7-backward-layouts-quick", 6, 120,
          env=tuple(SHARE_GPU.items())),
)
BY_NAME = {b.name: b for b in BENCHMARKS}
PARTS = sorted({b.part for b in BENCHMARKS})
# Named selections for one lent device session, most valuable first (--plan; --resume --plan runs what is left).
PLANS = {
    # RWKV-7's and attention's training rate against the matmul rate: small_rwkv7's step (with a kernel variant), the
    # norm + mixes' backward forms, small_rwkv7's and base_125m's steps kernel by kernel, the two other configs'
    # steps, the WKV-7 Mosaic GPU forms (each checked against XLA's float32 form), then the chunked WKV-7 backward's
    # launch settings.
    "rwkv7-step": ("train-small_rwkv7", "norm-mix", "step-budget-small_rwkv7", "step-budget-base_125m",
                   "train-base_125m_rwkv7", "train-base_125m", "wkv7-mgpu-forms", "wkv7-backward-layouts"),
}
COLUMNS = ("benchmark", "part", "status", "seconds", "results", "headline")


# ----------------------------------------------------------------------------------------------------- the probe


def probe() -> None:
  """Prints one line 'PROBE <json>': environment, measured ceilings, peers. Runs in a subprocess of the driver."""
  sys.path.insert(0, str(HERE))
  import common  # noqa: PLC0415  (imports JAX: only in the probe's own process)
  import peers  # noqa: PLC0415

  ceilings = common.measure_ceilings()
  print("PROBE " + json.dumps({"environment": common.environment(), "ceilings": ceilings, "peers": peers.status()}))


def run_probe(env: dict[str, str], timeout_s: int) -> dict[str, Any]:
  began = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, str(HERE / "gpu_sweep.py"), "--probe"], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {"status": "timeout", "seconds": time.perf_counter() - began}
  for line in done.stdout.splitlines():
    if line.startswith("PROBE "):
      return {"status": "ok", "seconds": time.perf_counter() - began, **json.loads(line[len("PROBE "):])}
  return {"status": "failed", "returncode": done.returncode, "seconds": time.perf_counter() - began,
          "tail": (done.stdout + done.stderr)[-TAIL_CHARS:]}


# ------------------------------------------------------------------------------------------------------ running


def install_wheels(folder: pathlib.Path, site: pathlib.Path) -> dict[str, Any]:
  """pip-installs every wheel of `folder` into `site` (once per set of wheels) and says what it did."""
  wheels = sorted(folder.glob("*.whl"))
  marker = site / ".installed"
  names = [w.name for w in wheels]
  if not wheels:
    return {"status": "failed", "reason": f"no wheels in {folder}", "wheels": []}
  if marker.exists() and marker.read_text().split("\n") == names:
    return {"status": "ok", "wheels": names, "site": str(site), "reused": True}
  command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode != 0:
    return {"status": "failed", "returncode": done.returncode, "wheels": names,
            "tail": (done.stdout + done.stderr)[-TAIL_CHARS:]}
  marker.write_text("\n".join(names))
  return {"status": "ok", "wheels": names, "site": str(site)}


def _kill_group(process: subprocess.Popen) -> None:
  """SIGTERM to the benchmark's process group (its own children too), SIGKILL if it has not gone after 10 s."""
  for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(timeout=wait_s)
      return
    except subprocess.TimeoutExpired:
      continue


def run_one(bench: Bench, quick: bool, timeout_s: float, env: dict[str, str], log: pathlib.Path, device: str,
            results_dir: pathlib.Path) -> dict[str, Any]:
  """Runs one benchmark to the end or its timeout; returns its summary entry."""
  args = list(bench.args(quick))
  if bench.name in os.environ.get("LTM_SWEEP_FAIL", "").replace(",", " ").split():
    args.append(FORCED_FAILURE_FLAG)
  command = [sys.executable, str(HERE / bench.script), *args]
  env = {**env, **dict(bench.env)}
  log.parent.mkdir(parents=True, exist_ok=True)
  started, began = time.time(), time.perf_counter()
  entry: dict[str, Any] = {"command": shlex.join(["python", f"benchmarks/{bench.script}", *args]),
                           "env": dict(bench.env), "started": _now(), "timeout_s": round(timeout_s),
                           "log": str(log)}
  with open(log, "w", encoding="utf-8", errors="replace") as sink:
    # A session of its own: on timeout the whole group goes, the script's own children (nvcc, the official rwkv
    # package's process) with it.
    process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                               start_new_session=True)
    try:
      returncode = process.wait(timeout=timeout_s)
      timed_out = False
    except subprocess.TimeoutExpired:
      _kill_group(process)
      returncode, timed_out = process.returncode, True
  entry["seconds"] = round(time.perf_counter() - began, 1)
  entry["returncode"] = returncode
  text = log.read_text(encoding="utf-8", errors="replace")
  entry["tail"] = text[-TAIL_CHARS:]
  results = _results_file(results_dir, bench.results_stem(quick), device, started)
  if timed_out:
    entry["status"] = "timeout"
  elif returncode != 0:
    entry["status"] = "failed"
  elif results is None:
    entry["status"] = "failed"
    entry["reason"] = f"exit status 0 but no new {bench.results_stem(quick)}-{device}.json in {results_dir}"
  else:
    entry["status"] = "ok"
  if results is not None:
    entry["results_file"] = results.name
    entry.update(_headline(results))
  return entry


def _results_file(folder: pathlib.Path, stem: str, device: str, since: float) -> pathlib.Path | None:
  """The results file the run wrote: <stem>-<device>.json (or .json.gz), modified after `since` (with the device
  unknown, after a failed probe: the newest <stem>-*.json(.gz) modified since)."""
  candidates = [folder / f"{stem}-{device}{suffix}" for suffix in RESULTS_SUFFIXES] if device != "unknown" else sorted(
      (p for suffix in RESULTS_SUFFIXES for p in folder.glob(f"{stem}-*{suffix}")), key=lambda p: p.stat().st_mtime,
      reverse=True)
  fresh = [p for p in candidates if p.exists() and p.stat().st_mtime >= since - 1]
  return fresh[0] if fresh else None


def _headline(path: pathlib.Path) -> dict[str, Any]:
  """A few numbers from a results file for the summary table: rows, rows that failed or skipped, MFU and the
  largest error of a kernel form against its reference, where the rows have them."""
  try:
    payload = read_results(path)
  except (OSError, ValueError) as e:
    return {"headline": f"unreadable results: {e}"}
  total = payload.get("total")
  if isinstance(total, dict) and "predicted_ms" in total:  # A step budget (step_budget.py): no rows.
    measured, pipelined = payload.get("measured_step_ms"), payload.get("pipelined_step_ms")
    headline = f"predicted {total['predicted_ms']:.1f} ms" + (f", measured {measured:.1f}" if measured else "") + (
        f" ({pipelined:.1f} pipelined)" if pipelined else "")
    if payload.get("run_error"):
      headline += f"; run error: {str(payload['run_error'])[:120]}"
    return {"predicted_ms": total["predicted_ms"], "measured_step_ms": measured, "headline": headline}
  rows = payload.get("results", [])
  bad = sum(1 for r in rows if isinstance(r, dict) and ("error" in r or "skipped" in r))
  out: dict[str, Any] = {"rows": len(rows), "rows_failed_or_skipped": bad}
  parts = [f"{len(rows)} rows" + (f", {bad} failed/skipped" if bad else "")]
  mfu = [r["mfu"] for r in rows if isinstance(r, dict) and "mfu" in r]
  if mfu:
    out["mfu"] = mfu
    parts.append("mfu " + ", ".join(f"{m:.3f}" for m in mfu))
  pipelined = [r["mfu_pipelined"] for r in rows if isinstance(r, dict) and "mfu_pipelined" in r]
  if pipelined:
    out["mfu_pipelined"] = pipelined
    parts.append("pipelined " + ", ".join(f"{m:.3f}" for m in pipelined))
  errors = [r["err_vs_chunked"] for r in rows if isinstance(r, dict) and "err_vs_chunked" in r]
  if errors:  # The Mosaic GPU WKV-7 forms against XLA's float32 chunked form (benchmarks/wkv7.py --mode mgpu).
    out["err_vs_chunked"] = max(errors)
    parts.append(f"largest error vs chunked {max(errors):.2e}")
  config = payload.get("config", {})
  found = config.get("peers_found", config.get("peers_run"))
  if found is not None:
    parts.append(f"peers: {', '.join(found) or 'none'}")
  out["headline"] = "; ".join(parts)
  return out


# ------------------------------------------------------------------------------------------------------ summary


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git() -> dict[str, Any]:
  """The checkout's commit and whether it had local changes (absent where the tree is a copy without .git)."""
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10,
                            check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return {}
  return {"commit": commit, "local_changes": bool(dirty)}


def load_summary(path: pathlib.Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return {}


def read_results(path: pathlib.Path) -> Any:
  """A results file's payload: JSON, gzipped where the name ends in .gz (the step budget's)."""
  data = path.read_bytes()
  return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(payload, indent=2) + "\n")
  tmp.replace(path)


def write_archive(archive: pathlib.Path, summary_path: pathlib.Path, summary: dict[str, Any],
                  results_dir: pathlib.Path) -> None:
  """summary + every results file it names (flat, as in benchmarks/results/) + logs/<benchmark>.log, as .tar.gz."""
  archive.parent.mkdir(parents=True, exist_ok=True)
  tmp = archive.with_name(archive.name + ".tmp")
  with tarfile.open(tmp, "w:gz") as tar:
    tar.add(summary_path, arcname=summary_path.name)
    for name, entry in summary.get("runs", {}).items():
      results = entry.get("results_file")
      if results and (results_dir / results).exists():
        tar.add(results_dir / results, arcname=results)
      log = pathlib.Path(entry.get("log", ""))
      if log.is_file():
        tar.add(log, arcname=f"logs/{name}.log")
  tmp.replace(archive)


def merge(archive: pathlib.Path, results_dir: pathlib.Path, log_dir: pathlib.Path) -> pathlib.Path:
  """Unpacks an --archive written elsewhere: its results files into `results_dir`, its logs into `log_dir`, and its
  summary merged into the one in `results_dir` (per benchmark, the entry that started last wins; one that never ran
  does not replace one that did). Returns the merged summary's path."""
  with tarfile.open(archive) as tar:
    members = [m for m in tar.getmembers() if m.isfile()]
    sweeps = [m for m in members if m.name.startswith("gpu-sweep") and "/" not in m.name]
    if len(sweeps) != 1:
      raise SystemExit(f"{archive}: expected one gpu-sweep-*.json, found {[m.name for m in sweeps]}")
    incoming = json.loads(tar.extractfile(sweeps[0]).read())
    logs = {}
    for member in members:
      folder, _, name = member.name.rpartition("/")
      if member is sweeps[0] or folder not in ("", "logs") or not name.endswith((*RESULTS_SUFFIXES, ".log")):
        continue  # Only the flat layout write_archive makes: nothing outside the two folders.
      target = (log_dir if folder else results_dir) / name
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(tar.extractfile(member).read())
      if folder:
        logs[name[:-len(".log")]] = target
  path = results_dir / sweeps[0].name
  local = load_summary(path)
  runs = dict(local.get("runs", {}))
  for name, entry in incoming.get("runs", {}).items():
    if name in logs:
      entry["log"] = str(logs[name])
    old = runs.get(name)
    if old is None or (entry.get("status") != "not run" and entry.get("started", "") >= old.get("started", "")):
      runs[name] = entry
  seen = {(i.get("date"), tuple(i.get("argv", []))) for i in local.get("invocations", [])}
  invocations = local.get("invocations", []) + [
      i for i in incoming.get("invocations", []) if (i.get("date"), tuple(i.get("argv", []))) not in seen]
  write_json(path, {**local, **incoming, "runs": runs, "invocations": invocations})
  return path


def print_table(summary: dict[str, Any], names: list[str]) -> None:
  rows = []
  for name in names:
    entry = summary["runs"].get(name, {})
    rows.append({"benchmark": name, "part": BY_NAME[name].part if name in BY_NAME else "", "status":
                 entry.get("status", "not run"), "seconds": entry.get("seconds", ""),
                 "results": entry.get("results_file", ""),
                 "headline": entry.get("headline", entry.get("reason", ""))[:70]})
  cells = [list(COLUMNS)] + [[str(r[c]) for c in COLUMNS] for r in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
  for i, line in enumerate(cells):
    print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    if i == 0:
      print("  ".join("-" * width for width in widths))


def ordered(plan: str | None) -> list[Bench]:
  """--plan's benchmarks in its order, or every benchmark in the default order."""
  return [BY_NAME[name] for name in PLANS[plan]] if plan else list(BENCHMARKS)


def select(args) -> list[Bench]:
  """The benchmarks a command runs: `ordered(args.plan)` narrowed by --only and --part."""
  return [b for b in ordered(args.plan)
          if (args.only is None or b.name in args.only) and (args.part is None or b.part == args.part)]


def _resumable(entry: dict[str, Any] | None) -> bool:
  """Whether --resume runs a benchmark again: never run, or stopped by a --deadline before its own timeout."""
  return entry is None or entry.get("status") in (None, "not run") or (
      entry.get("status") == "timeout" and entry.get("capped", False))


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="every script's tiny shapes: a dry run (CPU) in minutes")
  parser.add_argument("--only", nargs="+", default=None, choices=list(BY_NAME), metavar="NAME",
                      help=f"run these only, in the default order: {' '.join(BY_NAME)}")
  parser.add_argument("--plan", choices=sorted(PLANS), default=None,
                      help="a named selection, in its own order: " + "; ".join(
                          f"{name}: {' '.join(names)}" for name, names in PLANS.items()))
  parser.add_argument("--part", type=int, choices=PARTS, default=None,
                      help="run one part (see --list); parts are estimated to fit 10 minutes each on an H100")
  parser.add_argument("--resume", action="store_true",
                      help="skip what the summary already records as ok or failed (or timed out at its own limit)")
  parser.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                      help="start no benchmark unlikely to finish SECONDS after this command began, and cut the "
                           "last one off there; the summary and archive are written within ~20 s after")
  parser.add_argument("--results-dir", type=pathlib.Path, default=DEFAULT_RESULTS,
                      help="where the scripts and the summary write (LTM_BENCH_RESULTS for the scripts)")
  parser.add_argument("--log-dir", type=pathlib.Path, default=DEFAULT_LOGS, help="each benchmark's full output")
  parser.add_argument("--archive", type=pathlib.Path, default=None, metavar="PATH.tar.gz",
                      help="also write summary, results files and logs there after every benchmark")
  parser.add_argument("--wheels", type=pathlib.Path, default=None, metavar="DIR",
                      help=f"pip-install DIR/*.whl (peers.py --download) into {SITE} for the benchmarks, without "
                           "an index")
  parser.add_argument("--list", action="store_true", help="print the benchmarks and exit")
  parser.add_argument("--merge", type=pathlib.Path, default=None, metavar="PATH.tar.gz",
                      help="unpack an --archive from another machine into --results-dir and --log-dir, merging its "
                           "summary into the one there (runs nothing)")
  parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.probe:
    probe()
    return 0
  if args.list:
    for b in BENCHMARKS:
      print(f"{b.name:24s} part {b.part}  ~{b.estimate_s:4d} s (timeout {b.timeout_s} s)  "
            f"python benchmarks/{b.script} {shlex.join(b.gpu_args)}")
    for part in PARTS:
      print(f"part {part}: ~{sum(b.estimate_s for b in BENCHMARKS if b.part == part)} s")
    for name, names in PLANS.items():
      print(f"plan {name}: ~{sum(BY_NAME[n].estimate_s for n in names)} s: {' '.join(names)}")
    print(f"all: ~{sum(b.estimate_s for b in BENCHMARKS)} s")
    return 0
  if args.merge is not None:
    path = merge(args.merge, args.results_dir.resolve(), args.log_dir.resolve())
    summary = load_summary(path)
    print(f"merged {args.merge} into {path}")
    print_table(summary, [b.name for b in BENCHMARKS if b.name in summary["runs"]])
    pending = [b.name for b in BENCHMARKS if _resumable(summary["runs"].get(b.name))]
    print(f"not run yet: {' '.join(pending)}" if pending else "every benchmark has run")
    return 0

  began = time.perf_counter()
  deadline = None if args.deadline is None else began + args.deadline
  results_dir, log_dir = args.results_dir.resolve(), args.log_dir.resolve()
  env = {**os.environ, "PYTHONUNBUFFERED": "1", "LTM_BENCH_RESULTS": str(results_dir)}
  wheels = None
  if args.wheels is not None:
    print(f"installing the wheels of {args.wheels} into {SITE} ...", flush=True)
    wheels = install_wheels(args.wheels.resolve(), SITE)
    print(f"wheels: {wheels['status']} ({len(wheels['wheels'])} wheels)" +
          (f": {wheels.get('reason') or wheels.get('tail', '')[-500:]}" if wheels["status"] != "ok" else ""))
    if wheels["status"] == "ok":
      env["PYTHONPATH"] = os.pathsep.join([wheels["site"], *filter(None, [env.get("PYTHONPATH")])])

  print("probe: ceilings, versions, peers ...", flush=True)
  found = run_probe(env, timeout_s=QUICK_TIMEOUT_S if args.quick else 240)
  environment = found.get("environment", {})
  device = environment.get("device", "unknown")
  if found["status"] == "ok":
    peers_ok = sorted(name for name, p in found["peers"].items() if p["importable"])
    print(f"device {device} ({environment.get('device_kind')}); jax {environment.get('jax')}, torch "
          f"{environment.get('torch')}, triton {environment.get('triton')}; ceilings {found['ceilings']}; "
          f"peers importable: {', '.join(peers_ok) or 'none'}", flush=True)
  else:
    print(f"probe {found['status']}: {found.get('tail', '')[-1000:]}", flush=True)
  if not args.quick and environment.get("platform") == "cpu":
    print("no accelerator here: the GPU sweep's shapes would take hours on a CPU; use --quick for a dry run")
    return 2

  summary_path = results_dir / f"gpu-sweep{'-quick' if args.quick else ''}-{device}.json"
  summary = load_summary(summary_path)
  summary.setdefault("runs", {})
  summary.update({
      "benchmark": "gpu-sweep", "device": device, "quick": args.quick, "environment": environment,
      "versions": {k: environment.get(k) for k in ("jax", "jaxlib", "torch", "triton", "python")},
      "ceilings": found.get("ceilings"), "peers": found.get("peers"),
      "probe": {k: found[k] for k in ("status", "seconds", "returncode", "tail") if k in found},
      "git": _git(), "order": [b.name for b in BENCHMARKS],
      "note": ("status: ok (exit 0 and a new results file), failed, timeout, or not run (left for a later command "
               "by --deadline). seconds include compile. ceilings: common.measure_ceilings in the probe (copy: bytes "
               "read + written per second; bf16 matmul on random data); each script measures its own again."),
  })
  if wheels is not None:
    summary["wheels"] = wheels
  # Each command's own probe: the ceilings of every part of a split sweep stay visible side by side.
  invocation = {"date": _now(), "argv": sys.argv[1:], "seconds": None, "ran": [], "ceilings": found.get("ceilings")}
  summary.setdefault("invocations", []).append(invocation)

  chosen = select(args)
  if args.resume:
    chosen = [b for b in chosen if _resumable(summary["runs"].get(b.name))]

  def save():
    invocation["seconds"] = round(time.perf_counter() - began, 1)
    write_json(summary_path, summary)
    if args.archive is not None:
      write_archive(args.archive, summary_path, summary, results_dir)

  for i, bench in enumerate(chosen):
    timeout = QUICK_TIMEOUT_S if args.quick else bench.timeout_s
    capped = False
    if deadline is not None:
      left = deadline - time.perf_counter()
      # The first benchmark of a command always starts (else a long one would never run); later ones only when
      # their estimate fits what is left.
      if left < 30 or (invocation["ran"] and not args.quick and bench.estimate_s > left):
        for rest in chosen[i:]:
          if _resumable(summary["runs"].get(rest.name)):
            summary["runs"][rest.name] = {"status": "not run", "reason": "left for a later command (--deadline)"}
        print(f"deadline: {left:.0f} s left; not started: {', '.join(b.name for b in chosen[i:])}")
        break
      if left < timeout:
        timeout, capped = left, True
    print(f"\n== {bench.name} (part {bench.part}, timeout {timeout:.0f} s)", flush=True)
    entry = run_one(bench, args.quick, timeout, env, log_dir / f"{bench.name}.log", device, results_dir)
    if entry["status"] == "timeout" and capped:
      entry["capped"] = True
    summary["runs"][bench.name] = entry
    invocation["ran"].append(bench.name)
    print(f"{bench.name}: {entry['status']} in {entry['seconds']:.0f} s"
          + (f" -> {entry['results_file']}" if "results_file" in entry else "")
          + ("" if entry["status"] == "ok" else "\n" + entry["tail"][-1500:]), flush=True)
    save()
  save()

  order = ordered(args.plan)
  names = [b.name for b in order if b.name in summary["runs"] or b in chosen]
  print(f"\n== gpu sweep on {device}: {summary_path}" + (f", archive {args.archive}" if args.archive else ""))
  print(f"ceilings: {summary.get('ceilings')}; versions: {summary['versions']}")
  print_table(summary, names)
  pending = [b.name for b in order if _resumable(summary["runs"].get(b.name))]
  print(f"not run yet: {' '.join(pending)} (run again with --resume)" if pending
        else f"every benchmark {'of the plan ' if args.plan else ''}has run")
  failed = [n for n in invocation["ran"] if summary["runs"][n]["status"] != "ok"]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
