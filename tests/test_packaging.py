"""What `pip install` ships: every package folder, and the kernels under the project's own name `ltm_pallas`."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import tomllib

import ltm_pallas
from conftest import ROOT


def _pyproject() -> dict:
  return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
  setuptools = _pyproject()["tool"]["setuptools"]
  folders = {"ltm_jax": ROOT / "ltm_jax", **{name: ROOT / path for name, path in setuptools["package-dir"].items()}}
  found = set()
  for name, folder in folders.items():
    for init in folder.rglob("__init__.py"):
      relative = init.parent.relative_to(folder)
      found.add(".".join([name, *relative.parts]))
  assert sorted(found) == sorted(setuptools["packages"])


def test_kernels_install_as_ltm_pallas_from_the_pallas_folder():
  assert pathlib.Path(ltm_pallas.__file__).resolve() == ROOT / "pallas" / "__init__.py"
  assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"ltm_pallas": "pallas"}
  assert importlib.metadata.version("ltm-jax")  # Installed (editable), which is what maps the name.


def _imported_modules(path: pathlib.Path) -> set[str]:
  """Every module a Python file imports, at any depth of its code (function-level imports included)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module)
  return found


def test_kernel_package_imports_nothing_from_ltm_jax():
  """`ltm_pallas` knows no model: none of its files imports `ltm_jax` (the ops import the kernels, never back)."""
  files = sorted((ROOT / "pallas").rglob("*.py"))
  assert files
  reaching_up = {str(f.relative_to(ROOT)): sorted(m for m in _imported_modules(f) if m.split(".")[0] == "ltm_jax")
                 for f in files}
  assert not {f: m for f, m in reaching_up.items() if m}
