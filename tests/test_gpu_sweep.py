"""benchmarks/gpu_sweep.py on CPU: a quick sweep of one cheap benchmark beside one forced to fail, into a temporary
results folder; the failure is recorded and the other benchmark still runs, its archive merges into another folder,
and --deadline leaves work for later."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import ROOT, cpu_only_env

SWEEP = ROOT / "benchmarks" / "gpu_sweep.py"


def _sweep(tmp_path, *argv, fail: str = ""):
  # On the CPU on every host (the summary and results files are named for the device, and the test reads the CPU's):
  # the driver passes its environment to each benchmark it starts, so none of them starts a GPU either.
  env = cpu_only_env(LTM_SWEEP_FAIL=fail)
  env.pop("LTM_BENCH_RESULTS", None)
  command = [sys.executable, str(SWEEP), "--quick", "--results-dir", str(tmp_path / "results"), "--log-dir",
             str(tmp_path / "logs"), *argv]
  done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  summary = json.loads((tmp_path / "results" / "gpu-sweep-quick-cpu.json").read_text())
  return done, summary


@pytest.mark.slow
@pytest.mark.long
def test_quick_sweep_records_a_failure_and_runs_the_rest(tmp_path):
  began = time.time()
  archive = tmp_path / "out" / "sweep.tar.gz"
  # attention-d64 runs first in the default order and fails; wkv7 still runs after it.
  done, summary = _sweep(tmp_path, "--only", "attention-d64", "wkv7", "--archive", str(archive),
                         fail="attention-d64")
  assert done.returncode == 1, done.stdout + done.stderr  # A failure this run: non-zero, after running the rest.
  runs = summary["runs"]
  assert runs["attention-d64"]["status"] == "failed" and runs["attention-d64"]["returncode"] != 0
  assert "--sweep-forced-failure" in runs["attention-d64"]["tail"]
  ok = runs["wkv7"]
  assert ok["status"] == "ok" and ok["returncode"] == 0 and ok["results_file"] == "wkv7-quick-cpu.json"
  payload = json.loads((tmp_path / "results" / ok["results_file"]).read_text())
  assert payload["results"] and payload["device"] == "cpu" and "torch" in payload
  assert (tmp_path / "logs" / "wkv7.log").is_file()
  assert summary["probe"]["status"] == "ok" and summary["ceilings"]["copy_gbps"] > 0
  assert set(summary["versions"]) >= {"jax", "jaxlib", "torch", "triton"} and summary["versions"]["jax"]
  assert summary["peers"]["torch"]["importable"] == (importlib.util.find_spec("torch") is not None)
  for line in ("wkv7", "attention-d64", "failed", "ok"):
    assert line in done.stdout
  with tarfile.open(archive) as tar:
    assert {"gpu-sweep-quick-cpu.json", "wkv7-quick-cpu.json", "logs/attention-d64.log"} <= set(tar.getnames())
  # --merge brings the archive into another checkout's folders (as after a run on the device machine).
  here = tmp_path / "here"
  merged = subprocess.run([sys.executable, str(SWEEP), "--merge", str(archive), "--results-dir", str(here / "results"),
                           "--log-dir", str(here / "logs")], capture_output=True, text=True, timeout=60, check=True)
  assert "wkv7-quick-cpu.json" in merged.stdout
  local = json.loads((here / "results" / "gpu-sweep-quick-cpu.json").read_text())
  assert {n: r["status"] for n, r in local["runs"].items()} == {"attention-d64": "failed", "wkv7": "ok"}
  assert (here / "results" / "wkv7-quick-cpu.json").is_file() and (here / "logs" / "wkv7.log").is_file()
  # Nothing went into the real results folder.
  written = [p.name for p in (ROOT / "benchmarks" / "results").glob("*.json") if p.stat().st_mtime >= began]
  assert not written, written

  # A later command with --deadline already spent: the summary keeps both entries and marks the others not run.
  done, summary = _sweep(tmp_path, "--resume", "--deadline", "0", "--only", "wkv7", "attention-d64", "wkv4")
  assert done.returncode == 0, done.stdout + done.stderr
  assert summary["runs"]["wkv7"]["status"] == "ok" and summary["runs"]["attention-d64"]["status"] == "failed"
  assert summary["runs"]["wkv4"]["status"] == "not run" and len(summary["invocations"]) == 2
  assert "wkv4" in next(line for line in done.stdout.splitlines() if line.startswith("not run yet:"))


def test_resume_and_parts():
  spec = importlib.util.spec_from_file_location("gpu_sweep", SWEEP)
  sweep = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = sweep  # dataclasses look their module up there.
  spec.loader.exec_module(sweep)  # Imports no JAX.
  assert sweep._resumable(None) and sweep._resumable({"status": "not run"})
  assert sweep._resumable({"status": "timeout", "capped": True})
  assert not any(sweep._resumable({"status": s}) for s in ("ok", "failed", "timeout"))
  assert [b.name for b in sweep.BENCHMARKS][0] == "wkv7" and len(sweep.BY_NAME) == len(sweep.BENCHMARKS)
  # Every part is estimated to fit one 10-minute command of the device tool, with room for the probe.
  for part in sweep.PARTS:
    assert sum(b.estimate_s for b in sweep.BENCHMARKS if b.part == part) <= 480
  assert all(b.timeout_s < 600 for b in sweep.BENCHMARKS)


def _load_sweep():
  spec = importlib.util.spec_from_file_location("gpu_sweep", SWEEP)
  sweep = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = sweep
  spec.loader.exec_module(sweep)
  return sweep


def test_plans_select_in_their_own_order():
  sweep = _load_sweep()
  for name, names in sweep.PLANS.items():
    assert set(names) <= set(sweep.BY_NAME) and len(set(names)) == len(names), name
    chosen = sweep.select(sweep.parse_args(["--plan", name]))
    assert [b.name for b in chosen] == list(names)
  plan = sweep.PLANS["rwkv7-step"]
  # --only narrows a plan and keeps its order; without --plan the default order stands.
  narrowed = sweep.select(sweep.parse_args(["--plan", "rwkv7-step", "--only", plan[-1], plan[0]]))
  assert [b.name for b in narrowed] == [plan[0], plan[-1]]
  assert [b.name for b in sweep.select(sweep.parse_args([]))] == [b.name for b in sweep.BENCHMARKS]
  # The dry run takes the device run's variants (each runs off a GPU too).
  small = sweep.BY_NAME["train-small_rwkv7"]
  assert "model.norm_mix_impl=pallas" in small.gpu_args and small.quick_args == small.gpu_args + ("--quick",)


def test_headline_reads_a_step_budget(tmp_path):
  """The step budget's gzipped results (what step_budget.py writes), found by the sweep and read for its headline."""
  sweep = _load_sweep()
  path = tmp_path / "step-budget-small_rwkv7-cpu.json.gz"
  path.write_bytes(gzip.compress(json.dumps({"config": "small_rwkv7", "total": {"predicted_ms": 34.42},
                                             "measured_step_ms": 38.2, "run_error": None}).encode()))
  assert sweep._results_file(tmp_path, "step-budget-small_rwkv7", "cpu", since=0.0) == path
  assert sweep._results_file(tmp_path, "step-budget-small_rwkv7", "unknown", since=0.0) == path
  out = sweep._headline(path)
  assert out["predicted_ms"] == 34.42 and out["measured_step_ms"] == 38.2
  assert out["headline"] == "predicted 34.4 ms, measured 38.2"


def test_headline_gives_the_largest_error_of_the_kernel_forms(tmp_path):
  sweep = _load_sweep()
  path = tmp_path / "wkv7-mgpu-forms-cpu.json"
  rows = [{"size": 64, "err_vs_chunked": 4.1e-3}, {"size": 64, "err_vs_chunked": 7.5e-3, "max_diff_from_serial": 0.0},
          {"size": 128, "err_vs_chunked": 5.0e-3}]
  path.write_text(json.dumps({"results": rows}))
  out = sweep._headline(path)
  assert out["err_vs_chunked"] == 7.5e-3
  assert out["headline"] == "3 rows; largest error vs chunked 7.50e-03"
