"""Every notebook executes top to bottom (with few training steps), so none of them rots."""

from __future__ import annotations


import nbclient
import nbformat
import pytest

from conftest import ROOT

# The kernels inherit the session's compile mode (conftest): without XLA's expensive passes on the CPU, 2.2x faster
# for 02, whose time is compiling a dozen small programs once each, and as fast for the quickstart (25.6 s against
# 26.0 optimised).
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.long
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("LTM_NOTEBOOK_STEPS", "12")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors


def test_notebooks_exist():
  assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
