"""MM-Rec (D layers): train-step time and compiled temp memory against sequence length, with and without
precomputed projections, per MDI backend, and per remat policy.

  python benchmarks/mmrec.py                       # the CPU run: a few minutes on 2 loaded cores
  python benchmarks/mmrec.py --lengths 512 --d-model 256 --batch 8 --name mmrec-wide
  python benchmarks/mmrec.py --section op          # the MDI op's backends alone (writes mmrec-op-<device>.json)

The model: `--layers` D blocks of `--d-model` (4 heads, segments of 16, 16 bank slots), batch `--batch`. The step is
forward + backward + an SGD update of every parameter, jitted. Time: median ms over repeated steps (other jobs may
share the machine: read ratios). Memory: XLA's temp bytes for the compiled step (activations kept for the backward
pass, gradients, scratch), scheduled for memory as GPU compilers do
(XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false, set before jax starts).

Rows per length: the reference (precomputed projections, `mmrec_impl` auto, no remat); `per-step projections`
(`model.mmrec_precompute=false`); `scan backend` (autodiff through the reference loop); and the remat policies:
`model.remat` full (whole block), save_ffn (the mixer recomputed), save_mixer (the FFN recomputed), and
`model.mmrec_remat` recurrence / memory (only the MDI op or the memory attention recomputed). Remat rows are timed at
the shortest length only, and past it only full, recurrence and memory are compiled (for their memory), to keep the
CPU run short.

`--section op`: the MDI op alone, forward + backward (gradients of gate_z, z, gamma, W_gh and the scale), the "scan"
and "adjoint" backends timed in alternation (7 rounds) at a few (B, T, D), min and median ms.

Writes benchmarks/results/<name>-<device>.json.
"""

from __future__ import annotations

import os

_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if _SCHEDULER not in os.environ.get("XLA_FLAGS", ""):  # Must precede jax's start.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _SCHEDULER).strip()

import argparse  # noqa: E402

import common  # noqa: E402  First: puts the checkout on sys.path.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from ltm_jax import model as model_lib  # noqa: E402
from ltm_jax.config import ModelConfig  # noqa: E402
from ltm_jax.ops.mdi import AVAILABLE, mdi  # noqa: E402

MIB = 2**20
VARIANTS = {  # name -> model overrides
    "precomputed": {},
    "per-step projections": {"mmrec_precompute": False},
    "scan backend": {"mmrec_impl": "scan"},
    "remat full (block)": {"remat": "full"},
    "remat mixer (save_ffn)": {"remat": "save_ffn"},
    "remat FFN (save_mixer)": {"remat": "save_mixer"},
    "remat MDI recurrence": {"mmrec_remat": "recurrence"},
    "remat memory attention": {"mmrec_remat": "memory"},
}
TIMED_EVERYWHERE = ("precomputed", "per-step projections", "scan backend")
# Past the shortest length, the remat rows that show how memory grows (each row is a compilation of minutes' share).
LONG = TIMED_EVERYWHERE + ("remat full (block)", "remat MDI recurrence", "remat memory attention")


def train_step(cfg: ModelConfig):
  model = model_lib.LM(cfg)

  def step(params, tokens):
    def loss(params):
      logits, _ = model.apply({"params": params}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

  return step


def row(name: str, overrides: dict, length: int, args, timed: bool) -> dict:
  cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, layer_pattern="D", mmrec_segment=16,
                    mmrec_slots=16, max_seq_len=length, **overrides)
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (args.batch, length + 1), 0, cfg.vocab_size)
  compiled, compile_s = common.compile_fn(train_step(cfg), params, tokens)
  out = {"variant": name, "seq_len": length, "temp_MiB": compiled.memory_analysis().temp_size_in_bytes / MIB,
         "compile_s": compile_s}
  if timed:
    out.update(common.time_fn(compiled, params, tokens, warmup=1, min_runs=3, max_runs=10, budget_s=args.budget))
  print(out, flush=True)
  return out


OP_SHAPES = ((32, 128, 128), (2, 2048, 64), (8, 512, 256))  # (B, T, D): tiny_mmrec's training shape, long, wide.


def op_rows(rounds: int = 7) -> list[dict]:
  rows = []
  for batch, length, width in OP_SHAPES:
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    args = (normal(batch, length, width), normal(batch, length, width),
            jnp.asarray(rng.uniform(size=(batch, length, width)) * 0.1, jnp.float32), normal(width, width) * 0.05,
            jnp.ones(width), jnp.zeros((batch, width)))
    grads = {impl: jax.jit(jax.grad(lambda *a, impl=impl: jnp.sum(mdi(*a, impl=impl)[0] ** 2), argnums=range(5)))
             for impl in AVAILABLE}
    for fn in grads.values():
      jax.block_until_ready(fn(*args))
    times = {impl: [] for impl in grads}
    for _ in range(rounds):  # Alternating, so that a change in the machine's load hits both backends alike.
      for impl, fn in grads.items():
        times[impl].append(common.time_fn(fn, *args, warmup=0, min_runs=1, max_runs=1)["median_ms"])
    for impl, ms in times.items():
      rows.append({"B": batch, "T": length, "D": width, "impl": impl, "min_ms": min(ms),
                   "median_ms": float(np.median(ms)), "runs": rounds})
      print(rows[-1], flush=True)
  common.print_table(rows, ["B", "T", "D", "impl", "min_ms", "median_ms"])
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed steps per row (at least 3 steps)")
  parser.add_argument("--name", default=None, help="default: mmrec, or mmrec-op for --section op")
  parser.add_argument("--section", choices=("model", "op"), default="model")
  args = parser.parse_args()
  if args.section == "op":
    path = common.write_results(args.name or "mmrec-op", op_rows(), shapes=OP_SHAPES)
    print(f"wrote {path}")
    return
  rows = []
  for length in args.lengths:
    baseline = None
    for name, overrides in VARIANTS.items():
      if length != min(args.lengths) and name not in LONG:
        continue
      r = row(name, overrides, length, args, timed=name in TIMED_EVERYWHERE or length == min(args.lengths))
      baseline = baseline or r
      r["temp_vs_precomputed"] = r["temp_MiB"] / baseline["temp_MiB"]
      if "median_ms" in r:
        r["time_vs_precomputed"] = r["median_ms"] / baseline["median_ms"]
      rows.append(r)
  common.print_table(rows, ["variant", "seq_len", "median_ms", "time_vs_precomputed", "temp_MiB",
                            "temp_vs_precomputed", "compile_s"])
  path = common.write_results(args.name or "mmrec", rows, d_model=args.d_model, layers=args.layers, batch=args.batch,
                              lengths=args.lengths, xla_flags=os.environ["XLA_FLAGS"])
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
