"""Training-step throughput: tokens/s, model FLOP/s, compile time and compiled temp memory per config variant.

    python benchmarks/train.py                                   # CPU default: the tiny config's mixer variants
    python benchmarks/train.py --config configs/base_125m.py     # one config (GPU), as it is
    python benchmarks/train.py --variant model.dtype=bfloat16 --variant model.layer_pattern=A
    python benchmarks/train.py --config configs/tiny_ltm.py --name train-latent \
        --variant latent.enabled=false --variant latent.inner_steps=4 --variant "" --variant latent.inner_steps=16
    python benchmarks/train.py --config configs/small.py --mfu   # + model FLOP/s over the measured bf16 matmul rate
    python benchmarks/train.py --config configs/base_125m.py --quick   # the config at toy sizes: proves it steps

Times the real jitted train step (AdamW update included) on random tokens, median over steps after warm-up, each
step waited for (step_ms, tokens_per_s, model_tflops, mfu), and the mean of as many steps called back to back and
waited for once, as the training loop runs them (step_ms_pipelined, model_tflops_pipelined, mfu_pipelined; the
difference is the device's idle time between steps, which the loop hides); dispatch_ms is how long the host takes to
enqueue one step. Writes benchmarks/results/<name>-<device>.json (name: train by default; <name>-quick with
--quick). A variant that fails to compile or step (an unsupported backend, out of memory) gets a row with its error;
the others still run, the file is still written, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys

import common  # First: puts the checkout on sys.path.
import jax

from ltm_jax import config as config_lib
from ltm_jax.info import model_info

CPU_VARIANTS = ("", "model.layer_pattern=A", "model.layer_pattern=R", "model.wkv_impl=associative",
                "model.dtype=bfloat16")


def measure(cfg: config_lib.Config, steps: int) -> dict:
  t = cfg.train
  step, state, batch, compile_s = common.compiled_train_step(cfg)
  memory = step.memory_analysis()
  _, metrics, timed = common.time_train_steps(step, state, batch, steps)
  timed.pop("step_times_ms")
  info = model_info(cfg)
  return {
      "params": info["params"],
      "batch": f"{t.batch_size}x{t.seq_len}",
      "compile_s": compile_s,
      **timed,
      "tokens_per_s": info["tokens_per_step"] / (timed["step_ms"] * 1e-3),
      "model_tflops": info["flops_per_step_train"] / (timed["step_ms"] * 1e-3) / 1e12,
      "model_tflops_pipelined": info["flops_per_step_train"] / (timed["step_ms_pipelined"] * 1e-3) / 1e12,
      "temp_mib": getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory else None,
      "loss": float(metrics["loss"]),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(common.ROOT / "configs" / "tiny.py"))
  parser.add_argument("--variant", action="append", default=None,
                      help="comma-separated key=value overrides; repeat for several variants ('' = as is)")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--name", default="train", help="results file benchmarks/results/<name>-<device>.json")
  parser.add_argument("--quick", action="store_true", help="the config at toy sizes, 2 steps: proves it in seconds")
  parser.add_argument("--mfu", action="store_true",
                      help="measure the bf16 matmul rate (common.measure_ceilings) and report model_tflops over it")
  args = parser.parse_args()
  if args.quick:
    args.steps, args.name = min(args.steps, 2), f"{args.name}-quick"
  ceilings = common.measure_ceilings() if args.mfu else None
  if ceilings:
    print(f"ceilings: {ceilings}")
  variants = args.variant if args.variant is not None else (
      CPU_VARIANTS if jax.default_backend() == "cpu" else ("",))
  rows = []

  def write():  # After every variant: a later one that hangs past the caller's timeout costs only itself.
    return common.write_results(args.name, rows, config_file=args.config, steps=args.steps, quick=args.quick,
                                ceilings=ceilings)

  for variant in variants:
    cfg = config_lib.load_config(args.config, [v for v in variant.split(",") if v])
    if args.quick:
      cfg = common.toy_config(cfg)
    row = {"config": cfg.name, "variant": variant or "(as is)"}
    try:
      row.update(measure(cfg, args.steps))
    except Exception as e:  # noqa: BLE001  (one variant's failure must not cost the others' measurements)
      row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
      rows.append(row)
      print(f"failed {row['config']} {row['variant']}: {row['error']}", flush=True)
      write()
      continue
    if ceilings:
      # Model FLOPs utilisation against the matmul rate this machine reached, not a datasheet number.
      row["mfu"] = row["model_tflops"] / ceilings["matmul_tflops"]
      row["mfu_sustained"] = row["model_tflops"] / ceilings["matmul_tflops_sustained"]
      if "model_tflops_pipelined" in row:
        row["mfu_pipelined"] = row["model_tflops_pipelined"] / ceilings["matmul_tflops"]
    rows.append(row)
    print(f"measured {row['config']} {row['variant']}: {row['tokens_per_s']:.0f} tokens/s", flush=True)
    write()
  common.print_table(rows, ["config", "variant", "params", "batch", "compile_s", "step_ms", "step_ms_pipelined",
                            "dispatch_ms", "tokens_per_s", "model_tflops"] + (["mfu", "mfu_pipelined"] if ceilings else []) + ["temp_mib"]
                     + (["error"] if any("error" in row for row in rows) else []))
  print(f"wrote {write()}")
  return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
