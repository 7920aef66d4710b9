"""Times every backend of the RWKV-4 WKV op, forward and forward+backward, and checks it against `scan`.

  python benchmarks/wkv.py                 # CPU: training-like shapes, about a minute on 2 cores
  python benchmarks/wkv.py --quick         # tiny shapes, every backend (pallas interpreted on CPU): proves it runs
  python benchmarks/wkv.py --shapes gpu    # the default on an accelerator: long and wide, bfloat16 and float32

On a GPU the same run times the peers a user would otherwise pick, when importable: the official RWKV-4 CUDA kernel
(the `rwkv` pip package's rwkv/cuda/ source, built with torch.utils.cpp_extension.load; it ships a forward only, in
float16/float32) and flash-linear-attention's RWKV-4 Triton kernel (`fla-core`, fla.ops.rwkv4). The table names the
peers found. GB/s counts each of k, v, y (and dy, dk, dv) once, at the input dtype; pct_copy divides it by the copy
bandwidth measured in the same run (`common.measure_ceilings`).

Writes benchmarks/results/wkv4-<device>.json. The fastest forward+backward backend per platform goes into
`ltm_jax.ops.wkv4.AUTO`.
"""

from __future__ import annotations

import argparse
import os

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp

import peers as peers_lib
from ltm_jax.ops.wkv4 import AVAILABLE, wkv4
from ltm_pallas import wkv4 as pallas_wkv4

# (B, T, C). CPU: the training shapes the auto choice is for. GPU: a long, wide batch and one very long sequence.
SHAPES = {
    "cpu": [(8, 256, 128), (16, 256, 256), (32, 256, 512)],
    "gpu": [(8, 4096, 4096), (1, 65536, 2048)],
    "quick": [(2, 40, 16)],
}
DTYPES = {"cpu": ["float32"], "gpu": ["bfloat16", "float32"], "quick": ["float32", "bfloat16"]}
COLUMNS = ("impl", "shape", "dtype", "fwd_ms", "fwd_bwd_ms", "fwd_gbps", "fwd_pct_copy", "fwd_bwd_gbps",
           "fwd_bwd_pct_copy", "max_abs_err", "compile_s")


def kernel_bytes_per_element(shape, dtype):
  """Bytes the Pallas kernels move per element of [B, T, C]: k, v, y (+ dy, dk, dv) at the dtype, plus the state
  checkpoints (four float32 [B, C] rows every `chunk` tokens) written forward and read backward."""
  itemsize = jnp.dtype(dtype).itemsize
  checkpoint = 16 / pallas_wkv4.CHUNK
  return {"fwd": 3 * itemsize + checkpoint, "bwd": 5 * itemsize + checkpoint}


def _inputs(shape, dtype):
  b, t, c = shape
  keys = jax.random.split(jax.random.key(0), 5)
  w = -jnp.exp(jax.random.uniform(keys[0], (c,), minval=-3.0, maxval=1.0))
  u = 0.5 * jax.random.normal(keys[1], (c,))
  k, v, dy = (jax.random.normal(key, (b, t, c)).astype(dtype) for key in keys[2:])
  return w, u, k, v, dy


def _rates(row, tensor_bytes, copy_gbps):
  """Effective GB/s (k, v, y once forward; dy, dk, dv on top backward) and the share of the copy bandwidth."""
  for key, n in (("fwd", 3), ("fwd_bwd", 6)):
    ms = row.get(f"{key}_ms")
    if ms is not None:
      row[f"{key}_gbps"] = n * tensor_bytes / ms / 1e6
      row[f"{key}_pct_copy"] = 100 * row[f"{key}_gbps"] / copy_gbps
  return row


def bench(impl, shape, dtype, reference, copy_gbps):
  w, u, k, v, dy = _inputs(shape, dtype)
  timed, y = common.time_forward_backward(lambda w, u, k, v: wkv4(w, u, k, v, impl=impl)[0], (w, u, k, v), dy)
  # Bytes that must cross memory at least once: k, v read and y written; the backward adds dy read, dk, dv written.
  tensor_bytes = shape[0] * shape[1] * shape[2] * jnp.dtype(dtype).itemsize
  err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - reference)))
  return _rates({"impl": impl, "shape": "x".join(map(str, shape)), "dtype": dtype, **timed, "max_abs_err": err},
                tensor_bytes, copy_gbps)


# ----------------------------------------------------------------------------------------------------------------
# Peers, through PyTorch on the same GPU. Each returns None when its package (or torch, or CUDA) is missing.


def _torch_inputs(shape, dtype):
  """The benchmark's inputs as CUDA torch tensors (same values as the JAX ones)."""
  import numpy as np
  import torch

  w, u, k, v, dy = (np.asarray(x.astype(jnp.float32)) for x in _inputs(shape, dtype))
  tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
  cuda = lambda x, dt=torch.float32: torch.from_numpy(x).to("cuda", dt).contiguous()
  return cuda(w), cuda(u), cuda(k, tdtype), cuda(v, tdtype), cuda(dy, tdtype)


def _peer_rwkv_cuda():
  """The official RWKV-4 CUDA kernel from the `rwkv` pip package (rwkv/cuda/), forward only: y and the state."""
  try:
    import rwkv
    import torch
    from torch.utils.cpp_extension import load
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  src = os.path.join(os.path.dirname(rwkv.__file__), "cuda")
  sources = [os.path.join(src, f) for f in ("wrapper.cpp", "operators.cu", "gemm_fp16_cublas.cpp")]
  load(name="wkv_cuda", sources=[s for s in sources if os.path.exists(s)], verbose=False, is_python_module=False,
       extra_cuda_cflags=["-O3", "--use_fast_math"], extra_ldflags=["-lcublas"])

  def run(shape, dtype):
    if dtype not in ("float32", "float16"):  # The shipped kernel has float16 and float32 paths only.
      return None
    b, t, c = shape
    w, u, k, v, _ = _torch_inputs(shape, dtype)
    y = torch.empty_like(v)
    aa, bb = torch.zeros(b, c, device="cuda"), torch.zeros(b, c, device="cuda")
    pp = torch.full((b, c), -1e38, device="cuda")
    forward = lambda: torch.ops.rwkv.wkv_forward(b, t, c, w, u, k, v, y, aa.clone(), bb.clone(), pp.clone())
    return {"fwd": common.time_torch(forward), "y": lambda: (forward(), y)[1]}

  return run


def _peer_fla():
  """flash-linear-attention's RWKV-4 Triton kernel (fla-core), forward and forward+backward."""
  try:
    import torch
    from fla.ops.rwkv4 import fused_recurrent_rwkv4
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None

  def run(shape, dtype):
    b, _, c = shape
    w, u, k, v, dy = _torch_inputs(shape, dtype)
    # fla takes the raw time_decay and applies w = -exp(time_decay) itself; its state is [B, 3, 1, C]: a, b, max.
    time_decay = torch.log(-w).requires_grad_()
    u, k, v = (x.requires_grad_() for x in (u, k, v))
    state = torch.zeros(b, 3, 1, c, device="cuda")
    state[:, 2] = -1e38
    forward = lambda: fused_recurrent_rwkv4(time_decay, u, k, v, state)[0]
    forward_backward = lambda: torch.autograd.grad(forward(), (time_decay, u, k, v), dy)
    with torch.no_grad():
      fwd = common.time_torch(forward)
    return {"fwd": fwd, "fwd_bwd": common.time_torch(forward_backward), "y": forward}

  return run


PEERS = {"rwkv_cuda": _peer_rwkv_cuda, "fla_rwkv4": _peer_fla}


def bench_peer(name, run, shape, dtype, reference, copy_gbps):
  try:
    result = run(shape, dtype)
  except Exception as e:  # noqa: BLE001  (a peer that fails to build or run is reported, not fatal)
    return {"impl": name, "shape": "x".join(map(str, shape)), "dtype": dtype, "error": repr(e)[:200]}
  if result is None:
    return None
  import numpy as np

  y = result["y"]().detach().float().cpu().numpy()
  row = {
      "impl": name,
      "shape": "x".join(map(str, shape)),
      "dtype": dtype,
      "fwd_ms": result["fwd"]["median_ms"],
      "fwd_bwd_ms": result.get("fwd_bwd", {}).get("median_ms"),
      "max_abs_err": float(np.max(np.abs(y - np.asarray(reference)))),
      **{k: v for k, v in result.items() if k in ("fwd", "fwd_bwd")},
  }
  tensor_bytes = shape[0] * shape[1] * shape[2] * jnp.dtype(dtype).itemsize
  return _rates(row, tensor_bytes, copy_gbps)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  parser.add_argument("--shapes", choices=sorted(SHAPES), default=platform)
  parser.add_argument("--quick", action="store_true", help="same as --shapes quick: tiny shapes, under a minute")
  parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32 on cpu, bfloat16 float32 on gpu")
  parser.add_argument("--impls", nargs="+", default=None, choices=AVAILABLE,
                      help="default: all; on the cpu shapes all but pallas, which a CPU only interprets")
  parser.add_argument("--shape", action="append", default=None, metavar="B,T,C",
                      help="time this shape instead of the --shapes set (repeatable)")
  parser.add_argument("--name", default=None,
                      help="results file benchmarks/results/<name>-<device>.json (default wkv4, wkv4-quick)")
  args = parser.parse_args()
  if args.quick:
    args.shapes = "quick"
  dtypes = args.dtypes or DTYPES[args.shapes]
  if args.impls is None:
    args.impls = [i for i in AVAILABLE if not (args.shapes == "cpu" and i == "pallas")]

  copy_gbps = common.measure_ceilings()["copy_gbps"]
  print(f"measured copy bandwidth: {copy_gbps:.4g} GB/s")
  peers = {}
  if platform == "gpu":
    for name, make in PEERS.items():
      try:
        run = make()
      except Exception as e:  # noqa: BLE001  (e.g. the CUDA build failing on this machine)
        print(f"peer {name}: failed to load: {e!r}"[:300])
        run = None
      if run is not None:
        peers[name] = run
  print(f"peers found: {', '.join(peers) or 'none'} (looked for {', '.join(PEERS)})")

  rows = []
  shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES[args.shapes]
  for shape in shapes:
    # The error baseline: the sequential reference in float32, whatever dtype is being timed.
    w, u, k, v, _ = _inputs(shape, jnp.float32)
    reference = jax.jit(lambda *xs: wkv4(*xs, impl="scan")[0])(w, u, k, v)
    for dtype in dtypes:
      for impl in args.impls:
        rows.append(bench(impl, shape, dtype, reference, copy_gbps))
        common.print_table(rows[-1:], COLUMNS)
      for name, run in peers.items():
        row = bench_peer(name, run, shape, dtype, reference, copy_gbps)
        if row is not None:
          rows.append(row)
          common.print_table(rows[-1:], COLUMNS)
      bytes_per = kernel_bytes_per_element(shape, dtype)
      print(f"pallas bytes/element {shape} {dtype}: forward {bytes_per['fwd']:.3g}, backward {bytes_per['bwd']:.3g}")
  print()
  common.print_table(rows, COLUMNS)
  # The quick run proves the script end to end; it must not overwrite a measured table.
  path = common.write_results(
      args.name or ("wkv4-quick" if args.shapes == "quick" else "wkv4"), rows, shapes=args.shape or args.shapes, copy_gbps=copy_gbps,
      peers_found=sorted(peers), peer_versions=peers_lib.versions(("rwkv", "fla-core", "torch")),
      pallas_chunk=pallas_wkv4.CHUNK, pallas_block_c=pallas_wkv4.BLOCK_C,
      pallas_bytes_per_element={d: kernel_bytes_per_element((1, 1, 1), d) for d in dtypes},
      note="shape is BxTxC; ms are medians; gbps counts k, v, y (+ dy, dk, dv) once; pct_copy is gbps over the "
           "measured copy bandwidth")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
