"""Pipeline parallelism: the GPipe schedule against running the stages in order (one device, float64), a pipelined
train step on 8 simulated devices against one device (pipeline_devices.py), checkpoints across stage counts, and
the one-line refusals of splits that cannot work."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax import config as config_lib
from ltm_jax.errors import ConfigError
from ltm_jax.info import model_info
from ltm_jax.parallel import pipeline
from ltm_jax.train.metrics import throughput

from conftest import micro_config

HERE = pathlib.Path(__file__).resolve().parent


def _stage(weights, x, rows, unit_rows):
  """L units of x <- tanh(x @ W_u + bias_u) * scale + shift_u: weights {"w": [L, d, d], "b": [L, d]}, x [b, d],
  rows = (scale [b, 1], None), unit_rows: shift [L, b, d]. Per-row and per-unit inputs reach the right rows."""
  scale, _ = rows

  def unit(x, per_unit):
    w, b, shift = per_unit
    return jnp.tanh(x @ w + b) * scale + shift, None

  return jax.lax.scan(unit, x, (weights["w"], weights["b"], unit_rows))[0]


@pytest.mark.parametrize("n_stages, micro_batches", [(2, 3), (4, 1)])
def test_schedule_matches_the_stages_in_order(n_stages, micro_batches):
  """Values and gradients (to weights, inputs and per-row inputs) in float64 against `reference`, which runs the
  stages one after the other on the whole batch; units per stage 2, rows 2 per micro-batch."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(n_stages * 10 + micro_batches)
    units, d, batch = 2 * n_stages, 5, 2 * micro_batches
    weights = {"w": jnp.asarray(rng.standard_normal((units, d, d)) / np.sqrt(d)),
               "b": jnp.asarray(rng.standard_normal((units, d)))}
    x = jnp.asarray(rng.standard_normal((batch, d)))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (batch, 1)))
    shift = jnp.asarray(rng.standard_normal((units, batch, d)))

    def loss(fn, weights, x, scale, shift):
      return jnp.sum(jnp.sin(fn(_stage, weights, x, (scale, None), shift)))

    run = lambda *a: pipeline.run(*a, n_stages, micro_batches)
    ref = lambda *a: pipeline.reference(*a, n_stages)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(run, *a), argnums=(0, 1, 2, 3)))(weights, x, scale, shift)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3)))(weights, x, scale, shift)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def _idle_fraction(n_stages: int, micro_batches: int) -> float:
  """The idle share of (stage, tick) slots in the schedule `pipeline.run` executes, counted slot by slot: it runs
  as many ticks as its scan has iterations (read from the traced program), and at tick t stage k works iff it holds
  a micro-batch, i.e. 0 <= t - k < M."""
  x = jnp.zeros((micro_batches, 1))
  traced = jax.make_jaxpr(lambda x: pipeline.run(lambda w, x, rows, unit_rows: x + w[0], jnp.ones((n_stages, 1)), x,
                                                 None, None, n_stages, micro_batches))(x)
  ticks = [eqn.params["length"] for eqn in traced.jaxpr.eqns if eqn.primitive.name == "scan"]
  assert len(ticks) == 1
  busy = sum(0 <= t - k < micro_batches for t in range(ticks[0]) for k in range(n_stages))
  return 1 - busy / (ticks[0] * n_stages)


@pytest.mark.parametrize("n_stages, micro_batches", [(1, 1), (1, 4), (2, 4), (4, 12), (3, 2)])
def test_bubble_fraction_is_the_idle_share_of_the_schedule_run_executes(n_stages, micro_batches):
  assert pipeline.bubble_fraction(n_stages, micro_batches) == pytest.approx(_idle_fraction(n_stages, micro_batches),
                                                                           abs=1e-12)


def test_bubble_and_info_report():
  cfg = config_lib.apply_overrides(micro_config(), ["model.n_layers=8", "model.scan_layers=true", "mesh.pipeline=2",
                                                    "mesh.data=1", "model.pipeline_micro_batches=4"])
  info = model_info(config_lib.validate(cfg))
  assert (info["pipeline_stages"], info["pipeline_units_per_stage"], info["pipeline_micro_batches"]) == (2, 2, 4)
  assert info["pipeline_bubble"] == pytest.approx(_idle_fraction(2, 4), abs=1e-12)
  # The logged MFU counts the bubble as lost time; the row also gives the MFU of the time outside it. By hand:
  # 2.5e15 FLOPs x 4 steps over 10 s on 8 devices is 125 TFLOP/s per device of an H100's 989 (dense bfloat16); 20%
  # of the 10 s idle leaves 8 s in which the same FLOPs ran.
  flops, steps, seconds, devices, peak, bubble = 2.5e15, 4, 10.0, 8, 989.0, 0.2
  row = throughput(flops, steps, seconds, devices, "NVIDIA H100 80GB HBM3", bubble=bubble)
  assert row["mfu"] == pytest.approx(flops * steps / (seconds * devices) / (peak * 1e12))
  assert row["pipeline_bubble"] == bubble
  assert row["mfu_outside_bubble"] == pytest.approx(flops * steps / ((1 - bubble) * seconds * devices) / (peak * 1e12))
  assert "pipeline_bubble" not in throughput(flops, steps, seconds, devices, "NVIDIA H100 80GB HBM3")


def _run_checks(*checks: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run([sys.executable, str(HERE / "pipeline_devices.py"), *checks], capture_output=True, text=True,
                        env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.long
def test_pipelined_step_matches_one_device_and_checkpoints_move_across_stage_counts(tmp_path):
  """One train step (grad_accum 2, four scanned attention layers) on 2 stages x data 2 x tensor 2 (2 pipeline
  micro-batches) and 4 stages x data 2 (4 micro-batches) against one device, with test_mesh.py's tolerances: loss
  1e-5 relative, gradients 1e-6 absolute, parameters after AdamW 5e-5 absolute. Then a state saved under 2 stages is
  read exactly under 4 stages and under none."""
  result = _run_checks("equivalence:p2_d2_t2,p4_d2", f"checkpoint_across_pipelines:{tmp_path / 'run'}")
  eq = result["equivalence"]
  assert eq["grad_scale"] > 1e-3
  expected_q_shard = {"p2_d2_t2": [2, 32, 2, 8], "p4_d2": [1, 32, 4, 8]}  # [units, embed, heads, head_dim]
  for name in ("p2_d2_t2", "p4_d2"):
    r = eq[name]
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (name, r)
    assert r["grad_diff"] <= 1e-6 and r["param_diff"] <= 5e-5, (name, r)
    # Each stage holds only its own units' weights (split further over tensor), and stages pass activations by
    # collective permutes.
    assert r["q_shape"] == [4, 32, 4, 8] and r["q_shard"] == expected_q_shard[name], (name, r["q_shard"])
    assert r["collective_permutes"] > 0, (name, r)
  moved = result["checkpoint_across_pipelines"]
  for name, q_shard in (("p4_d2", [1, 32, 4, 8]), ("p1_d8", [4, 32, 4, 8])):
    assert moved[name]["diff"] == 0.0 and moved[name]["shardings_match"], (name, moved[name])
    assert moved[name]["q_shard"] == q_shard, (name, moved[name])


@pytest.mark.parametrize("overrides, message", [
    (["mesh.pipeline=3", "model.n_layers=8"], r"model.n_layers=8 \(layer_pattern='RA'\) scans 4 units, which "
                                              r"mesh.pipeline=3 stages do not divide"),
    (["mesh.pipeline=2", "model.pipeline_micro_batches=3"], r"train.batch_size/train.grad_accum=4 is not divisible "
                                                            r"by model.pipeline_micro_batches=3"),
    (["mesh.pipeline=2", "model.pipeline_micro_batches=4", "mesh.data=2"],
     r"train.batch_size/train.grad_accum/model.pipeline_micro_batches=1 \(the pipeline micro-batch\) is not "
     r"divisible by the mesh size data=2"),
    (["mesh.pipeline=2", "model.scan_layers=false"], r"set model.scan_layers=true"),
    (["mesh.pipeline=2", "mesh.layers=none"], r"needs mesh.layers=pipeline"),
    (["model.pipeline_micro_batches=0"], r"model.pipeline_micro_batches must be >= 1"),
])
def test_bad_splits_are_refused_before_compiling(overrides, message):
  cfg = config_lib.apply_overrides(micro_config(), ["model.n_layers=4", "model.scan_layers=true", "mesh.data=1",
                                                    *overrides])
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(cfg)
