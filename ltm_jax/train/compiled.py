"""The memory of the real train step as XLA compiles it for this machine's backend (`ltm info --compile`)."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from ltm_jax import model as model_lib
from ltm_jax import state as state_lib
from ltm_jax.config import Config
from ltm_jax.train.optimizer import learning_rate, make_optimizer
from ltm_jax.train.step import make_train_step


def compiled_memory(cfg: Config) -> dict[str, Any]:
  """Compiles the real train step (ltm_jax.train.step, one device, no mesh) for abstract inputs of the config's
  shapes (train.batch_size x train.seq_len, grad_accum micro-batches, the latent inner loop if enabled) and returns
  XLA's memory analysis of it; nothing is allocated or run.

  compiled_temp_bytes: scratch the step needs beyond its inputs and outputs (activations kept for the backward pass,
  gradients, optimizer temporaries): what the remat policies change. argument/output bytes: the train state and batch
  in, the new state and metrics out; alias bytes: outputs written over donated inputs (the state).

  On CPU, XLA's default (concurrency-optimised) scheduler runs the recomputation of unscanned remat blocks early, so
  their temp bytes barely move; XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false schedules for
  memory, as GPU compilers do (benchmarks/memory.py sets it). Scanned layers show the saving under either."""
  m, t = cfg.model, cfg.train
  optimizer = make_optimizer(t)
  state = state_lib.abstract_train_state(cfg, optimizer)
  batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32) for k in ("inputs", "targets")}
  step = make_train_step(model_lib.LM(m, cfg.latent), optimizer, learning_rate(t), t.grad_accum)
  jax.devices()  # Starts the backend outside the timing.
  started = time.perf_counter()
  lowered = step.lower(state, batch)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  finished = time.perf_counter()
  analysis = compiled.memory_analysis()
  if analysis is None:
    raise ValueError(f"the {jax.default_backend()} backend gives no memory analysis of compiled code")
  out = {
      "compiled_temp_bytes": int(analysis.temp_size_in_bytes),
      "compiled_argument_bytes": int(analysis.argument_size_in_bytes),
      "compiled_output_bytes": int(analysis.output_size_in_bytes),
      "compiled_alias_bytes": int(analysis.alias_size_in_bytes),
      "lower_seconds": round(lowered_at - started, 3),
      "compile_seconds": round(finished - lowered_at, 3),
      "compiled_for": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
      "remat": m.remat,
      "scan_layers": m.scan_layers,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  # Live at the peak at most: inputs, outputs not written over inputs, and the scratch.
  out["compiled_total_bytes"] = (out["compiled_argument_bytes"] + out["compiled_output_bytes"]
                                 - out["compiled_alias_bytes"] + out["compiled_temp_bytes"])
  return out
