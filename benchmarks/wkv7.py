"""The RWKV-7 WKV op: every backend and its peers timed against measured ceilings; the chunked kernels' backward
layouts; their cost model.

  python benchmarks/wkv7.py                 # CPU: training-like shapes, about a minute on 2 cores
  python benchmarks/wkv7.py --shapes gpu    # the default on an accelerator: three long-sequence shapes, bfloat16
  python benchmarks/wkv7.py --quick         # tiny shapes, every backend (pallas interpreted on CPU): proves it runs
  python benchmarks/wkv7.py --impls pallas_chunked pallas_segmented --no-peers   # on a GPU: the segmented form
                                            # against the chunked kernels (they differ at (1, 32768, 4096, 64) only)
  python benchmarks/wkv7.py --mode backward                      # GPU: the chunked backward's two layouts
  python benchmarks/wkv7.py --mode backward --shape 1,32,64,16   # CPU: the same kernels interpreted, numerics only
  python benchmarks/wkv7.py --mode backward --shape 32,1024,512,64 --layouts default backward_block=32,backward_warps=4
                                                                # other launch settings (key=value,...)
  python benchmarks/wkv7.py --mode cost [--markdown]             # the chunked kernels' cost model (docs/kernels.md)
  python benchmarks/wkv7.py --mode mgpu --shape 8,4096,4096,64   # Hopper: the Mosaic GPU kernels' two forms

Four modes. `backends` (the default) times every backend and its peers, below. `backward` times the chunked
backward's two layouts, `cost` models the chunked kernels' cost per kernel, `mgpu` times the Mosaic GPU kernels with
and without overlapped loads: see `backward_layouts`, `cost_model` and `mgpu_forms`.

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


def _time_jax(forward, inputs, dtype, reference):
  """Forward and forward+backward (VJP with dy) timings of a JAX `forward(r, w, k, v, a, b)` on `inputs` (r, w, k,
  v, a, b, dy) in `dtype`, with its relative error against `reference`."""
  *args, dy = (x.astype(dtype) for x in inputs)
  row, y = common.time_forward_backward(forward, args, dy)
  return {**row, "rel_err": _rel_err(y, reference)}


def bench_ours(impl, inputs, dtype, reference):
  return _time_jax(lambda r, w, k, v, a, b: wkv7(r, w, k, v, a, b, impl=impl)[0], inputs, dtype, reference)


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


def bench_rwkv_ops(inputs, dtype, reference):
  """rwkv-ops' JAX Triton kernel (`generalized_delta_rule`, log-space decay) on the same inputs."""
  os.environ.setdefault("KERNEL_BACKEND", "jax")
  os.environ.setdefault("KERNEL_TYPE", "triton")
  from rwkv_ops import generalized_delta_rule

  forward = lambda r, w, k, v, a, b: generalized_delta_rule(r, w, k, v, a, b, output_final_state=True)[0]
  return _time_jax(forward, inputs, dtype, reference)


def bench_jla(inputs, dtype, reference):
  """jax-linear-attention's Mosaic GPU RWKV-7 (arguments r, k, v, w, a, b; FLA's [K, V] state) on the same inputs, in
  the bounded mode: our w lies in [-0.61, 0), the bound its RWKV-7 layers promise."""
  from jla.ops.mosaic_gpu.rwkv7 import rwkv7 as jla_rwkv7

  forward = lambda r, w, k, v, a, b: jla_rwkv7(r, k, v, w, a, b, scale=1.0, lower_bound=-0.61)[0]
  return _time_jax(forward, inputs, dtype, reference)


PEERS = {"fla.chunk_rwkv7": ("fla", bench_fla), "wind.chunked_cuda": ("wind_rwkv", bench_wind),
         "rwkv_ops": ("rwkv_ops", bench_rwkv_ops), "jla.mosaic_gpu": ("jla", bench_jla)}
# The packages behind PEERS, by their names in peers.PEERS (their versions go into the results file).
PEER_PACKAGES = ("fla-core", "rwkv-ops", "jax-linear-attention", "torch")


GRADIENTS = ("r", "w", "k", "v", "a", "b", "state")


# The backward's launch settings `--mode backward` tries by default: the head size's own, and its two layouts.
LAYOUTS = ("default", "backward_loop=1", "backward_loop=0")
_SETTING_TYPES = dict(chunk=int, forward_block=int, backward_block=int, backward_loop=lambda v: bool(int(v)),
                      forward_warps=int, backward_warps=int)


def parse_layout(text: str) -> dict:
  """Launch settings from "default" (none: the head size's own) or "key=value,..." over `_SETTING_TYPES` (the
  settings of `wkv7_chunked.wkv7`; backward_loop 0 or 1). Raises SystemExit naming a bad entry."""
  if text == "default":
    return {}
  settings = {}
  for item in text.split(","):
    key, _, value = item.partition("=")
    if key not in _SETTING_TYPES or not value:
      raise SystemExit(f"wkv7.py: --layouts entry {text!r}: want default or key=value,... with keys "
                       f"{', '.join(_SETTING_TYPES)}")
    try:
      settings[key] = _SETTING_TYPES[key](value)
    except ValueError:
      raise SystemExit(f"wkv7.py: --layouts entry {text!r}: {key} must be an integer, got {value!r}") from None
  return settings


def backward_layouts(args, platform: str) -> None:
  """The chunked WKV-7 backward under several launch settings side by side (`--layouts`; by default the head size's
  own and its two layouts: value blocks as programs of their own, key-side gradients added atomically, and one
  program per head looping over them, `backward_loop`), timed forward+backward on a GPU, their gradients compared
  with the XLA chunked implementation.

  Each row: its settings, fwd+bwd median ms (GPU only), and per gradient max|g - g_ref| / max|g_ref| against impl
  "chunked" (`ltm_jax.ops.wkv7`, float32 XLA, no Pallas) on the same bf16 inputs. Batch rows are independent, so the
  reference runs on the first --reference-rows rows only (default 1): at (8, 4096, 4096, 128) the XLA form over all 8
  needs about 50 GiB, which an 80 GiB H100 did not hold beside the kernels' buffers. Writes
  benchmarks/results/<--name, default wkv7-chunked-backward>-<device>.json (off a GPU the kernels run interpreted:
  errors, no times).
  """
  layouts = {name: parse_layout(name) for name in args.layouts}
  shape = tuple(int(x) for x in args.shape.split(","))
  batch, _, channels, size = shape
  on_gpu = platform == "gpu"
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
  rows = []
  for name, override in layouts.items():
    chosen = {**default, **override}
    fn = grads_of(lambda *p, o=override: wkv7_chunked.wkv7(*p, interpret=None if on_gpu else True, **o), dy)
    grads = fn(*primals)
    row = dict(layout=name, shape="x".join(map(str, shape)), dtype="bfloat16", reference_rows=rows_ref, **chosen)
    for label, g, g_ref in zip(GRADIENTS, grads, reference):
      g, g_ref = jnp.asarray(g[:rows_ref], jnp.float32), jnp.asarray(g_ref, jnp.float32)
      row[f"err_{label}"] = _rel_err(g, g_ref)
    if on_gpu:
      row["fwd_bwd"] = common.time_fn(fn, *primals, max_runs=args.runs)
      row["fwd_bwd_ms"] = row["fwd_bwd"]["median_ms"]
    rows.append(row)
    print({key: (round(val, 5) if isinstance(val, float) else val) for key, val in row.items() if key != "fwd_bwd"},
          flush=True)
  print(common.write_results(args.name or "wkv7-chunked-backward", rows))


def _chunked_outputs(r, w, k, v, a, b, state, dy, ds):
  """y, the final state and the seven gradients (cotangents dy and ds) of XLA's float32 "chunked" form at the
  kernels' (bfloat16) inputs: the reference the Mosaic GPU forms' rows are measured against."""
  primals = [x.astype(jnp.float32) for x in (r, w, k, v, a, b)] + [state]
  (y, final), pullback = jax.vjp(jax.jit(lambda *p: wkv7(*p, impl="chunked")), *primals)
  return (y, final, *pullback((dy.astype(jnp.float32), ds)))


def mgpu_forms(args, platform: str) -> None:
  """The Mosaic GPU kernels' forms (`ltm_pallas.wkv7_mgpu`) timed apart: each chunk's loads serial with its products
  or overlapped with the previous chunk's (`pipelined`, where shared memory holds two slots: N = 64), each with
  Pallas' barrier around every shared-memory store or with the kernels' own barriers only (`explicit_barriers`).

  Per head size in SIZES at --shape's B, T, C (bfloat16): the forward with chunk states and the backward, each a
  jitted call with the XLA work beside the kernel, median ms; and the largest difference of every output from the
  serial form's with Pallas' barriers (the same arithmetic: 0 expected; on a GPU anything else is a race); and each
  form's largest error against XLA's float32 chunked form (`err_vs_chunked`, relative to max |expected| of the output
  named `worst_vs_chunked`, over y, the final state and the seven gradients; the tests' tolerance is 2^-6). On CPU the
  kernels run in Mosaic GPU interpret mode (jax >= 0.11), numerics only; with an older jax the rows say skipped.
  Writes benchmarks/results/<--name, default wkv7-mgpu-forms>-<device>.json.
  """
  from ltm_pallas import backend as kernel_backend  # pylint: disable=g-import-not-at-top
  from ltm_pallas import wkv7_mgpu  # pylint: disable=g-import-not-at-top
  batch, length, channels, _ = (int(x) for x in args.shape.split(","))
  on_gpu = platform == "gpu"
  name = args.name or "wkv7-mgpu-forms"
  if not on_gpu and kernel_backend.jax_version() < (0, 11):
    reason = f"Mosaic GPU interpret mode needs jax >= 0.11 (this is {jax.__version__})"
    print(reason)
    print(common.write_results(name, [dict(skipped=reason)]))
    return
  rows = []
  for size in wkv7_mgpu.SIZES:
    r, w, k, v, a, b, dy = (x.astype(jnp.bfloat16) for x in _inputs((batch, length, channels, size)))
    state = jnp.zeros((batch, channels // size, size, size), jnp.float32)
    reference = None
    for pipelined in (False, True) if wkv7_mgpu.pipelines(size) else (False,):
      for explicit in (False, True):
        form = dict(pipelined=pipelined, explicit_barriers=explicit, interpret=None if on_gpu else True)
        forward = jax.jit(lambda *x, f=form: wkv7_mgpu.forward(*x, checkpoints=True, **f))
        backward = jax.jit(lambda *x, f=form: wkv7_mgpu.backward(*x, **f))
        y, final, states = forward(r, w, k, v, a, b, state)
        grads = backward(r, w, k, v, a, b, states, dy, final)
        outputs = (y, final, *states, *grads)
        row = dict(size=size, shape=f"{batch}x{length}x{channels}x{size}", dtype="bfloat16", pipelined=pipelined,
                   explicit_barriers=explicit)
        if on_gpu:
          row["fwd"] = common.time_fn(forward, r, w, k, v, a, b, state, max_runs=args.runs)
          row["bwd"] = common.time_fn(backward, r, w, k, v, a, b, states, dy, final, max_runs=args.runs)
          row.update(fwd_ms=row["fwd"]["median_ms"], bwd_ms=row["bwd"]["median_ms"])
        if reference is None:
          reference = outputs
          exact = _chunked_outputs(r, w, k, v, a, b, state, dy, final)
        else:
          diffs = (jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(z, jnp.float32))
                   for x, z in zip(outputs, reference))
          row["max_diff_from_serial"] = max(float(jnp.max(d)) for d in diffs)
        errors = {label: _rel_err(x, e)
                  for label, x, e in zip(("y", "final", *(f"d{g}" for g in GRADIENTS)), (y, final, *grads), exact)}
        worst = max(errors, key=errors.get)
        row.update(err_vs_chunked=errors[worst], worst_vs_chunked=worst)
        rows.append(row)
        print({key: val for key, val in row.items() if key not in ("fwd", "bwd")}, flush=True)
  print(common.write_results(name, rows))


AOT = ROOT / "benchmarks" / "results" / "gpu-aot-h100.json"
# The compile facts of the settings the H100 times were measured with (the backward at N = 128 as 8 programs a head).
AOT_MEASURED = ROOT / "benchmarks" / "results" / "wkv7-chunked-aot-measured-h100.json"
MEASURED = ROOT / "benchmarks" / "results" / "wkv7-nvidia-h100-80gb-hbm3.json"
COST_RESULTS = common.RESULTS / "wkv7-chunked-cost-h100.json"
SMS = 132

# (N, bytes per operand) -> settings, as pallas/wkv7_chunked.py's SETTINGS.
MEASURED_SETTINGS = {
    64: dict(chunk=16, forward_block=64, backward_block=64, forward_warps=4, backward_warps=8),
    128: dict(chunk=16, forward_block=64, backward_block=16, forward_warps=8, backward_warps=8),
}
COST_SHAPES = {64: ("8x4096x4096x64", "wkv7c_n64_bf16"), 128: ("8x4096x4096x128", "wkv7c_n128_bf16")}


def chunk_forward_flops(size, chunk, block):
  """Matrix-product FLOPs per program and chunk of the forward: value-side 8 L N BV + 8 L^2 BV, key side
  (four pair products) 8 L^2 N, the inverse 12 L^3 (for L = 16)."""
  inverse = 4 * (int(math.log2(chunk)) - 1) * chunk**3
  return dict(value=8 * chunk * size * block + 8 * chunk**2 * block, key=8 * chunk**2 * size + inverse)


def chunk_backward_flops(size, chunk, block):
  """Per program and chunk of the backward: nine [L, BV] x [BV, N]-sized products (18 L N BV), ten [L, L] x [L, BV]
  (20 L^2 BV), twelve [L, L] x [L, N] / [L, N] x [N, L] key-side ones (24 L^2 N: the four pair products again and the
  eight of dr, da, db, dk), and the inverse (12 L^3)."""
  inverse = 4 * (int(math.log2(chunk)) - 1) * chunk**3
  return dict(value=18 * chunk * size * block + 20 * chunk**2 * block, key=24 * chunk**2 * size + inverse)


def cost_rows(size, batch=8, length=4096, width=4096, item=2):
  """Per-kernel rows for one shape: FLOPs and DRAM bytes in all, per element (channel-token) too."""
  s = MEASURED_SETTINGS[size]
  chunk = s["chunk"]
  heads = width // size
  elements = batch * length * width
  chunks = length // chunk
  states = size / chunk * item  # Bytes per element of the bf16 chunk states.
  rows = []

  def add(kernel, block, warps, flops_per_chunk, bytes_el, note):
    programs = batch * heads * (size // block) if block else None
    flops = (flops_per_chunk["value"] + flops_per_chunk["key"]) * programs * chunks if block else 0
    rows.append(dict(kernel=kernel, block=block, warps=warps, programs=programs,
                     grid=f"{batch},{heads},{size // block}" if block else None, flops=flops,
                     flops_el=flops / elements, bytes=bytes_el * elements, bytes_el=bytes_el,
                     key_side_flop_share=(flops_per_chunk["key"] / (flops_per_chunk["value"] + flops_per_chunk["key"])
                                          if block else None), note=note))

  fb, bb = s["forward_block"], s["backward_block"]
  fblocks, bblocks = size // fb, size // bb
  # Forward: r, w, k, a, b read once per value block; v and y once; states written by the checkpointing form.
  fwd_bytes = 5 * item * fblocks + 2 * item
  add("wkv7_chunked_forward_primal", fb, s["forward_warps"], chunk_forward_flops(size, chunk, fb), fwd_bytes,
      "r,w,k,a,b per value block, v, y")
  add("wkv7_chunked_forward", fb, s["forward_warps"], chunk_forward_flops(size, chunk, fb), fwd_bytes + states,
      "+ bf16 chunk states written")
  # Backward: r, w, k, a, b per value block; v, dy; chunk states; dv; key-side gradients written once (one block)
  # or added atomically per block (read + write of a float32 line each).
  grads = 5 * item if bblocks == 1 else 5 * 4 * 2 * bblocks
  add("wkv7_chunked_backward", bb, s["backward_warps"], chunk_backward_flops(size, chunk, bb),
      5 * item * bblocks + 2 * item + states + item + grads,
      "r,w,k,a,b per value block, v, dy, chunk states, dv, " +
      ("key-side gradients written once" if bblocks == 1 else f"5 float32 atomic gradient buffers x {bblocks} blocks"))
  if bblocks > 1:
    add("zero-fill + convert (XLA)", None, None, None, 5 * 4 + 5 * (4 + item), "zero 5 f32 buffers; read, write bf16")
    # One program per head looping over the same value blocks: the value-side products over all N rows, the key side
    # once; inputs read once, key-side gradients written once (dS stays in the program's L2-resident output block).
    flops = chunk_backward_flops(size, chunk, size)
    flops["value"] = 18 * chunk * size * size + 20 * chunk**2 * size
    loop_bytes = 5 * item + 2 * item + states + item + 5 * item
    add("wkv7_chunked_backward (loop)", size, s["backward_warps"], flops, loop_bytes,
        f"one program per head, value blocks of {bb} rows in turn; r,w,k,a,b, v, dy, chunk states, dv, gradients once")
    rows[-1]["block"] = bb
  return rows, elements, chunks


def cost_model(args, platform: str) -> None:
  """Per-kernel cost model of the chunked WKV-7 kernels (pallas/wkv7_chunked.py) at the GPU shapes of
  `backends`,
  set beside the H100 compile report and the H100 measurements.

  Needs no GPU: the launch settings are given here as they were when the H100 times were measured (the
  backward at N = 128 as 8 programs per head, value blocks of 16 rows, adding key-side gradients atomically), the
  compile facts are read from benchmarks/results/gpu-aot-h100.json (registers,
  shared memory, spills, blocks per SM, grid: `benchmarks/gpu_aot.py`), the times from
  benchmarks/results/wkv7-nvidia-h100-80gb-hbm3.json.

  What each number is:
  - compiled: from the deviceless sm_90a compile report.
  - counted: matrix-product FLOPs from the kernels' product lists (`chunk_forward`, `chunk_backward`, per program and
    chunk, with the value-block size BV: the key-side products and the [L, L] inverse run once per program, so a head
    split into N / BV programs runs them N / BV times); elementwise work is not counted.
  - estimated: DRAM bytes, under these assumptions: every program reads its own copy of the [T, N] key-side inputs
    (the value blocks of one head are grid-axis-z neighbours, (B * H) programs apart in launch order, so at one or two
    resident blocks per SM they run in different waves and do not meet in L2); an atomic add into a float32 gradient
    buffer costs a DRAM read and a write of its line (the buffers, 4 bytes x 5 x B*T*C, are far larger than the 50 MB
    L2 and the blocks of a head add to them waves apart); chunk states are bfloat16 [N, N] per chunk of L tokens.
    Roofline time = max(bytes / copy rate, FLOPs / matmul rate) with the rates measured in the same H100 run
    (the `backends` mode's ceilings: 2.40 TB/s copy, 625 TFLOP/s bf16 matmul).
  - measured: forward (the primal kernel, no chunk states) and forward+backward medians on the H100.
  - derived: the backward kernel's time, fwd+bwd minus the forward that stores chunk states (the measured primal plus
    the states' bytes at the copy rate; the range is [primal, primal + states]) minus the XLA zero-fill and convert of
    the atomic buffers (their bytes at the copy rate).
  - predicted (the rows "backward (loop)": the current default at N = 128, one program per head looping over its value
    blocks, not yet timed on a GPU): compile facts from gpu-aot-h100.json; its time is waves x
    chunks x a chunk latency scaled from the N = 64 backward's derived one by FLOPs per program-chunk (the same kind
    of program: one per head, 8 warps, one block per SM, the whole key side once per chunk).
  Waves = ceil(programs / (132 SMs x blocks per SM)); every program walks all T / L chunks in sequence, so a kernel's
  time is about waves x (T / L) x the latency of one chunk in one program, and that latency is what the last column
  gives (derived).
  """
  aot, loop_aot, measured = (json.loads(path.read_text()) for path in (AOT_MEASURED, AOT, MEASURED))
  copy = measured["config"]["ceilings"]["copy_gbps"] * 1e9
  matmul = measured["config"]["ceilings"]["matmul_tflops"] * 1e12
  times = {r["shape"]: r for r in measured["results"] if r["impl"] == "pallas_chunked" and r["dtype"] == "bfloat16"}
  out = dict(source=dict(aot=AOT_MEASURED.name, aot_loop=AOT.name, measured=MEASURED.name,
                         device=measured["device_kind"]),
             ceilings=dict(copy_tbps=copy / 1e12, matmul_tflops=matmul / 1e12, sms=SMS), shapes=[])
  for size in MEASURED_SETTINGS:
    shape, case = COST_SHAPES[size]
    rows, elements, chunks = cost_rows(size)
    facts = {r["kernel"]: r for r in aot["kernels"] if r.get("case") == case}
    loop_facts = [r for r in loop_aot["kernels"] if r.get("case") == case and r["kernel"] == "wkv7_chunked_backward"]
    if size == 128 and loop_facts:
      facts["wkv7_chunked_backward (loop)"] = loop_facts[0]
    meas = times[shape]
    states_ms = size / MEASURED_SETTINGS[size]["chunk"] * 2 * elements / copy * 1e3
    helper_ms = 0.0
    for row in rows:
      row["roofline_ms"] = max(row["bytes"] / copy, row["flops"] / matmul) * 1e3  # estimated
      row["bound"] = "bytes" if row["bytes"] / copy >= row["flops"] / matmul else "flops"
      fact = facts.get(row["kernel"])
      if fact:
        row["compiled"] = {key: fact[key] for key in ("registers", "spills", "smem", "warps", "blocks_per_sm",
                                                      "occupancy_pct", "grid")}
        row["waves"] = math.ceil(row["programs"] / (SMS * fact["blocks_per_sm"]))
      if row["kernel"].startswith("zero-fill"):
        helper_ms = row["roofline_ms"]
    fwd_ms, total_ms = meas["fwd_ms"], meas["fwd_bwd_ms"]
    bwd_range = (total_ms - fwd_ms - states_ms - helper_ms, total_ms - fwd_ms - helper_ms)
    for row in rows:
      if row["kernel"] == "wkv7_chunked_forward_primal":
        row["measured_ms"] = fwd_ms
      elif row["kernel"] == "wkv7_chunked_forward":
        row["derived_ms"] = (fwd_ms, fwd_ms + states_ms)
      elif row["kernel"] == "wkv7_chunked_backward":
        row["derived_ms"] = bwd_range
      elif row["kernel"].startswith("zero-fill"):
        row["derived_ms"] = (helper_ms, helper_ms)
      ms = row.get("measured_ms") or (sum(row["derived_ms"]) / 2 if "derived_ms" in row else None)
      if ms and row.get("waves"):
        row["chunk_latency_us"] = ms * 1e3 / (row["waves"] * chunks)  # derived
        row["x_roofline"] = ms / row["roofline_ms"]
        row["achieved_tbps"] = row["bytes"] / (ms * 1e-3) / 1e12
        row["flops_per_program_chunk"] = row["flops"] / (row["programs"] * chunks)
    out["shapes"].append(dict(shape=shape, case=case, fwd_ms_measured=fwd_ms, fwd_bwd_ms_measured=total_ms,
                              kernels=rows))
  # The looped backward's prediction: the N = 64 backward's derived chunk latency per FLOP of a program-chunk.
  n64 = next(r for r in out["shapes"][0]["kernels"] if r["kernel"] == "wkv7_chunked_backward")
  rate = n64["chunk_latency_us"] / n64["flops_per_program_chunk"]
  for entry in out["shapes"]:
    chunks = int(entry["shape"].split("x")[1]) // 16
    for row in entry["kernels"]:
      if row["kernel"] == "wkv7_chunked_backward (loop)" and row.get("waves"):
        row["flops_per_program_chunk"] = row["flops"] / (row["programs"] * chunks)
        row["chunk_latency_us_predicted"] = row["flops_per_program_chunk"] * rate
        row["predicted_ms"] = row["waves"] * chunks * row["chunk_latency_us_predicted"] / 1e3
        row["x_roofline"] = row["predicted_ms"] / row["roofline_ms"]
        forward = next(r for r in entry["kernels"] if r["kernel"] == "wkv7_chunked_forward")["derived_ms"]
        entry["fwd_bwd_ms_predicted_loop"] = (forward[0] + row["predicted_ms"], forward[1] + row["predicted_ms"])
  COST_RESULTS.write_text(json.dumps(out, indent=1) + "\n")
  header = ("| shape | kernel | grid (programs) | BV, warps | regs / spill B / smem B (compiled) | blocks/SM, occ% "
            "(compiled) | waves | GFLOP (counted) | GB (estimated) | roofline ms (estimated) | time ms | x roofline "
            "| us per chunk-program (derived) |")
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for entry in out["shapes"]:
    for row in entry["kernels"]:
      c = row.get("compiled")
      time = (f"{row['measured_ms']:.2f} (measured)" if "measured_ms" in row else
              f"{row['predicted_ms']:.1f} (predicted)" if "predicted_ms" in row else
              f"{row['derived_ms'][0]:.1f}-{row['derived_ms'][1]:.1f} (derived)" if "derived_ms" in row else "")
      lines.append(
          f"| {entry['shape']} | {row['kernel']} | {row['grid'] or '-'} ({row['programs'] or '-'}) | "
          f"{row['block'] or '-'}, {row['warps'] or '-'} | "
          + (f"{c['registers']} / {c['spills']} / {c['smem']}" if c else "-") + " | "
          + (f"{c['blocks_per_sm']}, {c['occupancy_pct']}" if c else "-") + f" | {row.get('waves', '-')} | "
          f"{row['flops'] / 1e9:.0f} | {row['bytes'] / 1e9:.2f} ({row['bytes_el']:.0f} B/el) | "
          f"{row['roofline_ms']:.2f} ({row['bound']}) | {time} | "
          + (f"{row['x_roofline']:.1f}" if "x_roofline" in row else "-") + " | "
          + (f"{row['chunk_latency_us']:.1f}" if "chunk_latency_us" in row else
             f"{row['chunk_latency_us_predicted']:.1f} (predicted)" if "chunk_latency_us_predicted" in row else "-")
          + " |")
  print("\n".join(lines))
  for entry in out["shapes"]:
    if "fwd_bwd_ms_predicted_loop" in entry:
      low, high = entry["fwd_bwd_ms_predicted_loop"]
      print(f"\n{entry['shape']}: fwd+bwd with the looped backward {low:.1f}-{high:.1f} ms (predicted), "
            f"{entry['fwd_bwd_ms_measured']:.2f} ms measured with the per-block programs")
  if not args.markdown:
    print(f"# wrote {COST_RESULTS}")


def backends(args, platform: str) -> None:
  """Every backend of --impls and every importable peer, forward and forward+backward, at the --shapes."""
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
  # The quick run proves the script end to end; it must not overwrite a measured table.
  path = common.write_results(
      "wkv7-quick" if args.shapes == "quick" else "wkv7", rows, shapes=args.shapes, ceilings=ceilings,
      peers_run=sorted(peers), peers_missing=missing, peer_versions=peers_lib.versions(PEER_PACKAGES),
      note=("shape is BxTxCxN; ms are medians; floor_x = time / max(bytes / copy rate, FLOPs / bf16 matmul rate); "
            "bytes count the six inputs and y (+ dy and six gradients) once; FLOPs are 9 N^2 per token-head forward, "
            "3x for forward+backward; B/el and FLOP/el are per element (channel of a token) of the row's own "
            "algorithm where known (this project's kernels: chunk states, partial gradients, the chunked kernels' "
            "matrix products), else the same minimal counts; roofline_x = time / max(B/el / copy rate, FLOP/el / "
            "matmul rate) x elements; rel_err = max|y - y_scan_f32| / max|y_scan_f32|. On CPU the pallas backends "
            "run in the Pallas interpreter: their times say nothing about the GPU kernels."))
  print(f"wrote {path}")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--mode", choices=("backends", "backward", "cost", "mgpu"), default="backends")
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  group = parser.add_argument_group("backends")
  group.add_argument("--shapes", choices=sorted(SHAPES), default=platform)
  group.add_argument("--quick", action="store_true", help="same as --shapes quick: tiny shapes, seconds")
  group.add_argument("--dtypes", nargs="+", default=None, help="default: float32 on cpu, bfloat16 on gpu")
  group.add_argument("--impls", nargs="+", default=list(AVAILABLE), choices=AVAILABLE)
  group.add_argument("--no-peers", action="store_true")
  group = parser.add_argument_group("backward, mgpu")
  group.add_argument("--shape", default="8,4096,4096,128", help="B,T,C,N (mgpu: N is each of the kernels' sizes)")
  group.add_argument("--runs", type=int, default=20)
  group.add_argument("--reference-rows", type=int, default=1, help="batch rows the float32 XLA reference runs on")
  group.add_argument("--name", default=None,
                     help="backward, mgpu: results file stem (default wkv7-chunked-backward, wkv7-mgpu-forms; "
                          "-<device>.json is added)")
  group.add_argument("--layouts", nargs="+", default=list(LAYOUTS),
                     help="backward: launch settings to time, each default or key=value,... "
                          "(e.g. backward_block=32,backward_warps=4,backward_loop=0)")
  group = parser.add_argument_group("cost")
  group.add_argument("--markdown", action="store_true")
  args = parser.parse_args()
  modes = {"backends": backends, "backward": backward_layouts, "cost": cost_model, "mgpu": mgpu_forms}
  modes[args.mode](args, platform)


if __name__ == "__main__":
  main()
