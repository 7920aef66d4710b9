"""Times every backend of the RWKV-7 WKV op and its peers, forward and forward+backward, against measured ceilings.

  python benchmarks/wkv7.py                 # CPU: training-like shapes, about a minute on 2 cores
  python benchmarks/wkv7.py --shapes gpu    # the default on an accelerator: the issue's three shapes, bfloat16
  python benchmarks/wkv7.py --quick         # tiny shapes, every backend (pallas interpreted on CPU): proves it runs

Peers, run in the same process when importable (and reported as missing otherwise): flash-linear-attention's
`chunk_rwkv7` (PyTorch/Triton, `pip install fla-core`, timed with CUDA events), the JAX Triton kernel of
`rwkv-ops` (`pip install rwkv-ops`, KERNEL_BACKEND=jax) and jax-linear-attention's Mosaic GPU kernel
(`pip install jax-linear-attention`, jla.ops.mosaic_gpu.rwkv7, Hopper only, in the bounded mode the RWKV-7 layers
use: lower_bound -0.61). Writes benchmarks/results/wkv7-<device>.json (wkv7-quick-<device>.json with --quick). The
fastest forward+backward backend per platform goes into `ltm_jax.ops.wkv7.AUTO`.

Counting. Bytes: the six inputs read and y written once (forward); plus dy read and six gradients written (backward).
FLOPs: the sequential form's 9·N² per token and head (S a, the rank-1 updates and decay, S r), 3x that forward and
backward; the chunked forms do more. The floor is max(bytes / copy rate, FLOPs / bf16 matmul rate), both measured.
Errors: max |y - y_ref| / max |y_ref|, y_ref the scan backend in float32 on the same (pre-rounding) inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import peers as peers_lib

from ltm_jax.ops.wkv7 import AVAILABLE, wkv7

# (B, T, C, N): C = H·N channels. CPU: training-like shapes for the auto choice (small heads, as the tiny configs).
SHAPES = {
    "cpu": [(8, 256, 128, 32), (4, 512, 256, 64)],
    "gpu": [(8, 4096, 4096, 64), (8, 4096, 4096, 128), (1, 32768, 4096, 64)],
    "quick": [(2, 40, 32, 16)],
}
DTYPES = {"cpu": ["float32"], "gpu": ["bfloat16"], "quick": ["float32"]}
COLUMNS = ("impl", "shape", "dtype", "fwd_ms", "fwd_bwd_ms", "fwd_floor_x", "fwd_bwd_floor_x", "fwd_gbps",
           "fwd_bwd_gbps", "fwd_tflops", "rel_err", "compile_s")
FLOPS_PER_TOKEN_HEAD = 9  # times N², forward; see the module docstring.


def _inputs(shape, seed=0):
  """float32 (r, w, k, v, a, b, dy) [B, T, H, N] as in RWKV-7: w in its trained range, a = -kk, b = kk·a_lr."""
  batch, length, channels, size = shape
  dims = (batch, length, channels // size, size)
  keys = jax.random.split(jax.random.key(seed), 7)
  normal = lambda key: jax.random.normal(key, dims, jnp.float32)
  r, k, v, dy = (normal(key) for key in keys[:4])
  # RWKV-7's log-decay: -exp(-0.5 - softplus(x)), in [-0.61, 0).
  w = -jnp.exp(-0.5 - jax.nn.softplus(normal(keys[4])))
  kk = normal(keys[5])
  kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
  a_lr = jax.nn.sigmoid(normal(keys[6]))
  return r, w, k, v, -kk, kk * a_lr, dy


def _counts(shape, dtype):
  batch, length, channels, size = shape
  elements = batch * length * channels
  item = jnp.dtype(dtype).itemsize
  flops = FLOPS_PER_TOKEN_HEAD * size * elements  # 9 N² per token-head = 9 N per element.
  # Forward: six inputs read, y written. Backward adds six inputs and dy read, six gradients written.
  return {"fwd_bytes": 7 * elements * item, "fwd_bwd_bytes": 20 * elements * item,
          "fwd_flops": flops, "fwd_bwd_flops": 3 * flops}


def _rates(row, counts, ceilings):
  """Achieved bytes/s and FLOP/s, and time as a multiple of the floor, for the row's timings."""
  for mode in ("fwd", "fwd_bwd"):
    ms = row.get(f"{mode}_ms")
    if ms is None:
      continue
    floor_ms = max(counts[f"{mode}_bytes"] / (ceilings["copy_gbps"] * 1e6),
                   counts[f"{mode}_flops"] / (ceilings["matmul_tflops"] * 1e9))
    row[f"{mode}_gbps"] = counts[f"{mode}_bytes"] / ms / 1e6
    row[f"{mode}_tflops"] = counts[f"{mode}_flops"] / ms / 1e9
    row[f"{mode}_floor_x"] = ms / floor_ms
  return row


def _rel_err(y, reference):
  return float(jnp.max(jnp.abs(jnp.asarray(y, jnp.float32) - reference)) / jnp.max(jnp.abs(reference)))


def bench_ours(impl, inputs, dtype, reference):
  r, w, k, v, a, b, dy = (x.astype(dtype) for x in inputs)
  forward = lambda r, w, k, v, a, b: wkv7(r, w, k, v, a, b, impl=impl)[0]

  def forward_backward(r, w, k, v, a, b, dy):
    y, vjp = jax.vjp(forward, r, w, k, v, a, b)
    return y, vjp(dy)

  fwd, fwd_compile = common.compile_fn(forward, r, w, k, v, a, b)
  fwd_bwd, bwd_compile = common.compile_fn(forward_backward, r, w, k, v, a, b, dy)
  fwd_t = common.time_fn(fwd, r, w, k, v, a, b)
  fwd_bwd_t = common.time_fn(fwd_bwd, r, w, k, v, a, b, dy)
  return {"fwd_ms": fwd_t["median_ms"], "fwd_bwd_ms": fwd_bwd_t["median_ms"],
          "rel_err": _rel_err(fwd(r, w, k, v, a, b), reference),
          "compile_s": fwd_compile + bwd_compile, "fwd": fwd_t, "fwd_bwd": fwd_bwd_t}


def bench_fla(inputs, dtype, reference):
  """flash-linear-attention's chunk_rwkv7 on the same inputs (its state is [K, V], the transpose of ours)."""
  import torch
  from fla.ops.rwkv7 import chunk_rwkv7

  torch_dtype = getattr(torch, dtype)
  r, w, k, v, a, b, dy = (torch.from_numpy(np.asarray(x)).to("cuda", torch_dtype) for x in inputs)
  forward = lambda *xs: chunk_rwkv7(*xs, scale=1.0, initial_state=None, output_final_state=True)[0]
  with torch.no_grad():
    y = forward(r, w, k, v, a, b)
    fwd_t = common.time_torch(lambda: forward(r, w, k, v, a, b))
  leaves = [x.detach().clone().requires_grad_(True) for x in (r, w, k, v, a, b)]

  def forward_backward():
    for x in leaves:
      x.grad = None
    forward(*leaves).backward(dy)

  fwd_bwd_t = common.time_torch(forward_backward)
  return {"fwd_ms": fwd_t["median_ms"], "fwd_bwd_ms": fwd_bwd_t["median_ms"],
          "rel_err": _rel_err(y.float().cpu().numpy(), reference), "fwd": fwd_t, "fwd_bwd": fwd_bwd_t,
          "torch": torch.__version__}


def _time_jax_peer(forward, args, dy, reference):
  """Forward and forward+backward (VJP with `dy`) timings of a JAX peer's `forward(r, w, k, v, a, b)`, with its
  relative error against `reference`."""

  def forward_backward(*args_and_dy):
    y, vjp = jax.vjp(forward, *args_and_dy[:-1])
    return y, vjp(args_and_dy[-1])

  fwd, fwd_compile = common.compile_fn(forward, *args)
  fwd_t = common.time_fn(fwd, *args)
  row = {"fwd_ms": fwd_t["median_ms"], "rel_err": _rel_err(fwd(*args), reference), "fwd": fwd_t,
         "compile_s": fwd_compile}
  fwd_bwd, bwd_compile = common.compile_fn(forward_backward, *args, dy)
  fwd_bwd_t = common.time_fn(fwd_bwd, *args, dy)
  row.update(fwd_bwd_ms=fwd_bwd_t["median_ms"], fwd_bwd=fwd_bwd_t, compile_s=fwd_compile + bwd_compile)
  return row


def bench_rwkv_ops(inputs, dtype, reference):
  """rwkv-ops' JAX Triton kernel (`generalized_delta_rule`, log-space decay) on the same inputs."""
  os.environ.setdefault("KERNEL_BACKEND", "jax")
  os.environ.setdefault("KERNEL_TYPE", "triton")
  from rwkv_ops import generalized_delta_rule

  r, w, k, v, a, b, dy = (x.astype(dtype) for x in inputs)
  forward = lambda r, w, k, v, a, b: generalized_delta_rule(r, w, k, v, a, b, output_final_state=True)[0]
  return _time_jax_peer(forward, (r, w, k, v, a, b), dy, reference)


def bench_jla(inputs, dtype, reference):
  """jax-linear-attention's Mosaic GPU RWKV-7 (arguments r, k, v, w, a, b; FLA's [K, V] state) on the same inputs, in
  the bounded mode: our w lies in [-0.61, 0), the bound its RWKV-7 layers promise."""
  from jla.ops.mosaic_gpu.rwkv7 import rwkv7 as jla_rwkv7

  r, w, k, v, a, b, dy = (x.astype(dtype) for x in inputs)
  forward = lambda r, w, k, v, a, b: jla_rwkv7(r, k, v, w, a, b, scale=1.0, lower_bound=-0.61)[0]
  return _time_jax_peer(forward, (r, w, k, v, a, b), dy, reference)


PEERS = {"fla.chunk_rwkv7": ("fla", bench_fla), "rwkv_ops": ("rwkv_ops", bench_rwkv_ops),
         "jla.mosaic_gpu": ("jla", bench_jla)}
# The packages behind PEERS, by their names in peers.PEERS (their versions go into the results file).
PEER_PACKAGES = ("fla-core", "rwkv-ops", "jax-linear-attention", "torch")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  parser.add_argument("--shapes", choices=sorted(SHAPES), default=platform)
  parser.add_argument("--quick", action="store_true", help="same as --shapes quick: tiny shapes, seconds")
  parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32 on cpu, bfloat16 on gpu")
  parser.add_argument("--impls", nargs="+", default=list(AVAILABLE), choices=AVAILABLE)
  parser.add_argument("--no-peers", action="store_true")
  args = parser.parse_args()
  if args.quick:
    args.shapes = "quick"
  dtypes = args.dtypes or DTYPES[args.shapes]

  ceilings = common.measure_ceilings()
  print(f"ceilings: {ceilings}")
  peers = {} if args.no_peers or platform == "cpu" else {
      name: fn for name, (module, fn) in PEERS.items() if importlib.util.find_spec(module) is not None}
  missing = sorted(set(PEERS) - set(peers))
  print(f"peers found: {sorted(peers) or 'none'}; not run: {missing or 'none'}"
        + (" (peers need a GPU)" if platform == "cpu" else ""))

  rows = []
  for shape in SHAPES[args.shapes]:
    inputs = _inputs(shape)
    # The error baseline: the sequential reference in float32 on the unrounded inputs.
    reference = jax.jit(lambda *xs: wkv7(*xs, impl="scan")[0])(*inputs[:6])
    for dtype in dtypes:
      counts = _counts(shape, dtype)
      runs = [(impl, lambda impl=impl: bench_ours(impl, inputs, dtype, reference)) for impl in args.impls]
      runs += [(name, lambda fn=fn: fn(inputs, dtype, reference)) for name, fn in peers.items()]
      for name, run in runs:
        row = {"impl": name, "shape": "x".join(map(str, shape)), "dtype": dtype}
        try:
          row.update(run())
        except Exception as error:  # One failing backend or peer (out of memory, missing GPU support) skips only itself.
          row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
          print(f"{name} {row['shape']} failed: {row['error']}")
        rows.append(_rates(row, counts, ceilings))
        common.print_table(rows[-1:], COLUMNS)
  print()
  common.print_table(rows, COLUMNS)
  # The quick run proves the script end to end; it must not overwrite a measured table.
  path = common.write_results(
      "wkv7-quick" if args.shapes == "quick" else "wkv7", rows, shapes=args.shapes, ceilings=ceilings,
      peers_run=sorted(peers), peers_missing=missing, peer_versions=peers_lib.versions(PEER_PACKAGES),
      note=("shape is BxTxCxN; ms are medians; floor_x = time / max(bytes / copy rate, FLOPs / bf16 matmul rate); "
            "bytes count the six inputs and y (+ dy and six gradients) once; FLOPs are 9 N^2 per token-head forward, "
            "3x for forward+backward; rel_err = max|y - y_scan_f32| / max|y_scan_f32|. On CPU the pallas backend runs "
            "in the Pallas interpreter: its times say nothing about the GPU kernel."))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
