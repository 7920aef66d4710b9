#!/usr/bin/env python3
"""Per-kernel cost model of the chunked WKV-7 kernels (pallas/wkv7_chunked.py) at benchmarks/wkv7.py's GPU shapes,
set beside the H100 compile report and the H100 measurements.

  python benchmarks/wkv7_chunked_cost.py             # prints the table, writes its JSON (--json)
  python benchmarks/wkv7_chunked_cost.py --markdown  # the table of docs/kernels.md

Needs no GPU and no jax: the launch settings are given here as they were when the H100 times were measured (the
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
  (benchmarks/wkv7.py's ceilings: 2.40 TB/s copy, 625 TFLOP/s bf16 matmul).
- measured: forward (the primal kernel, no chunk states) and forward+backward medians on the H100.
- derived: the backward kernel's time, fwd+bwd minus the forward that stores chunk states (the measured primal plus
  the states' bytes at the copy rate; the range is [primal, primal + states]) minus the XLA zero-fill and convert of
  the atomic buffers (their bytes at the copy rate).
- predicted (the rows "backward (loop)": the current default at N = 128, one program per head looping over its value
  blocks, not yet timed on a GPU): compile facts from --aot-loop (the default gpu-aot-h100.json); its time is waves x
  chunks x a chunk latency scaled from the N = 64 backward's derived one by FLOPs per program-chunk (the same kind
  of program: one per head, 8 warps, one block per SM, the whole key side once per chunk).
Waves = ceil(programs / (132 SMs x blocks per SM)); every program walks all T / L chunks in sequence, so a kernel's
time is about waves x (T / L) x the latency of one chunk in one program, and that latency is what the last column
gives (derived).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
AOT = ROOT / "benchmarks" / "results" / "gpu-aot-h100.json"
# The compile facts of the settings the H100 times were measured with (the backward at N = 128 as 8 programs a head).
AOT_MEASURED = ROOT / "benchmarks" / "results" / "wkv7-chunked-aot-measured-h100.json"
MEASURED = ROOT / "benchmarks" / "results" / "wkv7-nvidia-h100-80gb-hbm3.json"
RESULTS = ROOT / "benchmarks" / "results" / "wkv7-chunked-cost-h100.json"
SMS = 132

# (N, bytes per operand) -> settings, as pallas/wkv7_chunked.py's SETTINGS.
SETTINGS = {
    64: dict(chunk=16, forward_block=64, backward_block=64, forward_warps=4, backward_warps=8),
    128: dict(chunk=16, forward_block=64, backward_block=16, forward_warps=8, backward_warps=8),
}
SHAPES = {64: ("8x4096x4096x64", "wkv7c_n64_bf16"), 128: ("8x4096x4096x128", "wkv7c_n128_bf16")}


def forward_flops(size, chunk, block):
  """Matrix-product FLOPs per program and chunk of the forward: value-side 8 L N BV + 8 L^2 BV, key side
  (four pair products) 8 L^2 N, the inverse 12 L^3 (for L = 16)."""
  inverse = 4 * (int(math.log2(chunk)) - 1) * chunk**3
  return dict(value=8 * chunk * size * block + 8 * chunk**2 * block, key=8 * chunk**2 * size + inverse)


def backward_flops(size, chunk, block):
  """Per program and chunk of the backward: nine [L, BV] x [BV, N]-sized products (18 L N BV), ten [L, L] x [L, BV]
  (20 L^2 BV), twelve [L, L] x [L, N] / [L, N] x [N, L] key-side ones (24 L^2 N: the four pair products again and the
  eight of dr, da, db, dk), and the inverse (12 L^3)."""
  inverse = 4 * (int(math.log2(chunk)) - 1) * chunk**3
  return dict(value=18 * chunk * size * block + 20 * chunk**2 * block, key=24 * chunk**2 * size + inverse)


def model(size, batch=8, length=4096, width=4096, item=2):
  """Per-kernel rows for one shape: FLOPs and DRAM bytes in all, per element (channel-token) too."""
  s = SETTINGS[size]
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
  add("wkv7_chunked_forward_primal", fb, s["forward_warps"], forward_flops(size, chunk, fb), fwd_bytes,
      "r,w,k,a,b per value block, v, y")
  add("wkv7_chunked_forward", fb, s["forward_warps"], forward_flops(size, chunk, fb), fwd_bytes + states,
      "+ bf16 chunk states written")
  # Backward: r, w, k, a, b per value block; v, dy; chunk states; dv; key-side gradients written once (one block)
  # or added atomically per block (read + write of a float32 line each).
  grads = 5 * item if bblocks == 1 else 5 * 4 * 2 * bblocks
  add("wkv7_chunked_backward", bb, s["backward_warps"], backward_flops(size, chunk, bb),
      5 * item * bblocks + 2 * item + states + item + grads,
      "r,w,k,a,b per value block, v, dy, chunk states, dv, " +
      ("key-side gradients written once" if bblocks == 1 else f"5 float32 atomic gradient buffers x {bblocks} blocks"))
  if bblocks > 1:
    add("zero-fill + convert (XLA)", None, None, None, 5 * 4 + 5 * (4 + item), "zero 5 f32 buffers; read, write bf16")
    # One program per head looping over the same value blocks: the value-side products over all N rows, the key side
    # once; inputs read once, key-side gradients written once (dS stays in the program's L2-resident output block).
    flops = backward_flops(size, chunk, size)
    flops["value"] = 18 * chunk * size * size + 20 * chunk**2 * size
    loop_bytes = 5 * item + 2 * item + states + item + 5 * item
    add("wkv7_chunked_backward (loop)", size, s["backward_warps"], flops, loop_bytes,
        f"one program per head, value blocks of {bb} rows in turn; r,w,k,a,b, v, dy, chunk states, dv, gradients once")
    rows[-1]["block"] = bb
  return rows, elements, chunks


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--aot", default=str(AOT_MEASURED), help="compile facts of the measured settings")
  parser.add_argument("--aot-loop", default=str(AOT), help="compile facts of the looped N = 128 backward")
  parser.add_argument("--measured", default=str(MEASURED))
  parser.add_argument("--json", default=str(RESULTS))
  parser.add_argument("--markdown", action="store_true")
  args = parser.parse_args()
  aot = json.loads(pathlib.Path(args.aot).read_text())
  loop_aot = json.loads(pathlib.Path(args.aot_loop).read_text())
  measured = json.loads(pathlib.Path(args.measured).read_text())
  copy = measured["config"]["ceilings"]["copy_gbps"] * 1e9
  matmul = measured["config"]["ceilings"]["matmul_tflops"] * 1e12
  times = {r["shape"]: r for r in measured["results"] if r["impl"] == "pallas_chunked" and r["dtype"] == "bfloat16"}
  out = dict(source=dict(aot=args.aot, aot_loop=args.aot_loop, measured=args.measured, device=measured["device_kind"]),
             ceilings=dict(copy_tbps=copy / 1e12, matmul_tflops=matmul / 1e12, sms=SMS), shapes=[])
  for size in SETTINGS:
    shape, case = SHAPES[size]
    rows, elements, chunks = model(size)
    facts = {r["kernel"]: r for r in aot["kernels"] if r.get("case") == case}
    loop_facts = [r for r in loop_aot["kernels"] if r.get("case") == case and r["kernel"] == "wkv7_chunked_backward"]
    if size == 128 and loop_facts:
      facts["wkv7_chunked_backward (loop)"] = loop_facts[0]
    meas = times[shape]
    states_ms = size / SETTINGS[size]["chunk"] * 2 * elements / copy * 1e3
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
  pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
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
    print(f"# wrote {args.json}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
