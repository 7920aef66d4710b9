#!/usr/bin/env python3
"""The chunked WKV-7 backward's two layouts side by side: value blocks as programs of their own (key-side gradients
added atomically) and one program per head looping over them (`backward_loop`), timed forward+backward on a GPU,
their gradients compared with each other and with the XLA chunked implementation.

  python benchmarks/wkv7_chunked_backward.py                       # GPU: (8, 4096, 4096, 128) bf16, both layouts
  python benchmarks/wkv7_chunked_backward.py --shape 1,32,64,16    # CPU: the kernels interpreted, numerics only

Each row: its settings, fwd+bwd median ms (GPU only), and per gradient max|g - g_ref| / max|g_ref| against impl
"chunked" (`ltm_jax.ops.wkv7`, float32 XLA, no Pallas) on the same bf16 inputs. Batch rows are independent, so the
reference runs on the first --reference-rows rows only (default 1): at (8, 4096, 4096, 128) the XLA form over all 8
needs about 50 GiB, which an 80 GiB H100 did not hold beside the kernels' buffers. Writes
benchmarks/results/wkv7-chunked-backward-<device>.json.
"""

from __future__ import annotations

import argparse

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp

from ltm_jax.ops.wkv7 import wkv7
from ltm_pallas import wkv7_chunked
from wkv7 import _inputs

NAMES = ("r", "w", "k", "v", "a", "b", "state")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="8,4096,4096,128", help="B,T,C,N")
  parser.add_argument("--runs", type=int, default=20)
  parser.add_argument("--reference-rows", type=int, default=1, help="batch rows the float32 XLA reference runs on")
  args = parser.parse_args()
  shape = tuple(int(x) for x in args.shape.split(","))
  batch, _, channels, size = shape
  on_gpu = jax.default_backend() == "gpu"
  r, w, k, v, a, b, dy = (x.astype(jnp.bfloat16) for x in _inputs(shape))
  state = jnp.zeros((batch, channels // size, size, size), jnp.float32)
  primals = (r, w, k, v, a, b, state)

  def grads_of(fn, cot):
    def run(*xs):
      y, vjp = jax.vjp(lambda *p: fn(*p)[0], *xs)
      return vjp(cot.astype(y.dtype))
    return jax.jit(run)

  rows_ref = min(args.reference_rows, batch)
  reference = grads_of(lambda *p: wkv7(*(x.astype(jnp.float32) for x in p[:6]), p[6], impl="chunked"),
                       dy[:rows_ref])(*(x[:rows_ref] for x in primals))
  default = wkv7_chunked.settings(size)
  layouts = {"default": {}, "loop": dict(backward_loop=True), "programs": dict(backward_loop=False)}
  rows = []
  for name, override in layouts.items():
    chosen = {**default, **override}
    fn = grads_of(lambda *p, o=override: wkv7_chunked.wkv7(*p, interpret=None if on_gpu else True, **o), dy)
    grads = fn(*primals)
    row = dict(layout=name, shape="x".join(map(str, shape)), dtype="bfloat16", reference_rows=rows_ref, **chosen)
    for label, g, g_ref in zip(NAMES, grads, reference):
      g, g_ref = jnp.asarray(g[:rows_ref], jnp.float32), jnp.asarray(g_ref, jnp.float32)
      row[f"err_{label}"] = float(jnp.max(jnp.abs(g - g_ref)) / jnp.max(jnp.abs(g_ref)))
    if on_gpu:
      row["fwd_bwd"] = common.time_fn(fn, *primals, max_runs=args.runs)
      row["fwd_bwd_ms"] = row["fwd_bwd"]["median_ms"]
    rows.append(row)
    print({key: (round(val, 5) if isinstance(val, float) else val) for key, val in row.items() if key != "fwd_bwd"},
          flush=True)
  if on_gpu:
    print(common.write_results("wkv7-chunked-backward", rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
