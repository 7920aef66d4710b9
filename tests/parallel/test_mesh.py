"""Sharded training on 8 simulated CPU devices, each check in a fresh interpreter (eight_devices.py), plus the
one-line errors for meshes that cannot work (in this process: they need no devices)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh

from ltm_jax import config as config_lib
from ltm_jax import parallel
from ltm_jax.errors import ConfigError
from ltm_jax.train.optimizer import make_optimizer

from conftest import micro_config

HERE = pathlib.Path(__file__).resolve().parent


def run_checks(*checks: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run([sys.executable, str(HERE / "eight_devices.py"), *checks], capture_output=True, text=True,
                        env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.long
def test_meshes_match_one_device():
  """One train step (grad_accum 2, RWKV-4 + attention, vocabulary 1000, the loss in chunks of 8 positions) on data=8,
  fsdp=8, tensor=4 x data=2 and 2x2x2 meshes.

  Tolerances: loss 1e-5 relative; gradients 1e-6 absolute (their largest entry is ~3e-2, float32 sums reassociated
  across shards); parameters after the AdamW step 5e-5 absolute (Adam divides by sqrt(v), so reassociation in
  near-zero gradients moves an update by up to a fraction of the learning rate, 1.5e-3 here)."""
  result = run_checks("equivalence:data,fsdp,tensor,mixed")["equivalence"]
  assert result["grad_scale"] > 1e-3  # The gradients compared are not vanishing.
  expected_q_shard = {"data": [32, 4, 8], "fsdp": [4, 4, 8], "tensor": [32, 1, 8], "mixed": [16, 2, 8]}
  expected_mu_shard = {"data": [32, 128], "fsdp": [4, 128], "tensor": [32, 32], "mixed": [16, 64]}
  for name in ("data", "fsdp", "tensor", "mixed"):
    r = result[name]
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), (name, r["loss"], r["ref_loss"])
    assert r["grad_diff"] <= 1e-6, (name, r["grad_diff"])
    assert r["param_diff"] <= 5e-5, (name, r["param_diff"])
    # Parameters and Adam moments really are split: attention q [embed, heads, head_dim] over fsdp x tensor, the
    # channel-mix key [embed, mlp] moment likewise.
    assert r["q_shape"] == [32, 4, 8] and r["q_shard"] == expected_q_shard[name], (name, r["q_shard"])
    assert r["mu_shape"] == [32, 128] and r["mu_shard"] == expected_mu_shard[name], (name, r["mu_shard"])
  # No activation ([micro-batch, seq, ...]) is gathered where parameters are not split over the batch's axes. With
  # FSDP (fsdp splits both the batch and the parameters' embed axis), XLA still gathers some activations until the
  # model constrains its residual stream to ("batch", "length", "embed"): see the parallel notes.
  for name in ("data", "tensor"):
    assert result[name]["activation_gathers"] == [], (name, result[name]["activation_gathers"])
  for name in ("fsdp", "tensor", "mixed"):
    # The micro-batch loop keeps every split parameter's gradient sum in its shard: no collective in the compiled
    # loop yields a whole copy of a split parameter (a replicated accumulator gathers every micro-batch's gradient).
    acc = result[name]["accumulation"]
    assert acc["split_params"] > 0 and acc["shards_in_carry"], (name, acc)
    assert acc["whole_split_params"] == [], (name, acc["whole_split_params"])
    # Vocabulary 1000 padded to 1024 and split over tensor = 4 and 2 (tensor, mixed): the loss masks the padded
    # columns, so no array is ever cut to the 1000 real columns (which would split unevenly).
    assert result[name]["vocab_shapes"] == [], (name, result[name]["vocab_shapes"])


@pytest.mark.long
def test_kernels_init_and_checkpoints_across_meshes(tmp_path):
  result = run_checks("kernels_under_mesh", "init_matches", f"checkpoint_across_meshes:{tmp_path / 'run'}",
                      "scanned_latent_remat", "memory_mixers", "strict_short_validation")
  # The feed-forward op's kernel path runs per shard with its weights whole: same values and gradients (the weights'
  # summed over the shards); it gathers the weights, not the activations.
  assert result["kernels_under_mesh"].pop("ffn")["diff"] <= 1e-4
  for op, r in result["kernels_under_mesh"].items():
    # Pallas kernels (interpreted) run per shard under the 2x2x2 mesh: same value and gradients as one device, and
    # no all-gather at all in the compiled forward + backward; without the shard_map hook XLA gathers their inputs.
    assert r["diff"] <= 1e-4, (op, r["diff"])
    assert r["all_gathers"] == 0, (op, r)
  # The check can fail: without the hook, XLA gathers the kernel's inputs (shown once, for WKV-4).
  assert result["kernels_under_mesh"]["wkv4"]["all_gathers_without_hook"] > 0
  init = result["init_matches"]
  assert init["diff"] == 0.0 or init["diff"] < 1e-7, init["diff"]
  assert init["specs"]["['block_1']['mixer']['q']['kernel']"] == "P('fsdp', 'tensor', None)"
  assert init["specs"]["['block_1']['mixer']['out']['kernel']"] == "P('tensor', None, 'fsdp')"
  assert init["specs"]["['embed']['embedding']"] == "P('tensor', 'fsdp')"
  assert init["specs"]["['block_0']['mixer_norm']['scale']"] == "P(None,)"
  for name in ("tensor", "mixed"):  # Written under fsdp=8, read under other meshes, exact.
    r = result["checkpoint_across_meshes"][name]
    assert r["diff"] == 0.0 and r["shardings_match"], (name, r)
  # A scanned latent model with the WKV-4 kernel under remat=full traces on the mesh (jax's dead-code elimination of
  # the kernel's remat-optimised VJP failed there) and trains as on one device (measured 1.1e-8 of 0.02).
  r = result["scanned_latent_remat"]
  assert abs(r["loss"] - r["ref_loss"]) < 1e-5 and r["grad_diff"] < 1e-5 * max(r["grad_scale"], 1e-3), r
  # MM-Rec and Titans layers on the 2x2x2 mesh (measured 4e-9 of 1e-2; XLA's partitioning of MM-Rec's recurrence
  # alone was off by 2.5e-3).
  r = result["memory_mixers"]
  assert abs(r["loss"] - r["ref_loss"]) < 1e-5 and r["grad_diff"] < 1e-5 * max(r["grad_scale"], 1e-3), r
  # A validation batch of 5 rows on data=8: replicated on purpose, which mesh.strict refuses before training; a mesh
  # whose batch axes are all 1 splits no batch and refuses nothing.
  r = result["strict_short_validation"]
  assert r["data8_lenient"] is None and r["tensor8"] is None, r
  assert r["data8"].startswith("the validation split makes a batch of 5 rows, which the mesh's batch axes (8 ways) "
                               "do not divide"), r


# ------------------------------------------------------------------------------------------------------ bad input


def _mesh(data=1, fsdp=1, tensor=1):
  return AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


@pytest.mark.parametrize("sizes, devices, message", [
    ((2, 2, 2), 4, "multiply to 8, but there are 4 devices"),
    ((-1, 3, 1), 8, "cannot fill 8 devices: 3 does not divide 8"),
])
def test_mesh_sizes_must_fit_the_devices(sizes, devices, message):
  cfg = micro_config()
  cfg = config_lib.apply_overrides(cfg, [f"mesh.{a}={s}" for a, s in zip(("data", "fsdp", "tensor"), sizes)])
  with pytest.raises(ConfigError, match=message):
    parallel.resolve_sizes(cfg, devices)


def test_mesh_fills_the_remaining_devices():
  cfg = config_lib.apply_overrides(micro_config(), ["mesh.data=-1", "mesh.tensor=2"])
  assert parallel.resolve_sizes(cfg, 8) == {"pipeline": 1, "data": 4, "fsdp": 1, "tensor": 2}


def test_make_mesh_refuses_before_compiling():
  n = jax.device_count()  # 1 on a CPU or a one-GPU host; twice as many asked for, whatever it is.
  cfg = config_lib.apply_overrides(micro_config(), [f"mesh.data={2 * n}", f"train.batch_size={4 * n}"])
  with pytest.raises(ConfigError, match=f"multiply to {2 * n}, but there are {n} devices"):
    parallel.make_layout(cfg, make_optimizer(cfg.train))


@pytest.mark.parametrize("overrides, message", [
    (["mesh.tensor=3"], r"model.n_heads=4 is not divisible by the mesh size tensor=3"),
    (["model.n_heads=8", "model.n_kv_heads=2", "mesh.tensor=4"], r"key/value heads 2 is not divisible by .*tensor=4"),
    (["model.mlp_dim=100", "mesh.tensor=8", "model.n_heads=8"], r"FFN width 100 is not divisible by .*tensor=8"),
    (["model.layer_pattern=W", "model.rwkv7_head_size=8", "mesh.tensor=8"], r"RWKV-7 heads .*=4 is not divisible"),
    (["mesh.fsdp=3", "mesh.data=1", "train.batch_size=12"], r"model.d_model=32 is not divisible by .*fsdp=3"),
    (["mesh.data=8"], r"micro-batch\) is not divisible by the mesh size data=8\*fsdp=1"),
    (["mesh.fsdp=8", "mesh.data=1", "mesh.batch=data", "mesh.length=fsdp", "train.seq_len=12", "model.d_model=64"],
     r"train.seq_len=12 is not divisible by the mesh size fsdp=8 it is split over \(mesh.length=fsdp\)"),
    (["mesh.data=2", "mesh.fsdp=-1", "mesh.tensor=-1"], "at most one mesh size may be -1"),
    (["mesh.tensor=0"], r"mesh.tensor must be >= 1 or -1"),
    (["mesh.heads=tensr"], "names unknown mesh axis 'tensr'"),
    (["mesh.batch=data,data"], "names a mesh axis twice"),
])
def test_bad_mesh_configs(overrides, message):
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(config_lib.apply_overrides(micro_config(), overrides))


def test_parameter_axis_without_rule_and_undivided_parameter():
  cfg = micro_config()
  rules = tuple(rule for rule in cfg.mesh.rules() if rule[0] != "mlp")
  with pytest.raises(ConfigError, match=r"parameter block_0/ffn/key/kernel has logical axis 'mlp' with no mesh rule"):
    parallel.param_specs(cfg, _mesh(), rules)
  # The generic per-parameter check, here on the norm scales [norm=32] that cannot split 3 ways.
  rules = tuple((name, "tensor" if name == "norm" else None) for name, _ in cfg.mesh.rules())
  with pytest.raises(ConfigError, match=r"parameter .*norm.*scale \(32,\) has a dimension of 32 that the mesh "
                                         r"axes tensor=3 do not divide"):
    parallel.param_specs(cfg, _mesh(tensor=3), rules)


def test_single_device_layout_is_trivial():
  if jax.device_count() != 1:  # The default mesh fills every device of the process.
    pytest.skip(f"needs a process with one device (a CPU, or a host with one GPU); this one has {jax.device_count()}")
  cfg = micro_config()
  layout = parallel.make_layout(cfg, make_optimizer(cfg.train))
  assert layout.mesh.size == jax.device_count() == 1
  assert parallel.sharded_if_multi_device(layout) is None


def test_the_config_has_every_member_the_mesh_checks_read():
  """The mesh checks read a config through protocols (they import nothing of ltm_jax.config): every member those
  name is a field, property or method of the config's sections."""
  from ltm_jax.parallel import mesh_checks  # pylint: disable=g-import-not-at-top
  cfg = micro_config()
  sections = {mesh_checks.MeshedConfig: cfg, mesh_checks.MeshSection: cfg.mesh, mesh_checks.ModelSection: cfg.model,
              mesh_checks.TrainSection: cfg.train, mesh_checks.LatentSection: cfg.latent}
  for protocol, section in sections.items():
    members = [name for name in vars(protocol) if not name.startswith("_")]
    assert members and not [name for name in members if not hasattr(section, name)], (protocol, members)
