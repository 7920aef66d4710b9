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


# Lowest first: a module of ltm_jax imports from its own layer and those below, never from one above. Everything
# not listed (training, parallel, inference, serving, the API) sits on top.
LAYERS = (("ltm_jax.errors",), ("ltm_jax.ops",), ("ltm_jax.layers",), ("ltm_jax.parallel.mesh_checks",),
          ("ltm_jax.config",), ("ltm_jax.model", "ltm_jax.sublayers"))


def _layer(module: str) -> int:
  return next((i for i, names in enumerate(LAYERS) for name in names
               if module == name or module.startswith(name + ".")), len(LAYERS))


def _ltm_jax_imports(path: pathlib.Path, root: pathlib.Path = ROOT, package: str = "ltm_jax") -> set[str]:
  """The modules of `package` (a folder under `root`) a file imports, at any depth of its code, imports under
  `if TYPE_CHECKING:` included (`from a import b` counts as a.b where b is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      for alias in node.names:
        submodule = root.joinpath(*f"{node.module}.{alias.name}".split("."))
        is_module = submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()
        found.add(f"{node.module}.{alias.name}" if is_module else node.module)
  return {m for m in found if m.split(".")[0] == package}


def _import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """Module -> the modules of the package it imports, TYPE_CHECKING and function-level imports included."""
  graph = {}
  for path in sorted((root / package).rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    graph[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = _ltm_jax_imports(path, root, package)
  return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The import circles of a graph: each strongly connected set of two or more modules (or a module importing
  itself), sorted."""
  order, low, stack, on_stack, circles = {}, {}, [], set(), []

  def visit(v):
    order[v] = low[v] = len(order)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v] & graph.keys()):
      if w not in order:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], order[w])
    if low[v] == order[v]:
      component = []
      while not component or component[-1] != v:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1 or v in graph[v]:
        circles.append(sorted(component))

  for v in sorted(graph):
    if v not in order:
      visit(v)
  return sorted(circles)


def test_ltm_jax_imports_run_down_the_layers():
  """errors <- ops <- layers <- mesh checks <- config <- model: config imports nothing of the model, training or
  parallel beyond the mesh checks, and nothing below imports from above, not even for a type annotation under
  `if TYPE_CHECKING:`. Importing the mesh checks runs ltm_jax/parallel/__init__.py first, whose names would import
  the model (and so the config being validated): it imports nothing when it loads."""
  reaching_up = {}
  for path in sorted((ROOT / "ltm_jax").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    above = sorted(m for m in _ltm_jax_imports(path) if _layer(m) > _layer(module))
    if above:
      reaching_up[module] = above
  assert not reaching_up
  assert not _ltm_jax_imports(ROOT / "ltm_jax" / "parallel" / "__init__.py")


def test_ltm_jax_has_no_import_circle():
  """No module of ltm_jax imports, through any chain of imports, a module that imports it: TYPE_CHECKING imports
  (which close a circle for a type checker and for a reader, though never at run time) and imports inside functions
  count."""
  graph = _import_graph(ROOT, "ltm_jax")
  assert len(graph) > 50 and graph["ltm_jax.config"]  # The graph is read: every module, with its imports.
  assert _circles(graph) == []


def test_a_type_checking_import_that_closes_a_circle_is_found(tmp_path):
  """The circle check on a package where `low` imports `high` for an annotation only and `high` imports `low`."""
  package = tmp_path / "pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from pkg.high import Thing\n")
  (package / "high.py").write_text("from pkg import low\n\ndef f():\n  from pkg import other\n")
  (package / "other.py").write_text("")
  graph = _import_graph(tmp_path, "pkg")
  assert graph == {"pkg": set(), "pkg.low": {"pkg.high"}, "pkg.high": {"pkg.low", "pkg.other"}, "pkg.other": set()}
  assert _circles(graph) == [["pkg.high", "pkg.low"]]
  (package / "low.py").write_text("")
  assert _circles(_import_graph(tmp_path, "pkg")) == []
