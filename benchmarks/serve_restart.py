"""`ltm serve` starts and restarts with and without JAX's persistent compilation cache (`--compilation-cache`).

  python benchmarks/serve_restart.py           # configs/tiny.py (0.95 M parameters, context 1024), 32 slots
  python benchmarks/serve_restart.py --quick   # a micro model: proves the script end to end

The model is the tiny config at its initialisation in a temporary workdir, served with the defaults (--max-batch 32,
--prefill-chunk 128: 19 programs). Each case is a fresh `ltm serve` process on that workdir; what it reports is the
wall time from launch to the start line, the compile time the line itself reports (every program compiled, or
loaded from the cache, and run once), and the entries in the cache folder afterwards:

  off                 --compilation-cache none
  cold, warm          an empty folder, then the same folder again (a restart), at JAX's default threshold: only
                      programs that took 1 s or more to compile are stored
  cold-all, warm-all  another empty folder with JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0: every program stored
  warm-all again      a second restart
  per-chunk cold/warm --stream-per-chunk in a third folder (threshold 0): its decode program has no per-step host
                      callback, which JAX never caches

Then where a warm start's time goes ("breakdown"): `Engine.start` in a fresh process of its own on the threshold-0
folders (with per-step streaming and per chunk), JAX's own duration events summed (jax.monitoring): tracing to a
jaxpr and lowering to MLIR (which JAX does before it can look a program up: the key is the lowered program), the
backend step (a cache load, or a compilation), and the cache loads alone.

Results: benchmarks/results/serve-restart-<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from common import print_table, write_results
from serve import _workdir, running_server


def _case(name: str, workdir: str, cache: str, *options: str, threshold: str | None = None) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR",
                                                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  if threshold is not None:
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = threshold
  started = time.perf_counter()
  with running_server(workdir, "--compilation-cache", cache, "--log-level", "warning", *options, env=env) as server:
    ready_s = time.perf_counter() - started
  compiled = re.search(r"(\d+) programs compiled in ([\d.]+)s", server.ready)
  entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
  row = {"case": name, "to_start_line_s": round(ready_s, 1), "programs": int(compiled[1]),
         "compile_s": float(compiled[2]), "cache_entries": entries, "options": " ".join(options),
         "min_compile_time_s": threshold or "1 (default)", "exit": server.exit}
  print(f"{name}: start line after {ready_s:.1f} s, {row['programs']} programs in {row['compile_s']} s, "
        f"{entries} cache entries", flush=True)
  return row


def _breakdown(workdir: str, cache: str, stream_steps: bool) -> dict:
  """In this (fresh) process: `Engine.start` of the model in `workdir` with the cache in `cache` (threshold 0),
  timed, and JAX's compilation duration events during it, summed per event: {"start_s", event: [count, seconds]}."""
  import jax
  from jax import monitoring
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  totals, counts = collections.Counter(), collections.Counter()

  def listen(event, duration, **_):
    totals[event] += duration
    counts[event] += 1

  from ltm_jax.api import load
  from ltm_jax.serve import Engine
  engine = Engine(load(workdir), max_batch=32, prefill_chunk=128, stream_steps=stream_steps)
  monitoring.register_event_duration_secs_listener(listen)
  started = time.perf_counter()
  engine.start()
  row = {"start_s": round(time.perf_counter() - started, 2),
         **{event.rsplit("/", 1)[-1]: [counts[event], round(total, 2)] for event, total in sorted(totals.items())}}
  engine.stop(60)
  return row


def _breakdown_case(name: str, workdir: str, cache: str, stream_steps: bool) -> dict:
  done = subprocess.run([sys.executable, __file__, "--breakdown", workdir, cache, str(int(stream_steps))],
                        capture_output=True, text=True, check=True)
  row = {"case": name, **json.loads(done.stdout.strip().splitlines()[-1])}
  print(f"{name}: {row}", flush=True)
  return row


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="a micro model (d_model 32, 2 layers, context 128)")
  p.add_argument("--breakdown", nargs=3, metavar=("WORKDIR", "CACHE", "STREAM_STEPS"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.breakdown:  # The child process of a breakdown case.
    print(json.dumps(_breakdown(args.breakdown[0], args.breakdown[1], bool(int(args.breakdown[2])))))
    return
  overrides = ["model.d_model=32", "model.n_layers=2", "model.max_seq_len=128"] if args.quick else []
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = _workdir(os.path.join(tmp, "workdir"), overrides)
    default, every, per_chunk = (os.path.join(tmp, name) for name in ("default", "every", "per-chunk"))
    rows = [_case("off", workdir, "none"),
            _case("cold", workdir, default), _case("warm", workdir, default),
            _case("cold-all", workdir, every, threshold="0"), _case("warm-all", workdir, every, threshold="0"),
            _case("warm-all again", workdir, every, threshold="0"),
            _case("per-chunk cold", workdir, per_chunk, "--stream-per-chunk", threshold="0"),
            _case("per-chunk warm", workdir, per_chunk, "--stream-per-chunk", threshold="0")]
    breakdown = [_breakdown_case("warm, streamed per step", workdir, every, True),
                 _breakdown_case("warm, per chunk", workdir, per_chunk, False)]
  print_table(rows, ["case", "to_start_line_s", "programs", "compile_s", "cache_entries", "min_compile_time_s",
                     "options"])
  path = write_results("serve-restart-quick" if args.quick else "serve-restart", rows,
                       model="micro (init weights)" if args.quick else "tiny (init weights)", overrides=overrides,
                       max_batch=32, prefill_chunk=128, breakdown=breakdown, load_average_before=list(load_before),
                       load_average_after=list(os.getloadavg()))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
