"""The suite's compile mode (tests/conftest.py): on the CPU without XLA's expensive backend passes, in the test
processes and the ones they start; full optimisation for tests marked optimized_compile."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from conftest import _FAST_COMPILE_ENV, cpu_only_env

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="a GPU host compiles every test optimised"),
    pytest.mark.skipif(_FAST_COMPILE_ENV in os.environ, reason="the caller's environment sets the mode"),
]

READ_FLAG = "import jax; print(jax.config.read('jax_disable_most_optimizations'))"


def _started_process_flag() -> str:
  proc = subprocess.run([sys.executable, "-c", READ_FLAG], env=cpu_only_env(), capture_output=True, text=True,
                        timeout=120, check=True)
  return proc.stdout.strip()


def test_tests_and_the_processes_they_start_skip_the_expensive_passes():
  assert jax.config.read("jax_disable_most_optimizations")
  assert _started_process_flag() == "True"


@pytest.mark.optimized_compile
def test_a_marked_test_and_its_processes_compile_fully_optimised():
  assert not jax.config.read("jax_disable_most_optimizations")
  assert _FAST_COMPILE_ENV not in os.environ
  assert _started_process_flag() == "False"
