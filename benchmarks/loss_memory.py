"""Compiled temp memory of the train step against model.loss_chunk on an RWKV World vocabulary (65,536 ids).

Every number comes from `ltm info --config ... --json --compile`, run in a fresh process per row: the real train
step compiled for this machine's backend on abstract inputs, nothing run. configs/small_rwkv7.py (RWKV-7 + sliding
window attention, d_model 512) with model.vocab_size=65536 at train.seq_len=2048, batch 4, one micro-batch; rows
differ in model.loss_chunk (0: the whole [4, 2048, 65536] float32 logits at once, 2 GiB) and model.remat. XLA_FLAGS
schedules for memory (--xla_cpu_enable_concurrency_optimized_scheduler=false), as GPU compilers do.

  python benchmarks/loss_memory.py          # chunks 0, 256, 1024 x remat none, full (2-3 minutes a row on CPU)
  python benchmarks/loss_memory.py --chunks 0 256 --remat none

Writes benchmarks/results/loss_memory-<device>.json.
"""

from __future__ import annotations

import argparse

import common  # First: puts the checkout on sys.path.
import memory  # Its `info` runs `ltm info --compile` in a fresh process.

CONFIG = "configs/small_rwkv7.py"
SHAPE = ["model.vocab_size=65536", "train.seq_len=2048", "train.batch_size=4", "train.grad_accum=1"]
MIB = 2**20


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 1024])
  parser.add_argument("--remat", nargs="+", default=["none", "full"], help="model.remat policies, each a row group")
  args = parser.parse_args()
  memory.CONFIG = CONFIG
  rows = []
  for remat in args.remat:
    group = []
    for chunk in args.chunks:
      out = memory.info(SHAPE + [f"model.remat={remat}", f"model.loss_chunk={chunk}"])
      group.append({"remat": remat, "loss_chunk": chunk, "temp_mib": round(out["compiled_temp_bytes"] / MIB, 1),
                    "total_mib": round(out["compiled_total_bytes"] / MIB, 1), "compile_s": out["compile_seconds"]})
      print(group[-1], flush=True)
    whole = next((r["temp_mib"] for r in group if r["loss_chunk"] == 0), None)
    for r in group:
      r["saved_mib"] = None if whole is None else round(whole - r["temp_mib"], 1)
    rows += group
  common.print_table(rows, ["remat", "loss_chunk", "temp_mib", "saved_mib", "total_mib", "compile_s"])
  common.write_results("loss_memory", rows, config=CONFIG, overrides=SHAPE, scheduler=memory.MEMORY_SCHEDULER)


if __name__ == "__main__":
  main()
