"""How long `make demo` takes: each of its commands timed, as a new user runs them.

    python benchmarks/demo.py                     # in this checkout, a fresh workdir and compilation cache
    python benchmarks/demo.py --name demo-fresh-clone

The commands are the Makefile's own (`make -n demo`, so the two never drift apart), run in order with a workdir and
a JAX compilation cache that start empty, as on a new machine (a venv already built is used as it is; `make -n`
lists its install steps when it is not). Writes benchmarks/results/<name>-<device>.json: every command with its
seconds, the total, the machine's cores and load average, the evaluation's results and the generated sample.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import tempfile
import time

import common


def demo_commands(workdir: pathlib.Path) -> list[str]:
  """The shell commands `make demo` would run for `workdir`."""
  out = subprocess.run(["make", "-n", "demo", f"WORKDIR={workdir}"], cwd=common.ROOT, capture_output=True, text=True,
                       check=True).stdout
  return [line for line in out.splitlines() if line.strip()]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--name", default="demo", help="results file benchmarks/results/NAME-<device>.json")
  args = parser.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    workdir, cache = pathlib.Path(tmp) / "tiny-ltm", pathlib.Path(tmp) / "jax-cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
    load_before = os.getloadavg()
    for command in demo_commands(workdir):
      started = time.time()
      result = subprocess.run(command, shell=True, cwd=common.ROOT, env=env, capture_output=True, text=True)
      seconds = time.time() - started
      rows.append({"command": command, "seconds": seconds, "returncode": result.returncode,
                   "output_tail": result.stdout[-1500:]})
      print(f"{seconds:7.1f} s  {shlex.split(command)[0].rsplit('/', 1)[-1]} {' '.join(shlex.split(command)[1:3])}",
            flush=True)
      if result.returncode:
        print(result.stdout[-2000:], result.stderr[-2000:])
        raise SystemExit(f"demo command failed ({result.returncode}): {command}")
    evaluation = json.loads((workdir / "eval.json").read_text())
  total = sum(row["seconds"] for row in rows)
  print(f"{total:7.1f} s  in all")
  out = common.write_results(args.name, rows, total_seconds=total, cpus=os.cpu_count(), load_before=load_before,
                             load_after=os.getloadavg(), evaluation=evaluation)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
