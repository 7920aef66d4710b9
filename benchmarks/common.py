"""Timing and reporting helpers shared by the scripts in benchmarks/.

Scripts run as `python benchmarks/<name>.py` from a checkout; importing this module first puts the checkout on
sys.path, so they time the working tree's ltm_jax without an install.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
if importlib.util.find_spec("ltm_pallas") is None:
  # An uninstalled checkout (a GPU machine without network): pallas/ is the package that installs as ltm_pallas.
  _spec = importlib.util.spec_from_file_location("ltm_pallas", ROOT / "pallas" / "__init__.py",
                                                 submodule_search_locations=[str(ROOT / "pallas")])
  sys.modules["ltm_pallas"] = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(sys.modules["ltm_pallas"])

import jax  # noqa: E402  (after the path fix, like every ltm_jax import in the scripts)
import jaxlib  # noqa: E402
import peers  # noqa: E402  (benchmarks/peers.py: imports no JAX)

# LTM_BENCH_RESULTS moves every script's results file elsewhere (gpu_sweep.py --results-dir; tests write to a
# temporary folder, never over the measured tables).
RESULTS = pathlib.Path(os.environ.get("LTM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")


def device_name() -> str:
  """'cpu', or the accelerator's kind slugified, e.g. 'nvidia-h100-80gb-hbm3': the suffix of result files."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    return "cpu"
  return re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")


def environment() -> dict[str, Any]:
  """What a result depends on besides the code: device, library versions, host, date."""
  device = jax.devices()[0]
  return {
      "device": device_name(),
      "device_kind": device.device_kind,
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      # Read from the installed metadata, not imported: importing torch would slow every JAX-only script.
      "torch": peers.installed_version(("torch",)),
      "triton": peers.installed_version(("triton",)),
      "python": platform.python_version(),
      "host_cpus": os.cpu_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def compile_fn(fn: Callable[..., Any], *args) -> tuple[Callable[..., Any], float]:
  """jax.jit(fn) compiled ahead of time for `args`, and the seconds that compiling took."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def time_fn(
    fn: Callable[..., Any], *args, warmup: int = 2, min_runs: int = 5, max_runs: int = 50, budget_s: float = 2.0
) -> dict[str, float]:
  """Wall-clock milliseconds of fn(*args) until its outputs are ready: median, min and max over the runs.

  After `warmup` untimed calls, runs at least `min_runs` times and then stops at `max_runs` or once `budget_s` of
  timed calls have passed, whichever comes first.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  while len(times) < max_runs and (len(times) < min_runs or sum(times) < budget_s):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  ms = [t * 1e3 for t in times]
  return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "runs": len(ms)}


def time_train_steps(step: Callable[..., Any], state: Any, batch: Any, steps: int,
                     warmup: int = 2) -> tuple[Any, Any, dict[str, Any]]:
  """Times a train step `step(state, batch) -> (state, metrics)` (which may donate its state) two ways.

  Blocked: each step waits for its metrics before the next is called, so every step also pays the host's dispatch
  and the wait's latency (`step_ms`, the median; `dispatch_ms`, the median time for the call to return, that is for
  the host to enqueue the step). Pipelined: `steps` steps called back to back and waited for once, as the training
  loop runs between its logging steps (`step_ms_pipelined`, the mean). The difference is the device's idle time
  between steps that the loop hides. Returns (state, last metrics, timings)."""
  for _ in range(warmup):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times, dispatch = [], []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    dispatch.append(time.perf_counter() - start)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready((state, metrics))
  pipelined = (time.perf_counter() - start) / steps
  return state, metrics, {"step_ms": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
                          "step_ms_max": max(times) * 1e3, "step_times_ms": [t * 1e3 for t in times],
                          "dispatch_ms": statistics.median(dispatch) * 1e3, "step_ms_pipelined": pipelined * 1e3}


def toy_config(cfg):
  """`cfg` at toy sizes (d_model 64, one layer per pattern letter, batch 2 x 32 tokens), keeping its mixers, window,
  grouped-query attention, dtype and backends: a run that proves the config compiles and steps, in seconds."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from ltm_jax import config as config_lib  # pylint: disable=g-import-not-at-top

  m = cfg.model
  model = dataclasses.replace(
      m, d_model=64, n_heads=2, n_kv_heads=None if m.n_kv_heads is None else 1, n_layers=len(m.layer_pattern),
      mlp_dim=None if m.mlp_dim is None else 128, rwkv7_head_size=32, window=None if m.window is None else 16,
      max_seq_len=64)
  train = dataclasses.replace(cfg.train, batch_size=2, seq_len=32, grad_accum=1)
  return config_lib.validate(dataclasses.replace(cfg, model=model, train=train))


def compiled_train_step(cfg) -> tuple[Any, Any, dict[str, jax.Array], float]:
  """The config's jitted train step (`ltm_jax.train.step`, AdamW update included) compiled for a batch of random
  tokens: (compiled step, initial state, batch, compile seconds). A step's cost does not depend on the tokens."""
  from ltm_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from ltm_jax.train.optimizer import learning_rate, make_optimizer  # pylint: disable=g-import-not-at-top
  from ltm_jax.train.step import create_train_state, make_train_step  # pylint: disable=g-import-not-at-top

  t = cfg.train
  optimizer = make_optimizer(t)
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent), optimizer, 0)
  tokens = jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, cfg.model.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  step = make_train_step(model_lib.LM(cfg.model, cfg.latent), optimizer, learning_rate(t), t.grad_accum)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return compiled, state, batch, time.perf_counter() - start


def time_forward_backward(forward: Callable[..., Any], args: Sequence[Any], cotangent: Any,
                          **timing: Any) -> tuple[dict[str, Any], Any]:
  """Times forward(*args) and forward + backward (its VJP with `cotangent`), each compiled ahead of time and timed by
  time_fn(**timing). Returns ({fwd_ms, fwd_bwd_ms, compile_s, fwd, fwd_bwd}, forward's output)."""

  def forward_backward(*args_and_cotangent):
    y, vjp = jax.vjp(forward, *args_and_cotangent[:-1])
    return y, vjp(args_and_cotangent[-1])

  fwd, fwd_compile = compile_fn(forward, *args)
  fwd_t = time_fn(fwd, *args, **timing)
  fwd_bwd, bwd_compile = compile_fn(forward_backward, *args, cotangent)
  fwd_bwd_t = time_fn(fwd_bwd, *args, cotangent, **timing)
  return {"fwd_ms": fwd_t["median_ms"], "fwd_bwd_ms": fwd_bwd_t["median_ms"], "compile_s": fwd_compile + bwd_compile,
          "fwd": fwd_t, "fwd_bwd": fwd_bwd_t}, fwd(*args)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
  """Prints `columns` of `rows` as an aligned text table; floats to 4 significant digits."""
  fmt = lambda x: f"{x:.4g}" if isinstance(x, float) else str(x)
  cells = [list(columns)] + [[fmt(row.get(c, "")) for c in columns] for row in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  for i, line in enumerate(cells):
    print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    if i == 0:
      print("  ".join("-" * width for width in widths))


def write_results(name: str, rows: Sequence[Mapping[str, Any]] | Mapping[str, Any], **config: Any) -> pathlib.Path:
  """Writes benchmarks/results/<name>-<device>.json: the environment, the run's `config` and one entry per row (or
  `rows` as given, for a mapping of tables)."""
  RESULTS.mkdir(parents=True, exist_ok=True)
  path = RESULTS / f"{name}-{device_name()}.json"
  payload = {"benchmark": name, **environment(), "config": config,
             "results": dict(rows) if isinstance(rows, Mapping) else list(rows)}
  path.write_text(json.dumps(payload, indent=2) + "\n")
  return path


def measure_ceilings(copy_mib: int = 1024, matmul_n: int = 8192) -> dict[str, float]:
  """The machine's measured floors' denominators: copy bandwidth (bytes read + written per second) and bf16 matmul rate.

  Kernels report time as a multiple of max(bytes / copy_gbps, flops / matmul_tflops); measured ceilings, not datasheet
  ones, so the ratio survives the machine. matmul_tflops is the median of products timed one at a time, each waited
  for; matmul_tflops_sustained the median of chains of products run back to back after about a second of them (the
  clocks settled, no wait between products), the rate a training step's long stretches of matmuls can see. On CPU the
  sizes shrink to stay quick.
  """
  on_cpu = jax.default_backend() == "cpu"
  if on_cpu:
    copy_mib, matmul_n = min(copy_mib, 128), min(matmul_n, 1024)
  x = jax.random.normal(jax.random.key(1), (copy_mib * 2**20 // 4,), jax.numpy.float32)
  # One read and one write of every element (a plain copy may be elided), into the donated input: a fresh output
  # buffer per call would time the allocator's page faults too (on CPU, most of the time).
  copy, ms = jax.jit(lambda x: x + 1.0, donate_argnums=0), []
  for run in range(12):
    start = time.perf_counter()
    x = jax.block_until_ready(copy(x))
    if run >= 2:  # After warm-up.
      ms.append((time.perf_counter() - start) * 1e3)
  copy_ms = statistics.median(ms)
  a, b = (jax.random.normal(key, (matmul_n, matmul_n), jax.numpy.bfloat16) for key in jax.random.split(jax.random.key(2)))
  product = jax.jit(lambda a, b: a @ b)
  matmul_ms = time_fn(product, a, b, min_runs=10)["median_ms"]
  chain, warm_s = (2, 0.0) if on_cpu else (20, 1.0)
  start = time.perf_counter()
  while time.perf_counter() - start < warm_s:
    jax.block_until_ready([product(a, b) for _ in range(chain)])
  chains = []
  for _ in range(3 if on_cpu else 7):
    start = time.perf_counter()
    jax.block_until_ready([product(a, b) for _ in range(chain)])
    chains.append((time.perf_counter() - start) * 1e3 / chain)
  return {
      "copy_gbps": 2 * x.nbytes / copy_ms / 1e6,
      "matmul_tflops": 2 * matmul_n**3 / matmul_ms / 1e9,
      "matmul_tflops_sustained": 2 * matmul_n**3 / statistics.median(chains) / 1e9,
  }


def time_torch(fn: Callable[[], Any], *, warmup: int = 5, runs: int = 50) -> dict[str, float]:
  """Milliseconds of a PyTorch CUDA callable, timed with CUDA events after warm-up (for peers run in the same process)."""
  import torch  # Peers only: torch is never a dependency of ltm_jax.

  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  ms = []
  for _ in range(runs):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    ms.append(start.elapsed_time(end))
  return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "runs": len(ms)}
