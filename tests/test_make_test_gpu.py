"""`make test-gpu` on a machine whose jax has no GPU: one line that says so, and a failing exit status. The GPU is
hidden from the jax it asks (JAX_PLATFORMS=cpu), so the test means the same on a GPU host."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make, which this machine lacks")
def test_without_a_gpu_it_says_so_in_one_line_and_fails(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}", f"GPU_VENV={tmp_path / 'venv'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("test-gpu: no GPU here") and "backend: cpu" in lines[0], out.stdout
  assert not (tmp_path / "venv").exists()  # It stopped before building anything.
