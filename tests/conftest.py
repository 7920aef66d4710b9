"""Shared fixtures: a micro configuration that compiles in seconds on 2 CPU cores."""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import numpy as np
import pytest

from ltm_jax.config import Config, DataConfig, LatentConfig, ModelConfig, TrainConfig, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Ops called outside a model get IEEE float32 matmuls too (a model sets model.matmul_precision itself): the float32
# tolerances against float64 references assume it, and on GPU XLA's default would be TF32.
jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache per test session, shared by the xdist workers and every subprocess the tests start
# (CLI runs, notebook kernels, simulated-device runs): they compile many identical programs (the micro model's train
# and decode steps), and on 2 cores compiling is most of the suite's time. A cache loaded program is the same
# executable, memory and cost analyses included. A cache the caller set is used as it is.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = "LTM_TEST_OWNS_COMPILATION_CACHE"


def pytest_configure(config):
  if _CACHE_ENV not in os.environ:  # The controller (or a lone process): workers inherit the environment.
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="ltm-jax-compile-cache-")
    os.environ[_OWN_CACHE] = os.environ[_CACHE_ENV]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
  jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))


def pytest_unconfigure(config):
  if os.environ.get(_OWN_CACHE) == os.environ.get(_CACHE_ENV) and "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(os.environ.pop(_OWN_CACHE), ignore_errors=True)


def aot_worker_output(tmp_path_factory, worker: pathlib.Path, name: str, *flags: str) -> dict:
  """The arrays `worker` (a script run by .venv-aot's Python, jax >= 0.11: Mosaic GPU interpret mode) saves with
  `worker *flags OUT.npz`, run once per test session on the CPU: the pytest-xdist workers share one directory, and
  the first to take its lock runs the worker while the others wait (a failed run leaves no file, so the next one
  tries again). Skips without .venv-aot."""
  if not (ROOT / ".venv-aot" / ".installed").exists():
    pytest.skip("needs .venv-aot (jax >= 0.11 for Mosaic GPU interpret mode; `make gpu-aot` builds it)")
  root = tmp_path_factory.getbasetemp()
  root = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root
  path = root / f"{name}.npz"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      partial = root / f"{name}.partial.npz"
      proc = subprocess.run([str(ROOT / ".venv-aot" / "bin" / "python"), str(worker), *flags, str(partial)],
                            cwd=ROOT, env=cpu_only_env(), capture_output=True, text=True, timeout=600)
      assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
      os.replace(partial, path)
  with np.load(path) as saved:
    return dict(saved)


def resume_rtol() -> float:
  """The relative tolerance of a run resumed from a checkpoint, or trained in pieces, against the uninterrupted run.

  Same program, same inputs, same device: on the CPU only a different compilation could differ (1e-6). On a GPU the
  same program is not bitwise reproducible between runs (XLA's GPU reductions may use atomics, and each compilation
  autotunes its own cuBLAS/Triton configurations): 60 steps of tests/train/test_loop.py's model drifted by up to 1e-5
  relative in grad_norm between uninterrupted runs on an H200 (1e-4). A function, so that importing conftest (the
  xdist controller, subprocesses) starts no backend."""
  return 1e-6 if jax.default_backend() == "cpu" else 1e-4


def cpu_only_env(**extra: str) -> dict[str, str]:
  """os.environ for a subprocess that runs on the CPU on every host, plus `extra`: JAX_PLATFORMS=cpu starts no GPU
  backend in jax, and CUDA_VISIBLE_DEVICES="" hides the GPUs from anything else the process loads (torch, say).
  A CUDA plugin that is installed stays importable (ltm_pallas.backend.may_compile_for_gpu() is still true)."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "", **extra}


def random_model_params(model, tokens, seed: int):
  """Every parameter of flax `model` (initialised on `tokens`) drawn from N(0, 0.3^2): no zero-initialised projection
  hides a path."""
  import flax.linen as nn
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jax.numpy.asarray(rng.normal(0, 0.3, x.shape), x.dtype), nn.meta.unbox(shapes))


def logits_and_gradients(model, tokens, params):
  """(logits, the gradients of sum(sin(logits)) in every parameter) of the LM `model`, jitted."""

  def loss(params):
    logits = model.apply(params, tokens)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return jax.numpy.sum(jax.numpy.sin(logits)), logits

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, grads


def assert_gradients_close(got, expected, rtol: float) -> None:
  """Two gradient trees of the same structure agree leaf by leaf within rtol of each expected leaf's largest
  magnitude, and every expected leaf is far from zero (a parameter the loss does not reach would pass vacuously)."""
  import numpy as np
  expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
  got_leaves = jax.tree.leaves(got)
  assert len(expected_leaves) == len(got_leaves)
  for (path, want), have in zip(expected_leaves, got_leaves):
    name = jax.tree_util.keystr(path)
    scale = np.abs(np.asarray(want)).max()
    assert scale > 1e-3, name
    np.testing.assert_allclose(have, want, rtol=0, atol=rtol * scale, err_msg=name)


@pytest.fixture
def cuda_lowering():
  """Skips a test that lowers Pallas Triton kernels for "cuda" where this process cannot. jax 0.10 lowers them
  without a GPU; from jax 0.11 the lowering asks for the target GPU, a device or an abstract mesh of a CUDA topology
  (which needs the CUDA plugin: benchmarks/gpu_aot.py's deviceless compile), so on a CPU-only jax 0.11 it cannot."""
  if jax.__version_info__ >= (0, 11):
    try:
      jax.devices("gpu")
    except RuntimeError:
      pytest.skip(f"jax {jax.__version__} lowers Pallas Triton kernels only for a GPU it can see; this host has none")


# Tests that take 40 s or more (subprocesses, notebooks, 8 simulated devices) start first: xdist hands out tests in
# collection order, and one of these starting last leaves the other worker idle for its whole run.
_LONG_FIRST = ("tests/test_notebooks.py::test_notebook_runs[02", "tests/test_gpu_aot.py::test_kernels_compile",
               "tests/ops/test_attention_tokamax.py::test_kernels_compile_for_sm90a",
               "tests/parallel/test_mesh.py::test_meshes_match", "tests/test_notebooks.py::test_notebook_runs[01",
               "tests/parallel/test_multiprocess.py", "tests/test_latent.py::test_decoder_gradient",
               "tests/test_latent_training.py::test_iterates_gradient", "tests/test_gpu_sweep.py",
               "tests/test_remat_scan.py::test_scanned_layers", "tests/test_latent.py::test_inner_loop_is_the_same",
               "tests/parallel/test_mesh.py::test_kernels_init")


def pytest_collection_modifyitems(config, items):
  rank = lambda item: next((i for i, prefix in enumerate(_LONG_FIRST) if item.nodeid.startswith(prefix)),
                           len(_LONG_FIRST))
  items.sort(key=rank)  # Stable: the rest keep their order.


# Every program XLA compiles for the CPU keeps its machine code in three memory mappings of its own (code, read-only
# data, data) for as long as jax caches the executable, and a worker compiles thousands: unbounded, one of the two held
# 63,000 mappings at 87% of the suite. Linux refuses a process more than vm.max_map_count (65,530 by default), and XLA's
# LLVM then kills the process (docs/testing.md: it died linking a program for the persistent cache). Past half the
# limit, checked after each test module (reading the mappings takes tens of milliseconds; a worker added at most 7,600
# in a minute), the worker drops jax's caches: programs still in use are compiled again, most of them read back from the
# persistent cache.
_MAPS = pathlib.Path("/proc/self/maps")
_MAX_MAP_COUNT = pathlib.Path("/proc/sys/vm/max_map_count")
_MAPS_BOUND = (int(_MAX_MAP_COUNT.read_text()) if _MAX_MAP_COUNT.exists() else 65530) // 2


@pytest.fixture(scope="module", autouse=True)
def _bounded_memory_mappings():
  yield
  if _MAPS.exists():
    with _MAPS.open("rb") as maps:
      count = sum(1 for _ in maps)
    if count > _MAPS_BOUND:
      jax.clear_caches()
      gc.collect()


# A test whose xdist worker dies (a C++ abort, no Python exception) runs once more in a fresh worker, and fails only
# if that one dies too: a last resort for a crash the bound above does not prevent. Only crashes are retried: a
# failed assertion is reported at once, as always. pytest-rerunfailures can rerun crashes too, but its --reruns
# applies to every failure and its error filters cannot select crashes, which have no exception to match.
_RETRIED_CRASHES = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  if crashitem in _RETRIED_CRASHES:
    return
  _RETRIED_CRASHES.add(crashitem)
  sched.mark_test_pending(crashitem)
  report.outcome = "rerun"  # Not "failed": the session's failure count is untouched, the retry decides.


def pytest_report_teststatus(report, config):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


# On the CPU every test process compiles without XLA's expensive backend passes (jax_disable_most_optimizations: LLVM
# at -O0; the HLO passes, and so fusion, buffer assignment and cost analysis, are unchanged), and so do the processes
# the tests start (CLI runs, notebook kernels, the .venv-aot workers), through the environment. On 2 cores compiling
# is most of the suite's time; the numerics tests compare values with stated tolerances, which LLVM's optimisation
# does not move past. One mode for the whole session: every program a test compares is compiled alike, and programs
# stay cached across tests. Tests whose subject is the optimised build (register counts and spills of a deviceless
# GPU compile) or whose time is running programs rather than compiling them opt out with
# @pytest.mark.optimized_compile. A GPU host compiles as users do.
_FAST_COMPILE_ENV = "JAX_DISABLE_MOST_OPTIMIZATIONS"


@pytest.fixture(scope="session", autouse=True)
def _compile_mode():
  if jax.default_backend() == "cpu" and _FAST_COMPILE_ENV not in os.environ:
    os.environ[_FAST_COMPILE_ENV] = "1"
    jax.config.update("jax_disable_most_optimizations", True)
  yield


@pytest.fixture(autouse=True)
def _optimized_compile(request, monkeypatch):
  """Full XLA optimisation for a test marked optimized_compile, in this process and the ones it starts."""
  if request.node.get_closest_marker("optimized_compile") is None or not jax.config.read(
      "jax_disable_most_optimizations"):
    yield
    return
  monkeypatch.delenv(_FAST_COMPILE_ENV, raising=False)
  # The flag is not part of jit's cache key: without clearing, programs compiled in one mode would serve the other.
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)
    jax.clear_caches()


# Latents in every block, fitted from the prior-like start on whole rows: the form that the tests of the inner loop,
# the decoder objectives and the model's plumbing are written against, whatever LatentConfig's defaults are.
CLASSIC_LATENT = dict(enabled=True, top_layers=None, encoder=False, continuation_fraction=0.0)
CLASSIC_OVERRIDES = ["latent.enabled=true", "latent.top_layers=null", "latent.encoder=false",
                     "latent.continuation_fraction=0"]


def classic_latent(**fields) -> LatentConfig:
  return LatentConfig(**{**CLASSIC_LATENT, **fields})


def micro_config(**model_overrides) -> Config:
  """A 2-layer hybrid (RWKV-4 + attention) with d_model 32 and short sequences."""
  model = dataclasses.replace(
      ModelConfig(d_model=32, n_layers=2, n_heads=4, layer_pattern="RA", max_seq_len=128), **model_overrides)
  train = TrainConfig(steps=12, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=2,
                      checkpoint_every=6, log_every=3, async_checkpoint=True)
  return validate(Config(name="micro", model=model, data=DataConfig(worker_threads=1, prefetch=2), train=train))


@pytest.fixture
def micro() -> Config:
  return micro_config()
