"""Training metrics: one JSON object per logged step in WORKDIR/metrics.jsonl, plus TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

from tensorboardX import SummaryWriter


class MetricsWriter:
  """Appends rows to metrics.jsonl and scalars to WORKDIR/tensorboard. On resume from step S, rows logged after S by
  the interrupted run are dropped first: the resumed run recomputes those steps, so the file stays one row per step."""

  def __init__(self, workdir: str | pathlib.Path, resume_step: int = 0):
    workdir = pathlib.Path(workdir)
    self.path = workdir / "metrics.jsonl"
    if self.path.exists():
      kept = [json.dumps(row) for row in read_metrics(workdir) if row.get("step", 0) <= resume_step]
      tmp = self.path.with_suffix(".jsonl.tmp")
      tmp.write_text("".join(line + "\n" for line in kept))
      os.replace(tmp, self.path)
    self._file = self.path.open("a")
    self._tb = SummaryWriter(str(workdir / "tensorboard"), purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(k, v, step)
    self._tb.flush()

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def _plain(value):
  value = float(value) if hasattr(value, "dtype") or isinstance(value, float) else value
  return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
  """The rows of WORKDIR/metrics.jsonl; a line cut short by a crash mid-write is skipped."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  rows = []
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows
