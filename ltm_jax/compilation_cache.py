"""JAX's persistent compilation cache for the commands that compile (`ltm train`): a restart loads the programs the
last run compiled instead of compiling them again. JAX keys every entry itself (the program, the jax and XLA
versions, the backend and device kind, the compile options and flags), so one folder serves every model, machine
kind and version: a program that differs in any of these is a miss, never a wrong hit."""

from __future__ import annotations

import os
import pathlib

import jax

OFF = "none"


def default_folder() -> pathlib.Path:
  """$XDG_CACHE_HOME/ltm_jax/jax-compilation-cache (~/.cache/... without XDG_CACHE_HOME)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "ltm_jax" / "jax-compilation-cache"


def use(folder: str | None) -> str | None:
  """Turns the cache on in `folder` ("none": off; None: the folder already set, e.g. by JAX_COMPILATION_CACHE_DIR,
  else `default_folder()`, unless the cache was turned off, e.g. by JAX_ENABLE_COMPILATION_CACHE=false) and returns
  the folder used (None when off). Call it before the first compilation: JAX sets its cache up once per process."""
  if folder == OFF:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if folder is None and not jax.config.jax_enable_compilation_cache:
    return None
  folder = folder or jax.config.jax_compilation_cache_dir or str(default_folder())
  jax.config.update("jax_enable_compilation_cache", True)  # A folder named explicitly is used, whatever was set.
  jax.config.update("jax_compilation_cache_dir", folder)
  return folder
