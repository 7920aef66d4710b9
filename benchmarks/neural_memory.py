"""The neural memory op's backends: forward and forward+backward under jit, median ms.

  python benchmarks/neural_memory.py            # CPU shapes, a few minutes on 2 cores
  python benchmarks/neural_memory.py --quick    # tiny shapes: the script end to end in seconds

Both backends compute the same function for a given chunk size (tested to float64 rounding), so the table is a
choice of algorithm: "scan" steps token by token with autodiff's per-token gradient; "chunked" does a chunk's
gradients and reads as matrix products with one sequential step per chunk. Inputs are random: unit q and k, gates
uniform in (0.5, 1) for eta, (0, max_lr / chunk) for theta, (0, 0.05) for alpha (the layer's ranges). Writes
benchmarks/results/neural-memory-<device>.json.
"""

from __future__ import annotations

import argparse

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops.neural_memory import AVAILABLE, initial_state, neural_memory

# (B, T, H, N, depth, chunk)
SHAPES = [(8, 256, 4, 32, 2, 16), (8, 256, 4, 32, 1, 16), (4, 512, 8, 64, 2, 16), (4, 512, 8, 64, 2, 64)]
QUICK = [(2, 32, 2, 8, 2, 8)]


def inputs(batch, length, heads, size, depth, chunk, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, k = (f32(unit(rng.normal(size=(batch, length, heads, size)))) for _ in range(2))
  v = f32(rng.normal(size=(batch, length, heads, size)))
  gates = tuple(f32(rng.uniform(lo, hi, (batch, length, heads))) for lo, hi in ((0.5, 1), (0, 0.5 / chunk), (0, 0.05)))
  dims = [size] + [2 * size] * (depth - 1) + [size]
  weights = [f32(rng.normal(size=(heads, i, o)) / np.sqrt(i)) for i, o in zip(dims, dims[1:])]
  return (q, k, v, *gates), initial_state(weights, batch)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  rows = []
  for shape in QUICK if args.quick else SHAPES:
    *_, chunk = shape
    x, state = inputs(*shape)
    for impl in AVAILABLE:
      run = lambda x, weights, impl=impl: neural_memory(*x, state._replace(weights=weights), chunk=chunk,
                                                        impl=impl)[0]
      loss = lambda x, weights, run=run: jnp.sum(run(x, weights) ** 2)
      forward, forward_compile = common.compile_fn(run, x, state.weights)
      # Gradients of every input and of the initial weights, as training takes them.
      backward, backward_compile = common.compile_fn(jax.grad(loss, argnums=(0, 1)), x, state.weights)
      rows.append(dict(shape="x".join(map(str, shape[:4])), depth=shape[4], chunk=chunk, impl=impl,
                       fwd_ms=common.time_fn(forward, x, state.weights)["median_ms"],
                       fwd_bwd_ms=common.time_fn(backward, x, state.weights)["median_ms"],
                       compile_s=forward_compile + backward_compile))
      print(rows[-1], flush=True)
  common.print_table(rows, ("shape", "depth", "chunk", "impl", "fwd_ms", "fwd_bwd_ms", "compile_s"))
  print(common.write_results("neural-memory" + ("-quick" if args.quick else ""), rows,
                             shapes="B x T x H x N", note="float32, jit, median over runs after warm-up"))


if __name__ == "__main__":
  main()
