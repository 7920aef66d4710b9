"""What a latent train step costs against a plain step of the same decoder, measured side by side in one process.

    python benchmarks/latent_cost.py                                     # configs/ltm_code.py and its levers
    python benchmarks/latent_cost.py --config configs/ltm_markov.py --variant "latent.inner_steps=4" ...

Every variant's jitted train step (AdamW update included) is compiled first; then the steps run round-robin, one
step of each variant per round, so drift in the machine's speed (other jobs, clocks) falls on all of them alike.
Reports the median step time of each and its ratio to the plain decoder's (latent.enabled=false) beside the ratio of
their training FLOPs (`ltm_jax.flops`, what `ltm info` prints), and writes benchmarks/results/<name>-<device>.json. Inputs are random tokens: the cost of a step does not depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import jax

from ltm_jax import config as config_lib
from ltm_jax import flops
from ltm_jax import model as model_lib
from ltm_jax.train.optimizer import learning_rate, make_optimizer
from ltm_jax.train.step import create_train_state, make_train_step

PLAIN = "latent.enabled=false"
# configs/ltm_code.py (z in the top block, encoder + 2 inner steps on the prefix) and the levers that led to it, each
# written as changes from that config.
EVERY_BLOCK = "latent.top_layers=null,latent.n_per_layer=2"
DEFAULT_VARIANTS = (
    PLAIN,
    f"{EVERY_BLOCK},latent.encoder=false,latent.inner_steps=8,latent.inner_lr=0.3,latent.continuation_fraction=0",
    EVERY_BLOCK,
    "latent.top_layers=2,latent.n_per_layer=4",
    "",
    "latent.inner_steps=1",
    "latent.inner_steps=0",
    "latent.encoder_width=64",
)


def compiled_step(cfg: config_lib.Config):
  t = cfg.train
  model, optimizer = model_lib.LM(cfg.model, cfg.latent), make_optimizer(t)
  state = create_train_state(model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent), optimizer, 0)
  tokens = jax.random.randint(jax.random.key(1), (t.batch_size, t.seq_len + 1), 0, 256)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  step = make_train_step(model, optimizer, learning_rate(t), t.grad_accum)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return compiled, state, batch, time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(common.ROOT / "configs" / "ltm_code.py"))
  parser.add_argument("--variant", action="append", default=None,
                      help=f"comma-separated key=value overrides; repeat for several (default: {len(DEFAULT_VARIANTS)}"
                           f" variants); '{PLAIN}' is the reference and is always measured")
  parser.add_argument("--rounds", type=int, default=10, help="steps of every variant, after 2 warm-up rounds")
  parser.add_argument("--name", default="latent-cost-code", help="results file benchmarks/results/<name>-<device>.json")
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every variant")
  args = parser.parse_args()
  variants = list(args.variant or DEFAULT_VARIANTS)
  if PLAIN not in variants:
    variants.insert(0, PLAIN)
  runs = {}
  for variant in variants:
    cfg = config_lib.load_config(args.config, list(args.overrides) + [v for v in variant.split(",") if v])
    runs[variant] = [*compiled_step(cfg), [], flops.flops_per_token(cfg.model, cfg.latent, cfg.train.seq_len)[1]]
    print(f"compiled {variant or '(as is)'} in {runs[variant][3]:.1f} s", flush=True)
  for round_ in range(args.rounds + 2):
    for variant, run in runs.items():
      step, state, batch, _, times, _ = run
      start = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      run[1] = state
      if round_ >= 2:
        times.append(time.perf_counter() - start)
  plain_ms, plain_flops = statistics.median(runs[PLAIN][4]) * 1e3, runs[PLAIN][5]
  rows = []
  for variant, (_, _, batch, compile_s, times, train_flops) in runs.items():
    ms = statistics.median(times) * 1e3
    rows.append({"variant": variant, "batch": "x".join(map(str, batch["inputs"].shape)), "compile_s": compile_s,
                 "step_ms": ms, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
                 "vs_plain": ms / plain_ms, "flops_per_token": train_flops, "flops_vs_plain": train_flops / plain_flops})
  common.print_table(rows, ["variant", "batch", "compile_s", "step_ms", "step_ms_min", "step_ms_max", "vs_plain",
                            "flops_vs_plain"])
  path = common.write_results(args.name, rows, config_file=args.config, overrides=args.overrides, rounds=args.rounds)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
