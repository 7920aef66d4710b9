"""`ltm train` keeps its compiled programs in JAX's persistent compilation cache: a second run of the same programs
loads every one of them instead of compiling it."""

from __future__ import annotations

import subprocess
import sys

import jax

from conftest import ROOT, cpu_only_env
from ltm_jax import compilation_cache

TINY = str(ROOT / "configs" / "tiny.py")
SMALL = ["model.d_model=32", "model.n_layers=2", "train.steps=2", "train.batch_size=2", "train.seq_len=32",
         "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2", "train.log_every=1",
         "data.worker_threads=1"]


def _train(workdir, env, *flags, overrides=()) -> None:
  done = subprocess.run([sys.executable, "-m", "ltm_jax", "train", "--config", TINY, "--workdir", str(workdir),
                         *flags, *SMALL, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr


def test_ltm_train_reuses_its_compiled_programs_from_the_user_cache_folder(tmp_path):
  env = cpu_only_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # The test session's own cache would take precedence.
  folder = tmp_path / "xdg" / "ltm_jax" / "jax-compilation-cache"
  _train(tmp_path / "first", env)
  entries = sorted(p.name for p in folder.iterdir())
  assert entries  # The train step, the evaluation and the small programs around them.
  _train(tmp_path / "second", env)
  assert sorted(p.name for p in folder.iterdir()) == entries  # Every program was found: nothing new was written.


def test_the_cache_folder_is_chosen_in_this_order(tmp_path, monkeypatch):
  """--compilation-cache DIR, else the folder JAX already has (JAX_COMPILATION_CACHE_DIR), else the user cache
  folder; "none" turns the cache off."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.default_folder() == tmp_path / "ltm_jax" / "jax-compilation-cache"
  previous = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_enable_compilation_cache")}
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert compilation_cache.use(None) == str(tmp_path / "ltm_jax" / "jax-compilation-cache")
    assert compilation_cache.use(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert compilation_cache.use(None) == str(tmp_path / "mine")
    assert compilation_cache.use("none") is None and not jax.config.jax_enable_compilation_cache
    assert compilation_cache.use(None) is None and not jax.config.jax_enable_compilation_cache  # Off stays off.
    assert compilation_cache.use(str(tmp_path / "again")) == str(tmp_path / "again")  # Unless a folder is named.
    assert jax.config.jax_enable_compilation_cache
  finally:
    for key, value in previous.items():
      jax.config.update(key, value)
