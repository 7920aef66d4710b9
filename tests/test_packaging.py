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


def _ltm_jax_imports(path: pathlib.Path) -> set[str]:
  """The ltm_jax modules a file imports when it runs (`from a import b` counts as a.b where b is a module); imports
  under `if TYPE_CHECKING:` never run and are left out."""
  tree = ast.parse(path.read_text(), str(path))
  typing_only = {id(inner) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for statement in node.body for inner in ast.walk(statement)}
  found = set()
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      for alias in node.names:
        submodule = ROOT.joinpath(*f"{node.module}.{alias.name}".split("."))
        is_module = submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()
        found.add(f"{node.module}.{alias.name}" if is_module else node.module)
  return {m for m in found if m.split(".")[0] == "ltm_jax"}


def test_ltm_jax_imports_run_down_the_layers():
  """errors <- ops <- layers <- mesh checks <- config <- model: config imports nothing of the model, training or
  parallel beyond the mesh checks. Importing the mesh checks runs ltm_jax/parallel/__init__.py first, whose names
  would import the model (and so the config being validated): it imports nothing when it loads."""
  reaching_up = {}
  for path in sorted((ROOT / "ltm_jax").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    above = sorted(m for m in _ltm_jax_imports(path) if _layer(m) > _layer(module))
    if above:
      reaching_up[module] = above
  assert not reaching_up
  assert not _ltm_jax_imports(ROOT / "ltm_jax" / "parallel" / "__init__.py")
