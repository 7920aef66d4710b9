"""Training metrics: one JSON object per logged step in WORKDIR/metrics.jsonl, plus TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

from tensorboardX import SummaryWriter

from ltm_jax.errors import WorkdirError


class MetricsWriter:
  """Appends rows to metrics.jsonl and scalars to WORKDIR/tensorboard. On resume from step S, rows logged after S by
  the interrupted run are dropped first (`dropped`: their steps; the resumed run recomputes those steps, so the file
  stays one row per step), and so is a line a crash cut short; rows up to S keep their values. The TensorBoard
  events file is opened with the first row, so a run that logs nothing writes none."""

  def __init__(self, workdir: str | pathlib.Path, resume_step: int = 0):
    workdir = pathlib.Path(workdir)
    self.path = workdir / "metrics.jsonl"
    rows = read_metrics(workdir)
    self.dropped = [row["step"] for row in rows if row["step"] > resume_step]
    text = self.path.read_text() if self.path.exists() else ""
    # A line cut short by a crash (read_metrics skips it) would swallow the next row appended to it.
    torn = bool(text) and (text.count("\n") != len(rows) or not text.endswith("\n"))
    if self.dropped or torn:
      kept = [json.dumps(row) for row in rows if row["step"] <= resume_step]
      tmp = self.path.with_suffix(".jsonl.tmp")
      tmp.write_text("".join(line + "\n" for line in kept))
      os.replace(tmp, self.path)
    self._file = self.path.open("a")
    self._tensorboard = (str(workdir / "tensorboard"), resume_step + 1)
    self._tb: SummaryWriter | None = None

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._tb is None:
      folder, purge_step = self._tensorboard
      self._tb = SummaryWriter(folder, purge_step=purge_step)
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(k, v, step)
    self._tb.flush()

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


# Dense (no 2:4 sparsity) bfloat16 tensor-core peak TFLOP/s per device, from NVIDIA's datasheets: A100 (SXM and
# PCIe) 312; H100 SXM 989 and H100 PCIe 756 (the datasheets' 1979 / 1513 are with sparsity); H200 989 (same GH100
# compute as H100 SXM). Matched against `jax.Device.device_kind` (e.g. "NVIDIA H100 80GB HBM3"), first match wins.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_kind: str) -> float | None:
  """The dense bfloat16 peak TFLOP/s of one device of this kind, or None when it is not in the table (CPUs)."""
  for name, peak in PEAK_BF16_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return None


def throughput(flops_per_step: float, steps: int, seconds: float, devices: int, device_kind: str,
               bubble: float = 0.0) -> dict[str, float]:
  """Model TFLOP/s per device and, where the device's peak is known, MFU (model FLOPs utilisation, 0-1).

  `flops_per_step` is the model's FLOPs for one train step (ltm_jax.flops.flops_per_token's training FLOPs times the
  step's tokens, info.model_info's flops_per_step_train: 6 N per token plus attention, and the latent inner loop's
  forward and backward passes); recomputation by remat is not counted, as MFU conventionally excludes it. MFU is against the bfloat16 peak whatever the compute dtype.

  `bubble`: the idle fraction of a pipelined step (ltm_jax.layers.pipeline.bubble_fraction). Every device's whole
  step time is counted, idle or not, so the bubble lowers `mfu` (the work done in the bubble is not model FLOPs);
  with a bubble the row also gives it (`pipeline_bubble`) and the MFU of the time outside it
  (`mfu_outside_bubble` = mfu / (1 - bubble)), which separates the schedule's loss from the stages' own speed."""
  achieved = flops_per_step * steps / seconds / devices / 1e12
  row = {"model_tflops_per_device": achieved}
  peak = peak_tflops(device_kind)
  if peak is not None:
    row["mfu"] = achieved / peak
  if bubble > 0:
    row["pipeline_bubble"] = bubble
    if peak is not None:
      row["mfu_outside_bubble"] = row["mfu"] / (1 - bubble)
  return row


def _plain(value):
  value = float(value) if hasattr(value, "dtype") or isinstance(value, float) else value
  return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """The rows of WORKDIR/metrics.jsonl; a line cut short by a crash mid-write is skipped. WorkdirError for a file
  that is not text or holds something other than JSON objects with a step."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  try:
    lines = path.read_text().splitlines() if path.exists() else []
  except (UnicodeDecodeError, OSError) as e:
    raise WorkdirError(f"{path} cannot be read: {e}") from e
  rows = []
  for number, line in enumerate(lines, 1):
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
      raise WorkdirError(f"{path} line {number} is not a metrics row (a JSON object with an integer step)")
    rows.append(row)
  return rows
