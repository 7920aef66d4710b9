"""Pipeline parallelism: a stack of layers split into stages over the `pipeline` mesh axis, run on a GPipe schedule.

The stack's weights lead with a units axis [U, ...] sharded over `pipeline`, so stage s holds units s*L .. s*L+L-1
(L = U / S) and nothing else. The batch [B, ...] is split into M micro-batches. Every iteration of a loop of
M + S - 1, all S stages run at once, as one function vmapped over a leading stage axis that is sharded over
`pipeline` (so each device runs its own stage): stage s works on micro-batch i - s. Between iterations the stage
outputs rotate by one stage (a collective permute between neighbouring devices), stage 0 takes the next
micro-batch, and the last stage's output is the finished micro-batch i - S + 1. Stages whose micro-batch is out of
range (the bubble: S - 1 of the M + S - 1 iterations for each stage) compute on stale inputs whose results are
never read. The backward pass is the loop's autodiff: all forwards, then all backwards (GPipe). Sharding constraints
inside the stage function (the ops' per-shard kernels) get the stage axis through vmap's spmd_axis_name, so data,
FSDP and tensor sharding apply within each stage unchanged.

The result is the same function as running the U units in order over the whole batch (`reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

AXIS = "pipeline"  # The mesh axis of the stages.


def stages() -> int:
  """The number of pipeline stages of the active mesh (`jax.set_mesh`): its `pipeline` axis size, 1 without."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[AXIS])


def bubble_fraction(n_stages: int, micro_batches: int) -> float:
  """The fraction of a GPipe step each stage idles: (S - 1) / (M + S - 1) (0 for one stage)."""
  return (n_stages - 1) / (micro_batches + n_stages - 1)


def _constrain_stages(x: jax.Array) -> jax.Array:
  """x [S, rows, ...]: stages over `pipeline`, rows over the batch rule's mesh axes, the rest left to XLA (as is
  without a pipeline mesh)."""
  if stages() == 1:
    return x
  rules = nn.get_logical_axis_rules()
  batch = nn.logical_to_mesh_axes(("batch",), rules)[0] if rules else None
  spec = PartitionSpec(AXIS, batch, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 2)))
  return lax.with_sharding_constraint(x, spec)


def run(stage_fn: Callable[..., jax.Array], weights: Any, x: jax.Array, rows: Any, unit_rows: Any,
        n_stages: int, micro_batches: int) -> jax.Array:
  """The units of `weights` applied in order to x [B, ...], pipelined over `n_stages` stages and `micro_batches`.

  Args:
    stage_fn: (stage_weights [L, ...], x [b, ...], rows, unit_rows) -> x [b, ...]: one stage's L units on one
      micro-batch of b = B / micro_batches rows.
    weights: pytree, every leaf [U, ...], U divisible by n_stages.
    x: [B, ...], B divisible by micro_batches.
    rows: pytree of per-row inputs [B, ...] (None leaves allowed), given to a stage for its micro-batch's rows.
    unit_rows: pytree of per-unit, per-row inputs [U, B, ...] (None leaves allowed), given to a stage for its units
      and its micro-batch's rows ([L, b, ...]).
  Returns:
    [B, ...], as `reference` gives.
  """
  s, m = n_stages, micro_batches
  batch = x.shape[0]
  b = batch // m
  stage_weights = jax.tree.map(lambda w: w.reshape(s, w.shape[0] // s, *w.shape[1:]), weights)
  split = lambda a: a.reshape(m, b, *a.shape[1:])  # [B, ...] -> [M, b, ...]
  xs, rows = split(x), jax.tree.map(split, rows)
  # [U, B, ...] -> [S, L, M, b, ...]: a stage's units, every micro-batch's rows.
  unit_rows = jax.tree.map(lambda a: a.reshape(s, a.shape[0] // s, m, b, *a.shape[2:]), unit_rows)
  stage_ids = jnp.arange(s)
  run_stages = jax.vmap(stage_fn, spmd_axis_name=AXIS)

  def iteration(carry, i):
    shifted, outputs = carry
    micro = jnp.clip(i - stage_ids, 0, m - 1)  # [S]: the micro-batch each stage works on (clipped in the bubble).
    first = jnp.broadcast_to(xs[jnp.minimum(i, m - 1)], shifted.shape)
    inputs = jnp.where((stage_ids == 0).reshape(s, *([1] * (x.ndim))), first, shifted)
    stage_rows = jax.tree.map(lambda a: a[micro], rows)
    stage_unit_rows = jax.tree.map(lambda a: jax.vmap(lambda per_stage, j: per_stage[:, j])(a, micro), unit_rows)
    out = _constrain_stages(run_stages(stage_weights, _constrain_stages(inputs), stage_rows, stage_unit_rows))
    # The last stage finishes micro-batch i - S + 1; before the first is done this writes slot 0, overwritten later.
    outputs = lax.dynamic_update_index_in_dim(outputs, out[s - 1], jnp.maximum(i - (s - 1), 0), 0)
    # Stage k + 1 takes stage k's output: a rotation of the stage axis, a permute between neighbouring stages.
    return (jnp.concatenate([out[-1:], out[:-1]]), outputs), None

  shifted = jnp.zeros((s, b, *x.shape[1:]), x.dtype)
  (_, outputs), _ = lax.scan(iteration, (shifted, jnp.zeros_like(xs)), jnp.arange(m + s - 1))
  return outputs.reshape(batch, *x.shape[1:])


def reference(stage_fn: Callable[..., jax.Array], weights: Any, x: jax.Array, rows: Any, unit_rows: Any,
              n_stages: int) -> jax.Array:
  """What `run` computes, stage after stage over the whole batch: the plain form it is checked against."""
  for k in range(n_stages):
    part = lambda a: a.reshape(n_stages, a.shape[0] // n_stages, *a.shape[1:])[k]
    x = stage_fn(jax.tree.map(part, weights), x, rows, jax.tree.map(part, unit_rows))
  return x
