#!/usr/bin/env python3
"""The feed-forward op's backends (ltm_jax.ops.ffn) timed forward and forward + backward at the models' shapes, with
the output and gradients of each compared against the xla backend's.

    python benchmarks/ffn.py                       # GPU: small_rwkv7's and base_125m's FFNs, bfloat16
    python benchmarks/ffn.py --shapes tiny         # any machine: a toy shape (the fused kernel interpreted off a GPU)
    python benchmarks/ffn.py --forms pipelined warp_specialized   # pallas_mgpu once per form of its kernel

Rows: one per backend; with --forms, pallas_mgpu's row is one per form of ltm_pallas.matmul_mgpu's kernel, named
"pallas_mgpu:<form>" (without it, pallas_mgpu runs its default form).

Columns: ms forward, ms forward + backward, TFLOP/s of the three matmuls each way (2 x M x d x G x n, M x n x e, ...),
and the largest difference to the xla backend relative to max |xla| (bfloat16 roundings apart: ~1e-2 is agreement).
Writes benchmarks/results/ffn-<device>.json.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
from ltm_jax.ops import ffn as ffn_op
from ltm_pallas import matmul_mgpu

# name -> (activation, rows M = batch x length, d_model, hidden n): the configs' train-step shapes.
SHAPES = {
    "gpu": {
        "small_rwkv7 channel mix": ("relu2", 32 * 1024, 512, 2048),
        "base_125m_rwkv7 channel mix": ("relu2", 32 * 2048, 768, 3072),
        "base_125m swiglu": ("swiglu", 64 * 2048, 768, 3584),
    },
    "tiny": {"toy relu2": ("relu2", 256, 128, 256), "toy swiglu": ("swiglu", 256, 128, 256)},
}


def _inputs(activation: str, rows: int, d: int, n: int):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  groups = ffn_op.ACTIVATIONS[activation]
  x = jax.random.normal(keys[0], (1, rows, d), jnp.bfloat16)
  w_in = (jax.random.normal(keys[1], (d, groups, n)) / np.sqrt(d)).astype(jnp.bfloat16)
  w_out = (jax.random.normal(keys[2], (n, d)) / np.sqrt(n)).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[3], (1, rows, d), jnp.bfloat16)
  return (x, w_in, w_out), dy


def _gap(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _forward(impl: str, activation: str):
  """y = ffn(x, W_in, W_out) by backend `impl`; "pallas_mgpu:<form>" runs pallas_mgpu's kernels in that form (on one
  device: the op's rows, unsharded)."""
  if ":" not in impl:
    return lambda x, w_in, w_out: ffn_op.ffn(x, w_in, w_out, activation=activation, impl=impl)
  form = impl.split(":", 1)[1]

  def forward(x, w_in, w_out):
    y = ffn_op.pallas_mgpu(x.reshape(-1, x.shape[-1]), w_in, w_out, activation=activation, form=form)
    return y.reshape(*x.shape[:2], -1)
  return forward


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", choices=tuple(SHAPES), default="gpu")
  parser.add_argument("--impls", nargs="+", default=list(ffn_op.AVAILABLE[1:]), choices=ffn_op.AVAILABLE,
                      help="backends to time besides xla, which always runs first (the reference)")
  parser.add_argument("--forms", nargs="+", choices=matmul_mgpu.FORMS,
                      help="time pallas_mgpu once per form of its kernel (default: its default form only)")
  args = parser.parse_args(argv)
  impls = ["xla"] + [impl for impl in args.impls if impl != "xla"]
  if args.forms and "pallas_mgpu" in impls:
    at = impls.index("pallas_mgpu")
    impls[at:at + 1] = [f"pallas_mgpu:{form}" for form in args.forms]
  rows = []
  for name, (activation, m, d, n) in SHAPES[args.shapes].items():
    inputs, dy = _inputs(activation, m, d, n)
    flops = 2.0 * m * d * n * (ffn_op.ACTIVATIONS[activation] + 1)  # The forward's two matmuls; the backward's twice.
    outputs = {}
    for impl in impls:
      forward = _forward(impl, activation)
      timing, _ = common.time_forward_backward(forward, inputs, dy)
      _, pull = jax.vjp(forward, *inputs)
      outputs[impl] = (forward(*inputs), *pull(dy))
      row = {"shape": name, "impl": impl, "M": m, "d": d, "n": n, "fwd_ms": timing["fwd_ms"],
             "fwd_bwd_ms": timing["fwd_bwd_ms"], "fwd_tflops": flops / timing["fwd_ms"] * 1e-9,
             "fwd_bwd_tflops": 3 * flops / timing["fwd_bwd_ms"] * 1e-9}
      row["max_rel_diff_vs_xla"] = max(_gap(a, b) for a, b in zip(outputs[impl], outputs["xla"]))
      rows.append(row)
  common.print_table(rows, ["shape", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops",
                            "max_rel_diff_vs_xla"])
  path = common.write_results("ffn", rows, shapes=args.shapes, impls=impls)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
