"""Training-step throughput: tokens/s, model FLOP/s, compile time and compiled temp memory per config variant.

    python benchmarks/train.py                                   # CPU default: the tiny config's mixer variants
    python benchmarks/train.py --config configs/base_125m.py     # one config (GPU), as it is
    python benchmarks/train.py --variant model.dtype=bfloat16 --variant model.layer_pattern=A
    python benchmarks/train.py --config configs/tiny_ltm.py --name train-latent \
        --variant latent.enabled=false --variant latent.inner_steps=4 --variant "" --variant latent.inner_steps=16

Times the real jitted train step (AdamW update included) on random tokens, median over steps after warm-up, and
writes benchmarks/results/<name>-<device>.json (name: train by default).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import jax

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.info import model_info
from ltm_jax.train.optimizer import learning_rate, make_optimizer
from ltm_jax.train.step import create_train_state, make_train_step

CPU_VARIANTS = ("", "model.layer_pattern=A", "model.layer_pattern=R", "model.wkv_impl=associative",
                "model.dtype=bfloat16")


def measure(cfg: config_lib.Config, steps: int) -> dict:
  t = cfg.train
  model, optimizer = model_lib.LM(cfg.model, cfg.latent), make_optimizer(t)
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent), optimizer, 0)
  tokens = jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, cfg.model.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  step = make_train_step(model, optimizer, learning_rate(t), t.grad_accum)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  for _ in range(2):  # Warm-up.
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  median = statistics.median(times)
  info = model_info(cfg)
  return {
      "params": info["params"],
      "batch": f"{t.batch_size}x{t.seq_len}",
      "compile_s": compile_s,
      "step_ms": median * 1e3,
      "step_ms_min": min(times) * 1e3,
      "step_ms_max": max(times) * 1e3,
      "tokens_per_s": info["tokens_per_step"] / median,
      "model_tflops": info["flops_per_step_train"] / median / 1e12,
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
  args = parser.parse_args()
  variants = args.variant if args.variant is not None else (
      CPU_VARIANTS if jax.default_backend() == "cpu" else ("",))
  rows = []
  for variant in variants:
    cfg = config_lib.load_config(args.config, [v for v in variant.split(",") if v])
    row = {"config": cfg.name, "variant": variant or "(as is)", **measure(cfg, args.steps)}
    rows.append(row)
    print(f"measured {row['config']} {row['variant']}: {row['tokens_per_s']:.0f} tokens/s", flush=True)
  common.print_table(rows, ["config", "variant", "params", "batch", "compile_s", "step_ms", "tokens_per_s",
                            "model_tflops", "temp_mib"])
  path = common.write_results(args.name, rows, config_file=args.config, steps=args.steps)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
