"""The train step of configs/base_125m.py under every kind of mesh layout on 8 simulated CPU devices: compiled temp
memory per device, the collectives in the compiled program, the step time, and the MFU projected for 8 H100s.

  python benchmarks/scale.py                       # all layouts at batch 8 x 32 (11 minutes on 2 shared CPU cores)
  python benchmarks/scale.py --batch 64 --seq 2048 --runs 0 --pipeline-micro-batches 16 --tag full
                                                   # base_125m's own batch, compiled and analysed only

Every layout compiles the real sharded step (ltm_jax.train.step with ltm_jax.parallel's layout) of base_125m with
model.scan_layers=true, at a reduced batch and sequence so the CPU run stays short; the model (12 layers, d_model
768, GQA 12/4, 125M parameters) is unchanged. Columns:

  temp_MiB        XLA's scratch per device (activations kept for the backward pass, gradients, temporaries).
  flops_dev       the compiled per-device program's FLOPs (XLA's cost analysis), loops counted by their trip count.
  all_reduce ...  collective ops in the compiled HLO text (an op inside a loop body counts once).
  step_ms         one step on the 8 simulated devices (min of the timed runs): the 8 devices share the host's
                  cores, so this is no guide to a GPU and only compares layouts loosely.
  bubble          the pipeline's idle fraction (S - 1) / (M + S - 1).
  mfu_h100        projected MFU on 8 H100 SXM (989 dense bf16 TFLOP/s each): model FLOPs / (8 * flops_dev), times an
                  assumed per-device efficiency (EFFICIENCY: 0.5 of peak for the FLOPs each device runs).
                  The per-device FLOPs already hold what a layout wastes: work replicated across devices (the
                  embedding and head on every stage, whole-batch recomputation) and the pipeline bubble's
                  iterations, which this implementation computes on stale inputs rather than idling. Not modelled:
                  communication time (the collective counts show what each layout exchanges; NVLink on one 8-GPU
                  node hides much of it, which is why layouts stay within one node), and the efficiency's own
                  dependence on the per-device matmul sizes.

Writes benchmarks/results/scale-cpu8.json.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import common  # noqa: E402  First: puts the checkout on sys.path.
import jax  # noqa: E402
import numpy as np  # noqa: E402

from ltm_jax import config as config_lib  # noqa: E402
from ltm_jax import model as model_lib  # noqa: E402
from ltm_jax import parallel  # noqa: E402
from ltm_jax.info import model_info  # noqa: E402
from ltm_jax.parallel import pipeline  # noqa: E402
from ltm_jax.train.optimizer import learning_rate, make_optimizer  # noqa: E402
from ltm_jax.train.step import make_train_step  # noqa: E402

CONFIG = "configs/base_125m.py"
H100_TFLOPS = 989.0
EFFICIENCY = 0.5
# The 8 simulated devices share this host's memory: a layout whose 8 devices' arguments and scratch exceed this is
# compiled and analysed but not run.
TIME_LIMIT_GIB = 4.0
# name: ((pipeline, data, fsdp, tensor), pipeline micro-batches)
LAYOUTS = {
    "data8": ((1, 8, 1, 1), 1),
    "fsdp8": ((1, 1, 8, 1), 1),
    "data2_tensor4": ((1, 2, 1, 4), 1),
    "data2_fsdp2_tensor2": ((1, 2, 2, 2), 1),
    "pipe2_data4": ((2, 4, 1, 1), 2),
    "pipe2_data2_tensor2": ((2, 2, 1, 2), 4),
    "pipe4_data2": ((4, 2, 1, 1), 4),
    "pipe2_fsdp4": ((2, 1, 4, 1), 2),
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
MIB = 2**20


def collective_counts(hlo: str) -> dict[str, int]:
  """Collective ops in compiled HLO text: synchronous `op(` and asynchronous `op-start(` forms."""
  return {name.replace("-", "_"): len(re.findall(rf"\s{name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_DEFINES = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = [a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(r" dot\(%([\w.\-]+), %[\w.\-]+\).*lhs_contracting_dims=\{([0-9,]*)\}")
_CALLS = re.compile(r"(calls|body)=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def dot_flops(hlo: str) -> float:
  """The matmul FLOPs of one device's compiled program: 2 * output size * contracted size of every dot, each
  computation counted as often as it runs (a while body times its known trip count). XLA's own cost analysis
  counts a loop body once, which a scanned layer stack and a pipeline schedule make useless."""
  local: dict[str, float] = {}
  children: dict[str, list[tuple[str, int]]] = {}
  entry = current = None
  shapes: dict[str, list[int]] = {}
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header:
      current, shapes = header.group(1), {}
      local[current], children[current] = 0.0, []
      entry = current if line.startswith("ENTRY") else entry
      for name, dims in re.findall(r"([\w.\-]+): [a-z0-9]+\[([0-9,]*)\]", line):  # Parameters in the header.
        shapes[name] = [int(d) for d in dims.split(",") if d]
      continue
    if current is None:
      continue
    defined = _DEFINES.match(line)
    if defined:
      out = [int(d) for d in defined.group(2).split(",") if d]
      shapes[defined.group(1)] = out
      dot = _DOT.search(line)
      if dot and dot.group(1) in shapes:
        lhs = shapes[dot.group(1)]
        contracted = np.prod([lhs[int(c)] for c in dot.group(2).split(",") if c])
        local[current] += 2.0 * float(np.prod(out)) * float(contracted)
    trips = _TRIPS.search(line)
    for kind, callee in _CALLS.findall(line):
      children[current].append((callee, int(trips.group(1)) if kind == "body" and trips else 1))
  totals: dict[str, float] = {}

  def total(name: str) -> float:
    if name not in totals:
      totals[name] = local.get(name, 0.0) + sum(k * total(c) for c, k in children.get(name, []))
    return totals[name]

  return total(entry)


def layout_row(name: str, batch: int, seq: int, runs: int, micro_batches: int | None = None) -> dict:
  sizes, micro = LAYOUTS[name]
  micro = micro if micro_batches is None or sizes[0] == 1 else micro_batches
  overrides = ["model.scan_layers=true", f"model.pipeline_micro_batches={micro}", f"train.batch_size={batch}",
               f"train.seq_len={seq}", "train.grad_accum=1"]
  overrides += [f"mesh.{axis}={size}" for axis, size in zip(config_lib.MESH_AXES, sizes)]
  cfg = config_lib.load_config(common.ROOT / CONFIG, overrides)
  optimizer = make_optimizer(cfg.train)
  layout = parallel.make_layout(cfg, optimizer)
  abstract = parallel.abstract_state(cfg, optimizer, layout)  # Compiled on shapes: nothing allocated yet.
  tokens = jax.ShapeDtypeStruct((batch, seq), np.int32, sharding=layout.batch)
  step = make_train_step(model_lib.LM(cfg.model, cfg.latent), optimizer, learning_rate(cfg.train),
                         cfg.train.grad_accum, layout)
  started = time.perf_counter()
  compiled = step.lower(abstract, {"inputs": tokens, "targets": tokens}).compile()
  compile_s = time.perf_counter() - started
  hlo = compiled.as_text()
  memory = compiled.memory_analysis()
  all_devices_gib = 8 * (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**30
  step_ms = loss = None
  if runs and all_devices_gib <= TIME_LIMIT_GIB:
    state = parallel.init_state(cfg, optimizer, layout)
    rng = np.random.default_rng(0)
    host = {k: rng.integers(0, cfg.model.vocab_size, (batch, seq), dtype=np.int32) for k in ("inputs", "targets")}
    data = parallel.put_batch(host, layout.batch)
    times = []
    for _ in range(runs + 1):  # The first run is a warm-up.
      started = time.perf_counter()
      state, metrics = compiled(state, data)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - started)
    step_ms, loss = 1e3 * min(times[1:]), float(metrics["loss"])
    del state, data
  info = model_info(cfg)
  stages = sizes[0]
  bubble = pipeline.bubble_fraction(stages, micro if stages > 1 else 1)
  flops_dev = dot_flops(hlo)
  model_flops = info["flops_per_step_train"]
  row = {"layout": name, "pipeline": sizes[0], "data": sizes[1], "fsdp": sizes[2], "tensor": sizes[3],
         "micro_batches": micro if stages > 1 else 1, "bubble": bubble,
         "temp_MiB": memory.temp_size_in_bytes / MIB, "args_MiB": memory.argument_size_in_bytes / MIB,
         **collective_counts(hlo), "step_ms": step_ms, "all_devices_GiB": all_devices_gib, "compile_s": compile_s,
         "flops_dev": flops_dev, "model_flops": model_flops,
         "useful_fraction": model_flops / (8 * flops_dev),
         "mfu_h100": EFFICIENCY * model_flops / (8 * flops_dev),
         "loss": loss}
  print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--runs", type=int, default=2, help="timed steps per layout after one warm-up")
  parser.add_argument("--only", default=None, help="comma-separated layout names")
  parser.add_argument("--pipeline-micro-batches", type=int, default=None,
                      help="micro-batches of every pipelined layout (default: each layout's own, at most 4)")
  parser.add_argument("--tag", default="", help="results file scale-cpu8-TAG.json instead of scale-cpu8.json")
  args = parser.parse_args()
  assert jax.device_count() == 8, jax.devices()
  names = args.only.split(",") if args.only else list(LAYOUTS)
  rows = [layout_row(name, args.batch, args.seq, args.runs, args.pipeline_micro_batches) for name in names]
  common.print_table(rows, ["layout", "micro_batches", "bubble", "temp_MiB", "all_reduce", "all_gather",
                            "reduce_scatter", "collective_permute", "step_ms", "flops_dev", "useful_fraction",
                            "mfu_h100"])
  path = common.write_results(
      "scale", rows, config=CONFIG, batch_size=args.batch, seq_len=args.seq, grad_accum=1, scan_layers=True,
      devices="8 simulated CPU devices (--xla_force_host_platform_device_count=8)", timed_runs=args.runs,
      time_limit_gib=TIME_LIMIT_GIB, pipeline_micro_batches=args.pipeline_micro_batches,
      h100_peak_tflops=H100_TFLOPS, assumed_efficiency=EFFICIENCY,
      projection="mfu_h100 = efficiency * model_flops / (8 * flops_dev); communication not modelled")
  # common names files by the first device's kind; these are 8 simulated devices.
  final = path.with_name(f"scale-cpu8{'-' + args.tag if args.tag else ''}.json")
  path.replace(final)
  print(f"wrote {final}")


if __name__ == "__main__":
  main()
