"""Times attention backends and peers, forward and forward+backward, in TFLOP/s of unmasked work.

  python benchmarks/attention.py                # CPU: tiny shapes, pallas (interpreted) vs xla; proves the script
                                                #   runs end to end in under a minute; its times mean nothing for GPUs
  python benchmarks/attention.py --shapes gpu   # the default on a GPU: T = 1k..16k, head dim 64 and 128, causal and
                                                #   window 256, bfloat16, B * T = 16k tokens, Hq * D = 2048
  python benchmarks/attention.py --quick        # one tiny shape (T = 64, D = 32): proves the script in seconds

Backends: ltm_jax's "pallas", "xla" and "ltm_tokamax" (the op's impl="tokamax", Hopper only, where tokamax is
installed), `jax.nn.dot_product_attention(implementation="cudnn")`, and the peers that are
importable: `tokamax.dot_product_attention` (its Triton path and its default), jax-linear-attention's FA3-style
Mosaic GPU kernel (`jla.layers.attention.attention(implementation="mosaic_gpu")`, Hopper only) and PyTorch SDPA
(causal only: SDPA's flash kernel has no sliding window). FLOPs count only visible (query, key) pairs: 4 * D per
pair forward (QK^T and PV), 3.5x that forward+backward (the backward's five matmuls: QK^T again, dV, dP, dQ, dK). Each
row also gives the time as a multiple of its floor, max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul
rate), and the forward's max |error| on one batch row and two heads against the xla backend in float32.

Writes benchmarks/results/<name>-<device>.json (--name; default attention, or attention-quick with --quick) and prints
the `GPU_AUTO` table (ltm_jax/ops/attention) that the forward+backward times suggest, when both pallas and cudnn ran.
"""

from __future__ import annotations

import argparse
import collections

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import peers as peers_lib

from ltm_jax.ops.attention import attention, cudnn, mask_kind, tokamax_mgpu

SEQS = {"cpu": [128, 256], "gpu": [1024, 2048, 4096, 8192, 16384], "quick": [64]}
HEAD_DIMS = {"cpu": [64], "gpu": [64, 128], "quick": [32]}
WINDOW = {"cpu": 32, "gpu": 256, "quick": 16}
TOKENS = {"cpu": 256, "gpu": 16384, "quick": 64}  # B * T of every call.
WIDTH = {"cpu": 128, "gpu": 2048, "quick": 64}  # Hq * D.
# xla builds [B, H, T, S] float32 logits (and probabilities, and their cotangents); skip it past this many bytes.
XLA_LOGITS_LIMIT = 8 * 2**30
COLUMNS = ("impl", "mask", "T", "D", "fwd_ms", "fwd_tflops", "fwd_bwd_ms", "fwd_bwd_tflops", "fwd_bwd_floor_x",
           "max_abs_err")


def visible_pairs(t: int, window: int | None) -> int:
  """(query, key) pairs a causal call with T == S (and a window) computes, per batch row and head."""
  if window is None or window >= t:
    return t * (t + 1) // 2
  return window * (window + 1) // 2 + (t - window) * window


def _inputs(b, t, h, d, dtype):
  keys = jax.random.split(jax.random.key(t * 1000 + d), 4)
  return tuple(jax.random.normal(key, (b, t, h, d), jnp.float32).astype(dtype) for key in keys)


def _jax_impl(name, window):
  """fn(q, k, v) for a JAX backend, or None when it cannot be imported here."""
  if name in ("pallas", "xla"):
    return lambda q, k, v: attention(q, k, v, window=window, impl=name)
  if name == "ltm_tokamax":  # Our op's impl="tokamax": tokamax's Mosaic GPU kernels, short windows run blocked.
    if tokamax_mgpu.missing_reason() is not None:
      return None
    return lambda q, k, v: attention(q, k, v, window=window, impl="tokamax")
  if name == "cudnn":
    return lambda q, k, v: cudnn.attention(q, k, v, causal=True, window=window, scale=q.shape[-1] ** -0.5)
  if name.startswith("tokamax"):
    try:
      import tokamax  # Peer: optional.
    except ImportError:
      return None
    implementation = "triton" if name == "tokamax_triton" else None
    # Our window W keeps keys i - W < j <= i: W - 1 keys to the left.
    local = None if window is None else (window - 1, 0)
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                                         implementation=implementation)
  if name == "jla_mosaic":
    try:
      from jla.layers.attention import attention as jla_attention  # Peer: optional.
    except ImportError:
      return None
    # Its sliding_window counts the visible keys including the query itself: our W.
    return lambda q, k, v: jla_attention(q, k, v, sliding_window=window, scale=q.shape[-1] ** -0.5,
                                         implementation="mosaic_gpu")
  raise ValueError(name)


def _time_jax(fn, q, k, v, do):
  """({fwd, fwd_bwd, compile_s, ...}, forward output)."""
  budget = dict(min_runs=3, budget_s=0.5) if jax.default_backend() == "cpu" else {}
  return common.time_forward_backward(fn, (q, k, v), do, **budget)


def _time_torch_sdpa(q, k, v, do):
  """PyTorch SDPA (causal) on the same values, or None when torch with CUDA is not importable."""
  try:
    import torch  # Peer: optional, never a dependency.
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  to_torch = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16).transpose(1, 2)
  tq, tk, tv, tdo = (to_torch(x).contiguous() for x in (q, k, v, do))
  tq.requires_grad_(), tk.requires_grad_(), tv.requires_grad_()
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def forward():
    with torch.no_grad():
      return sdpa(tq, tk, tv, is_causal=True)

  def forward_backward():
    out = sdpa(tq, tk, tv, is_causal=True)
    out.backward(tdo)

  timings = {"fwd": common.time_torch(forward), "fwd_bwd": common.time_torch(forward_backward), "compile_s": 0.0}
  return timings, forward().transpose(1, 2).float().cpu().numpy()


def bench_shape(impls, t, d, window, dtype, platform, ceilings):
  b = max(TOKENS[platform] // t, 1)
  h = WIDTH[platform] // d
  q, k, v, do = _inputs(b, t, h, d, dtype)
  # Error baseline: xla in float32 on batch row 0, heads 0-1 (small enough at every T).
  sliced = lambda x: x[:1, :, :2].astype(jnp.float32)
  reference = jax.jit(lambda q, k, v: attention(q, k, v, window=window, impl="xla"))(*map(sliced, (q, k, v)))
  pairs = visible_pairs(t, window) * b * h
  fwd_flops = 4 * d * pairs
  itemsize = jnp.dtype(dtype).itemsize
  tensor_bytes = b * t * h * d * itemsize
  floors = {  # Seconds: q, k, v read and o written; the backward adds do, o read and dq, dk, dv written.
      "fwd": max(4 * tensor_bytes / (ceilings["copy_gbps"] * 1e9), fwd_flops / (ceilings["matmul_tflops"] * 1e12)),
      "fwd_bwd": max(13 * tensor_bytes / (ceilings["copy_gbps"] * 1e9),
                     3.5 * fwd_flops / (ceilings["matmul_tflops"] * 1e12)),
  }
  rows = []
  for impl in impls:
    row = {"impl": impl, "mask": mask_kind(True, window, t), "T": t, "D": d, "B": b, "H": h, "window": window,
           "dtype": jnp.dtype(dtype).name}
    if impl == "xla" and 4 * b * h * t * t > XLA_LOGITS_LIMIT:
      row["skipped"] = "float32 logits would exceed XLA_LOGITS_LIMIT"
    elif impl == "cudnn" and cudnn.device_unsupported_reason()[0]:
      row["skipped"] = cudnn.device_unsupported_reason()[0]
    elif impl == "torch_sdpa" and window is not None:
      row["skipped"] = "SDPA's flash kernel has no sliding window"
    else:
      try:
        if impl == "torch_sdpa":
          result = _time_torch_sdpa(q, k, v, do)
        else:
          fn = _jax_impl(impl, window)
          result = None if fn is None else _time_jax(fn, q, k, v, do)
      except Exception as e:  # A peer that rejects a shape is reported, not fatal.  # noqa: BLE001
        row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
        result = None
      if result is None and "skipped" not in row:
        row["skipped"] = "not importable"
      if result is not None:
        timings, out = result
        err = np.max(np.abs(np.asarray(out[:1, :, :2], np.float32) - np.asarray(reference)))
        row.update({
            "fwd_ms": timings["fwd"]["median_ms"],
            "fwd_tflops": fwd_flops / timings["fwd"]["median_ms"] / 1e9,
            "fwd_bwd_ms": timings["fwd_bwd"]["median_ms"],
            "fwd_bwd_tflops": 3.5 * fwd_flops / timings["fwd_bwd"]["median_ms"] / 1e9,
            "fwd_floor_x": timings["fwd"]["median_ms"] / 1e3 / floors["fwd"],
            "fwd_bwd_floor_x": timings["fwd_bwd"]["median_ms"] / 1e3 / floors["fwd_bwd"],
            "fwd_bwd_us_per_token": timings["fwd_bwd"]["median_ms"] * 1e3 / (b * t),
            "max_abs_err": float(err),
            "compile_s": timings["compile_s"],
            "fwd": timings["fwd"],
            "fwd_bwd": timings["fwd_bwd"],
        })
    rows.append(row)
    common.print_table(rows[-1:], COLUMNS if "skipped" not in row else ("impl", "mask", "T", "D", "skipped"))
  return rows


def suggested_gpu_auto(rows):
  """(mask, D) -> "pallas" or "cudnn": whichever is faster forward+backward at more of the measured lengths."""
  wins = collections.defaultdict(collections.Counter)
  timed = {(r["impl"], r["mask"], r["T"], r["D"]): r["fwd_bwd_ms"] for r in rows if "fwd_bwd_ms" in r}
  for (impl, mask, t, d), ms in timed.items():
    other = timed.get(("cudnn" if impl == "pallas" else "pallas", mask, t, d))
    if impl in ("pallas", "cudnn") and other is not None and ms < other:
      wins[(mask, d)][impl] += 1
  return {key: ("pallas" if c["pallas"] > c["cudnn"] else "cudnn") for key, c in sorted(wins.items())}


def goals(rows):
  """The targets, per shape: pallas fwd+bwd speed over cudnn (>= 0.9) and over tokamax's Triton (>= 1.0);
  window-256 pallas time per token from 2k to 16k (flat)."""
  timed = {(r["impl"], r["mask"], r["T"], r["D"]): r for r in rows if "fwd_bwd_ms" in r}
  out = []
  for (impl, mask, t, d), r in sorted(timed.items()):
    if impl != "pallas":
      continue
    entry = {"mask": mask, "T": t, "D": d, "us_per_token": r["fwd_bwd_us_per_token"]}
    for peer in ("cudnn", "tokamax_triton", "jla_mosaic"):
      if (peer, mask, t, d) in timed:
        entry[f"speed_vs_{peer}"] = timed[(peer, mask, t, d)]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    out.append(entry)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  platform = "cpu" if jax.default_backend() == "cpu" else "gpu"
  impls_all = ["pallas", "cudnn", "xla", "ltm_tokamax", "tokamax_triton", "tokamax", "jla_mosaic", "torch_sdpa"]
  parser.add_argument("--shapes", choices=sorted(SEQS), default=platform)
  parser.add_argument("--quick", action="store_true", help="same as --shapes quick: one tiny shape, seconds")
  parser.add_argument("--name", default=None,
                      help="results file benchmarks/results/<name>-<device>.json (default: attention[-quick])")
  parser.add_argument("--impls", nargs="+", default=None, choices=impls_all,
                      help="default: pallas xla on cpu; all on gpu")
  parser.add_argument("--seqs", nargs="+", type=int, default=None)
  parser.add_argument("--head-dims", nargs="+", type=int, default=None)
  args = parser.parse_args()
  if args.quick:
    args.shapes = "quick"
  shapes = args.shapes
  impls = args.impls or (["pallas", "xla"] if platform == "cpu" else impls_all)
  ceilings = common.measure_ceilings()
  print(f"ceilings: {ceilings}")

  rows = []
  for d in args.head_dims or HEAD_DIMS[shapes]:
    for t in args.seqs or SEQS[shapes]:
      for window in (None, WINDOW[shapes]):
        rows += bench_shape(impls, t, d, window, jnp.bfloat16, shapes, ceilings)
  print()
  common.print_table([r for r in rows if "fwd_ms" in r], COLUMNS)
  table = suggested_gpu_auto(rows)
  if table:
    print("\nsuggested GPU_AUTO (ltm_jax/ops/attention/__init__.py), by forward+backward time:")
    for key, impl in table.items():
      print(f"    {key!r}: {impl!r},")
  # The quick run proves the script end to end; it must not overwrite a measured table.
  name = args.name or ("attention-quick" if shapes == "quick" else "attention")
  path = common.write_results(
      name, rows, shapes=shapes, impls=impls, ceilings=ceilings, goals=goals(rows),
      peer_versions=peers_lib.versions(("tokamax", "jax-linear-attention", "torch", "cudnn")),
      suggested_gpu_auto={f"{m}/{d}": impl for (m, d), impl in table.items()},
      note=("bfloat16, causal self-attention (T == S), MHA; TFLOP/s count visible pairs only: 4*D per pair forward, "
            "3.5x forward+backward; ms are medians; floor_x = time / max(bytes/copy_gbps, flops/matmul_tflops); "
            "max_abs_err: forward vs xla float32 on batch row 0, heads 0-1"))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
