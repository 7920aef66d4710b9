"""Times every backend of the RWKV-4 WKV op, forward and forward+backward, and checks it against `scan`.

  python benchmarks/wkv.py                 # CPU: training-like shapes, about a minute on 2 cores
  python benchmarks/wkv.py --shapes gpu    # the default on an accelerator: long and wide, bfloat16 and float32

Writes benchmarks/results/wkv4-<device>.json. The fastest forward+backward backend per platform goes into
`ltm_jax.ops.wkv4.AUTO`.
"""

from __future__ import annotations

import argparse

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp

from ltm_jax.ops.wkv4 import AVAILABLE, wkv4

# (B, T, C). CPU: the training shapes the auto choice is for. GPU: a long, wide batch and one very long sequence.
SHAPES = {
    "cpu": [(8, 256, 128), (16, 256, 256), (32, 256, 512)],
    "gpu": [(8, 4096, 4096), (1, 65536, 2048)],
}
DTYPES = {"cpu": ["float32"], "gpu": ["bfloat16", "float32"]}
COLUMNS = ("impl", "shape", "dtype", "fwd_ms", "fwd_bwd_ms", "fwd_gbps", "fwd_bwd_gbps", "max_abs_err", "compile_s")


def _inputs(shape, dtype):
  b, t, c = shape
  keys = jax.random.split(jax.random.key(0), 5)
  w = -jnp.exp(jax.random.uniform(keys[0], (c,), minval=-3.0, maxval=1.0))
  u = 0.5 * jax.random.normal(keys[1], (c,))
  k, v, dy = (jax.random.normal(key, (b, t, c)).astype(dtype) for key in keys[2:])
  return w, u, k, v, dy


def _fns(impl):
  forward = lambda w, u, k, v: wkv4(w, u, k, v, impl=impl)[0]

  def forward_backward(w, u, k, v, dy):
    y, vjp = jax.vjp(forward, w, u, k, v)
    return y, vjp(dy)

  return forward, forward_backward


def bench(impl, shape, dtype, reference):
  w, u, k, v, dy = _inputs(shape, dtype)
  forward, forward_backward = _fns(impl)
  fwd, fwd_compile = common.compile_fn(forward, w, u, k, v)
  fwd_bwd, bwd_compile = common.compile_fn(forward_backward, w, u, k, v, dy)
  fwd_t = common.time_fn(fwd, w, u, k, v)
  fwd_bwd_t = common.time_fn(fwd_bwd, w, u, k, v, dy)
  # Bytes that must cross memory at least once: k, v read and y written; the backward adds dy read, dk, dv written.
  tensor_bytes = shape[0] * shape[1] * shape[2] * jnp.dtype(dtype).itemsize
  err = float(jnp.max(jnp.abs(fwd(w, u, k, v).astype(jnp.float32) - reference)))
  return {
      "impl": impl,
      "shape": "x".join(map(str, shape)),
      "dtype": dtype,
      "fwd_ms": fwd_t["median_ms"],
      "fwd_bwd_ms": fwd_bwd_t["median_ms"],
      "fwd_gbps": 3 * tensor_bytes / fwd_t["median_ms"] / 1e6,
      "fwd_bwd_gbps": 6 * tensor_bytes / fwd_bwd_t["median_ms"] / 1e6,
      "max_abs_err": err,
      "compile_s": fwd_compile + bwd_compile,
      "fwd": fwd_t,
      "fwd_bwd": fwd_bwd_t,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  parser.add_argument("--shapes", choices=sorted(SHAPES), default=platform)
  parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32 on cpu, bfloat16 float32 on gpu")
  parser.add_argument("--impls", nargs="+", default=list(AVAILABLE), choices=AVAILABLE)
  args = parser.parse_args()
  dtypes = args.dtypes or DTYPES[args.shapes]

  rows = []
  for shape in SHAPES[args.shapes]:
    # The error baseline: the sequential reference in float32, whatever dtype is being timed.
    w, u, k, v, _ = _inputs(shape, jnp.float32)
    reference = jax.jit(_fns("scan")[0])(w, u, k, v)
    for dtype in dtypes:
      for impl in args.impls:
        rows.append(bench(impl, shape, dtype, reference))
        common.print_table(rows[-1:], COLUMNS)
  print()
  common.print_table(rows, COLUMNS)
  path = common.write_results(
      "wkv4", rows, shapes=args.shapes, note="shape is BxTxC; ms are medians; gbps counts k, v, y (+ dy, dk, dv) once")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
