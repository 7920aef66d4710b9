"""Times every backend of the RWKV-7 WKV op and its peers, forward and forward+backward, against measured ceilings.

  python benchmarks/wkv7.py                 # CPU: training-like shapes, about a minute on 2 cores
  python benchmarks/wkv7.py --shapes gpu    # the default on an accelerator: three long-sequence shapes, bfloat16
  python benchmarks/wkv7.py --quick         # tiny shapes, every backend (pallas interpreted on CPU): proves it runs
  python benchmarks/wkv7.py --impls pallas_chunked pallas_segmented --no-peers   # on a GPU: the segmented form
                                            # against the chunked kernels (they differ at (1, 32768, 4096, 64) only)

  python benchmarks/wkv7.py --quick --aot  # no GPU: the quick run, then the H100 compile report of the kernels
                                            # (benchmarks/gpu_aot.py in .venv-aot, the wkv7 cases)

Peers, run in the same process when importable (and reported as missing otherwise): flash-linear-attention's
`chunk_rwkv7` (PyTorch/Triton, `pip install fla-core`, timed with CUDA events), wind_rwkv's chunked bfloat16 CUDA
kernel (`attn_chunked_cuda`, built on first use by torch.utils.cpp_extension; installed from its git repository,
not on PyPI), the JAX Triton kernel of `rwkv-ops` (`pip install rwkv-ops`, KERNEL_BACKEND=jax) and
jax-linear-attention's Mosaic GPU kernel (`pip install jax-linear-attention`, jla.ops.mosaic_gpu.rwkv7, Hopper only,
in the bounded mode the RWKV-7 layers use: lower_bound -0.61). Writes benchmarks/results/wkv7-<device>.json
(wkv7-quick-<device>.json with --quick). The fastest forward+backward backend per platform goes into
`ltm_jax.ops.wkv7.AUTO`.

Counting, per element (one channel of one token), for each row:
- floor_x: time over the common floor max(minimal bytes / copy rate, sequential FLOPs / bf16 matmul rate), both
  rates measured. Minimal bytes: the six inputs read and y written once (forward); plus dy read and six gradients
  written (backward). Sequential FLOPs: 9·N per element forward (S a, the rank-1 updates and decay, S r), 3x that
  forward and backward.
- B/el, FLOP/el and roofline_x: the row's own algorithm where this project knows it (its kernels: the chunk states
  and gradient sums they store and read, the chunked kernels' matrix products; `_model`, `_chunked_flops`), else
  the minimal bytes and sequential FLOPs; roofline_x = time / max(B/el / copy rate, FLOP/el / matmul rate) x elements.
Errors: max |y - y_ref| / max |y_ref|, y_ref the scan backend in float32 on the same (pre-rounding) inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import tempfile

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import peers as peers_lib

from ltm_jax.ops.wkv7 import AVAILABLE, pallas_segmented, wkv7
from ltm_pallas import wkv7 as sequential_kernels
from ltm_pallas import wkv7_chunked

# (B, T, C, N): C = H·N channels. CPU: training-like shapes for the auto choice (small heads, as the tiny configs).
SHAPES = {
    "cpu": [(8, 256, 128, 32), (4, 512, 256, 64)],
    "gpu": [(8, 4096, 4096, 64), (8, 4096, 4096, 128), (1, 32768, 4096, 64)],
    "quick": [(2, 40, 32, 16)],
}
DTYPES = {"cpu": ["float32"], "gpu": ["bfloat16"], "quick": ["float32"]}
COLUMNS = ("impl", "shape", "dtype", "fwd_ms", "fwd_bwd_ms", "fwd_floor_x", "fwd_bwd_floor_x", "fwd_B/el",
           "fwd_bwd_B/el", "fwd_FLOP/el", "fwd_bwd_FLOP/el", "fwd_roofline_x", "fwd_bwd_roofline_x", "rel_err",
           "compile_s")
FLOPS_PER_TOKEN_HEAD = 9  # times N², forward; see the module docstring.
ROOT = pathlib.Path(__file__).resolve().parents[1]


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


def _chunked_flops(size, chunk):
  """Matrix-product FLOPs per token and head of the chunked kernels (head size N, chunk L), forward and backward.

  Forward, per chunk: four [L, N] x [N, L] pair products, the [L, L] inverse (2·(log2 L - 1) products of L³), four
  [L, N] x [N, N]-sized products (Â S^T, R̂ S^T, U^T B̄, V^T K̄) and four [L, L] x [L, N] (M_ak V, T X, P_rb U,
  P_rk V). Backward: the same pairs, inverse and U again, then nine [L, N] x [N, N]-sized and eighteen [L, L] x
  [L, N] products (chunk_backward). Elementwise work (exponentials, masks) is not counted.
  """
  inverse = 4 * (max(int(math.log2(chunk)), 1) - 1) * chunk**2
  forward = 8 * size**2 + 16 * chunk * size + inverse
  backward = 18 * size**2 + 44 * chunk * size + inverse
  return forward, backward


def _segmented_flops(size, chunk):
  """Matrix-product FLOPs per token and head of the segmented form's extra passes (head size N, chunk L): forward, the
  end state from zeros (pairs M_ab, M_ak, the inverse, Â S^T, M_ak V, T X, U^T B̄, V^T K̄) and the transition (M_ab,
  the inverse, Â S^T, T X, U^T B̄); backward, the state gradient (M_ab, P_rb, the inverse, P_rb^T dY, B̄ dS^T,
  T^T dU, dY^T R̂, dX^T Â). The [N, N] scans over segments (2·N³ per segment boundary each way) are not counted.
  """
  inverse = 4 * (max(int(math.log2(chunk)), 1) - 1) * chunk**2
  end_state = 6 * size**2 + 8 * chunk * size + inverse
  transition = 4 * size**2 + 4 * chunk * size + inverse
  return end_state + transition, end_state


def _model(impl, shape, dtype):
  """(bytes, FLOPs) per element of the row's own algorithm, forward and forward+backward: {mode: (B/el, FLOP/el)}.

  The forward alone runs each kernel's primal (no chunk states); forward+backward runs the forward that stores them
  and the backward that reads them. The chunked backend also reads w once for its range check."""
  size, item = shape[3], jnp.dtype(dtype).itemsize
  if impl == "pallas_segmented":
    # The chunked kernels' counts; with segments, plus the state passes: the end state reads w, k, v, a, b, the
    # transition w, a, b, the state gradient r, w, a, b, dy (their [N, N] states per segment are not counted).
    counts = _model("pallas_chunked", shape, dtype)
    batch, length, channels, _ = shape
    if pallas_segmented.segments(batch, length, channels // size, size, dtype) == 1:
      return counts
    forward, backward = (f / size for f in _segmented_flops(size, wkv7_chunked.settings(
        size, wkv7_chunked.operand_dtype(dtype))["chunk"]))
    return {"fwd": (counts["fwd"][0] + 8 * item, counts["fwd"][1] + forward),
            "fwd_bwd": (counts["fwd_bwd"][0] + 13 * item, counts["fwd_bwd"][1] + forward + backward)}
  minimal = {"fwd": 7 * item, "fwd_bwd": 20 * item}
  flops = {"fwd": FLOPS_PER_TOKEN_HEAD * size, "fwd_bwd": 3 * FLOPS_PER_TOKEN_HEAD * size}
  operands = wkv7_chunked.operand_dtype(dtype)
  if impl == "pallas_chunked" and wkv7_chunked.fits(size, operands):
    chosen = wkv7_chunked.settings(size, operands)
    states = size / chosen["chunk"] * operands.itemsize  # An [N, N] state per chunk of L tokens, per channel.
    # Looping over its value blocks, one backward program holds a whole head: key-side gradients written once.
    blocks = 1 if chosen.get("backward_loop") else size // min(chosen["backward_block"], size)
    forward, backward = (f / size for f in _chunked_flops(size, chosen["chunk"]))
  elif impl in ("pallas", "pallas_chunked"):  # pallas_chunked out of its settings runs the sequential kernels.
    # Float32 states every 16 tokens; the backward's adjoint step costs about two forward steps, and it replays
    # (16 - 1) / 2 forward steps per token on average from the chunk's stored state.
    states, blocks = size / 16 * 4, size // min(sequential_kernels.BACKWARD_BLOCK, size)
    forward, backward = flops["fwd"], (2 + (16 - 1) / 2) * flops["fwd"]
  else:
    return {mode: (minimal[mode], flops[mode]) for mode in minimal}
  # Key-side gradients: written once in the inputs' dtype; or, with several value blocks per head, added atomically
  # into zeroed float32 buffers (zeroing, one read and one write-back at L2, assuming the blocks of a head meet there,
  # then read again to convert) for the chunked kernels, and as float32 partial sums per value block that XLA reads
  # back and adds for the sequential ones.
  if blocks == 1:
    key_grads = 5 * item
  elif impl == "pallas_chunked" and wkv7_chunked.fits(size, operands):
    key_grads = 5 * (4 * 4 + item)
  else:
    key_grads = 5 * (2 * 4 * blocks + item)
  check = item if impl == "pallas_chunked" else 0
  backward_bytes = 7 * item + states + item + key_grads  # Inputs and dy, chunk states; dv; key-side gradients.
  return {"fwd": (7 * item + check, forward),
          "fwd_bwd": (7 * item + states + check + backward_bytes, forward + backward)}


def _rates(row, counts, ceilings, model, elements):
  """Time as a multiple of the common floor and of the row's own roofline, with the row's counts per element."""
  for mode in ("fwd", "fwd_bwd"):
    bytes_el, flops_el = model[mode]
    row[f"{mode}_B/el"], row[f"{mode}_FLOP/el"] = round(bytes_el, 1), round(flops_el)
    ms = row.get(f"{mode}_ms")
    if ms is None:
      continue
    floor_ms = max(counts[f"{mode}_bytes"] / (ceilings["copy_gbps"] * 1e6),
                   counts[f"{mode}_flops"] / (ceilings["matmul_tflops"] * 1e9))
    roofline_ms = max(bytes_el * elements / (ceilings["copy_gbps"] * 1e6),
                      flops_el * elements / (ceilings["matmul_tflops"] * 1e9))
    row[f"{mode}_gbps"] = counts[f"{mode}_bytes"] / ms / 1e6
    row[f"{mode}_tflops"] = counts[f"{mode}_flops"] / ms / 1e9
    row[f"{mode}_floor_x"] = ms / floor_ms
    row[f"{mode}_roofline_x"] = ms / roofline_ms
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


def _time_torch_peer(forward, inputs, dtype, reference):
  """Forward and forward+backward (backward of y with dy) timings of a PyTorch peer's `forward(r, w, k, v, a, b)`
  on CUDA copies of `inputs` (r, w, k, v, a, b, dy), with its relative error against `reference`."""
  import torch

  torch_dtype = getattr(torch, dtype)
  r, w, k, v, a, b, dy = (torch.from_numpy(np.asarray(x)).to("cuda", torch_dtype) for x in inputs)
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


def bench_fla(inputs, dtype, reference):
  """flash-linear-attention's chunk_rwkv7 on the same inputs (its state is [K, V], the transpose of ours)."""
  from fla.ops.rwkv7 import chunk_rwkv7

  forward = lambda *xs: chunk_rwkv7(*xs, scale=1.0, initial_state=None, output_final_state=True)[0]
  return _time_torch_peer(forward, inputs, dtype, reference)


def bench_wind(inputs, dtype, reference):
  """wind_rwkv's chunked CUDA kernel (chunks of 16, bfloat16 matmuls) on the same inputs. It takes the decay as
  w' with e^{-e^{w'}} the per-step factor, so w' = log(-w); its state has our [value, key] layout."""
  import torch
  from wind_rwkv.rwkv7 import attn_chunked_cuda, load_chunked_cuda

  if dtype != "bfloat16":
    raise ValueError(f"wind_rwkv's chunked kernel takes bfloat16 only, not {dtype}")
  r, w, k, v, a, b, dy = inputs
  batch, _, heads, size = r.shape
  load_chunked_cuda(size)
  start = torch.zeros(batch, heads, size, size, device="cuda", dtype=torch.bfloat16)
  forward = lambda *xs: attn_chunked_cuda(*xs, start)[0]
  return _time_torch_peer(forward, (r, jnp.log(-w), k, v, a, b, dy), dtype, reference)


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


PEERS = {"fla.chunk_rwkv7": ("fla", bench_fla), "wind.chunked_cuda": ("wind_rwkv", bench_wind),
         "rwkv_ops": ("rwkv_ops", bench_rwkv_ops), "jla.mosaic_gpu": ("jla", bench_jla)}
# The packages behind PEERS, by their names in peers.PEERS (their versions go into the results file).
PEER_PACKAGES = ("fla-core", "rwkv-ops", "jax-linear-attention", "torch")


def compile_report():
  """The H100 compile report of this op's kernels (benchmarks/gpu_aot.py in .venv-aot, its wkv7 cases): rows of
  registers, spills and shared memory per kernel, or None with the reason printed when .venv-aot is missing."""
  python = ROOT / ".venv-aot" / "bin" / "python"
  if not python.exists():
    print(f"compile report: {python} is missing (make gpu-aot builds it)")
    return None
  with tempfile.TemporaryDirectory() as folder:
    path = pathlib.Path(folder) / "aot.json"
    done = subprocess.run([str(python), str(ROOT / "benchmarks" / "gpu_aot.py"), "--group", "kernels", "--cases",
                           "^wkv7", "--json", str(path)], cwd=ROOT, check=False)
    report = json.loads(path.read_text()) if path.exists() else {}
  if done.returncode:
    print(f"compile report: gpu_aot.py exited {done.returncode}")
  return report.get("kernels")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  parser.add_argument("--shapes", choices=sorted(SHAPES), default=platform)
  parser.add_argument("--quick", action="store_true", help="same as --shapes quick: tiny shapes, seconds")
  parser.add_argument("--dtypes", nargs="+", default=None, help="default: float32 on cpu, bfloat16 on gpu")
  parser.add_argument("--impls", nargs="+", default=list(AVAILABLE), choices=AVAILABLE)
  parser.add_argument("--no-peers", action="store_true")
  parser.add_argument("--aot", action="store_true",
                      help="also compile the kernels for an H100 (benchmarks/gpu_aot.py in .venv-aot) and keep the "
                      "report's rows (registers, spills, shared memory) in the results")
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
        elements = shape[0] * shape[1] * shape[2]
        rows.append(_rates(row, counts, ceilings, _model(name, shape, dtype), elements))
        common.print_table(rows[-1:], COLUMNS)
  print()
  common.print_table(rows, COLUMNS)
  report = compile_report() if args.aot else None
  # The quick run proves the script end to end; it must not overwrite a measured table.
  path = common.write_results(
      "wkv7-quick" if args.shapes == "quick" else "wkv7", rows, shapes=args.shapes, ceilings=ceilings,
      peers_run=sorted(peers), peers_missing=missing, peer_versions=peers_lib.versions(PEER_PACKAGES),
      compile_report=report,
      note=("shape is BxTxCxN; ms are medians; floor_x = time / max(bytes / copy rate, FLOPs / bf16 matmul rate); "
            "bytes count the six inputs and y (+ dy and six gradients) once; FLOPs are 9 N^2 per token-head forward, "
            "3x for forward+backward; B/el and FLOP/el are per element (channel of a token) of the row's own "
            "algorithm where known (this project's kernels: chunk states, partial gradients, the chunked kernels' "
            "matrix products), else the same minimal counts; roofline_x = time / max(B/el / copy rate, FLOP/el / "
            "matmul rate) x elements; rel_err = max|y - y_scan_f32| / max|y_scan_f32|. On CPU the pallas backends "
            "run in the Pallas interpreter: their times say nothing about the GPU kernels."))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
