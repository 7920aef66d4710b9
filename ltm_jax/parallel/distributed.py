"""Multi-process start-up: `jax.distributed.initialize` from flags, LTM_* variables or a SLURM allocation."""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax

from ltm_jax.errors import ConfigError

_started = False


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, env: Mapping[str, str] | None = None) -> dict | None:
  """The arguments for `jax.distributed.initialize`, or None for a single-process run.

  Precedence: explicit arguments (the `ltm train` flags), then LTM_COORDINATOR_ADDRESS / LTM_NUM_PROCESSES /
  LTM_PROCESS_ID, then a SLURM job step of more than one task (SLURM_NTASKS > 1), which jax detects itself (an empty
  dict: coordinator = the first node of the step, process id = SLURM_PROCID). ConfigError on incomplete settings."""
  env = os.environ if env is None else env
  address = coordinator_address or env.get("LTM_COORDINATOR_ADDRESS")
  count = num_processes if num_processes is not None else _int(env, "LTM_NUM_PROCESSES")
  index = process_id if process_id is not None else _int(env, "LTM_PROCESS_ID")
  if address is None and count is None and index is None:
    if (_int(env, "SLURM_NTASKS") or 1) > 1 and "SLURM_PROCID" in env:
      return {}
    return None
  if address is None or count is None or index is None:
    raise ConfigError("multi-process training needs all three of --coordinator-address (host:port), "
                      "--num-processes and --process-id (or LTM_COORDINATOR_ADDRESS, LTM_NUM_PROCESSES, "
                      f"LTM_PROCESS_ID); got {address!r}, {count!r}, {index!r}")
  if count < 1 or not 0 <= index < count:
    raise ConfigError(f"process id {index} must be in [0, {count}) for {count} processes")
  if count == 1:
    return None
  return {"coordinator_address": address, "num_processes": count, "process_id": index}


def _int(env: Mapping[str, str], name: str) -> int | None:
  if name not in env:
    return None
  try:
    return int(env[name])
  except ValueError:
    raise ConfigError(f"{name}={env[name]!r} is not an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Joins the process group when the settings ask for several processes; must run before anything touches a jax
  device. Returns whether this is a multi-process run. CPU processes exchange collectives through gloo."""
  global _started
  kwargs = settings(coordinator_address, num_processes, process_id)
  if kwargs is None:
    return False
  if not _started:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    _started = True
  return True


def is_main_process() -> bool:
  """Process 0: the one that writes metrics, TensorBoard files, config.json and prints progress."""
  return jax.process_index() == 0
