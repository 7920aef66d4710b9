"""Pipeline checks that need 8 devices, run as `python tests/parallel/pipeline_devices.py CHECK[:ARG] ...` by
test_pipeline.py (see eight_devices.py for why each runs in a fresh interpreter); prints one JSON object last."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conftest import micro_config  # noqa: E402
from eight_devices import _batch, _gradients, _max_diff  # noqa: E402

from ltm_jax import config as config_lib  # noqa: E402
from ltm_jax import model as model_lib  # noqa: E402
from ltm_jax import parallel  # noqa: E402
from ltm_jax.train import checkpoint as ckpt_lib  # noqa: E402
from ltm_jax.train.optimizer import make_optimizer  # noqa: E402
from ltm_jax.train.step import create_train_state  # noqa: E402

# (pipeline, data, fsdp, tensor) and pipeline micro-batches.
MESHES = {"p2_d2_t2": ((2, 2, 1, 2), 2), "p4_d2": ((4, 2, 1, 1), 4), "p2_f2_t2": ((2, 1, 2, 2), 2),
          "p1_d8": ((1, 8, 1, 1), 1)}


def _config(name: str):
  """Four scanned attention layers (four units: 2 or 4 stages), d_model 32, grad_accum 2 of 8 rows each."""
  sizes, micro = MESHES[name]
  cfg = micro_config(n_layers=4, layer_pattern="A", scan_layers=True, pipeline_micro_batches=micro)
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=16, seq_len=16, grad_accum=2))
  overrides = [f"mesh.{axis}={size}" for axis, size in zip(config_lib.MESH_AXES, sizes)]
  return config_lib.validate(config_lib.apply_overrides(cfg, overrides))


def equivalence(names: str):
  """Loss, gradients and updated parameters of one train step under each pipelined mesh against one device, and
  what the compiled step exchanges."""
  base = _config("p1_d8")
  optimizer = make_optimizer(base.train)
  host = jax.device_get(create_train_state(model_lib.init_params(base.model, jax.random.key(0)), optimizer, 0))
  batch = _batch(base)
  one = jax.devices()[0]
  ref_loss, ref_grads, ref_params, _, _ = _gradients(base, jax.device_put(host, one), jax.device_put(batch, one))
  out = {"grad_scale": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))}
  for name in names.split(","):
    cfg = _config(name)
    layout = parallel.make_layout(cfg, optimizer)
    state = jax.device_put(host, layout.state)
    loss, grads, params, hlo, new_state = _gradients(cfg, state, parallel.put_batch(batch, layout.batch), layout)
    q = new_state.params[model_lib.SCANNED]["block_0"]["mixer"]["q"]["kernel"]  # [units, embed, heads, head_dim]
    out[name] = {"loss": loss, "ref_loss": ref_loss, "grad_diff": _max_diff(grads, ref_grads),
                 "param_diff": _max_diff(params, ref_params), "q_shape": q.shape,
                 "q_shard": q.addressable_shards[0].data.shape,
                 "collective_permutes": hlo.count("collective-permute-start(") + hlo.count("collective-permute(")}
  return out


def checkpoint_across_pipelines(workdir: str):
  """A state saved under 2 stages, restored under 4 stages and under none."""
  save_cfg = _config("p2_d2_t2")
  optimizer = make_optimizer(save_cfg.train)
  rng = np.random.default_rng(1)
  host = create_train_state(model_lib.init_params(save_cfg.model, jax.random.key(3)), optimizer, 0)
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype)
                      if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x), jax.device_get(host))
  saver = ckpt_lib.Checkpointer(workdir, async_save=False)
  saver.save(5, jax.device_put(host, parallel.make_layout(save_cfg, optimizer).state), {"format": "test"}, save_cfg)
  saver.close()
  out = {}
  for name in ("p4_d2", "p1_d8"):
    cfg = _config(name)
    layout = parallel.make_layout(cfg, optimizer)
    reader = ckpt_lib.Checkpointer(workdir, read_only=True)
    restored, _ = reader.restore(5, parallel.abstract_state(cfg, optimizer, layout))
    reader.close()
    same = all(a.sharding == b for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(layout.state)))
    q = restored.params[model_lib.SCANNED]["block_0"]["mixer"]["q"]["kernel"]
    out[name] = {"diff": _max_diff(jax.device_get(restored), host), "shardings_match": same,
                 "q_shard": q.addressable_shards[0].data.shape}
  return out


if __name__ == "__main__":
  results = {}
  for item in sys.argv[1:]:
    check, _, arg = item.partition(":")
    results[check] = globals()[check](*([arg] if arg else []))
  print(json.dumps(results, default=lambda x: list(x) if isinstance(x, tuple) else str(x)))
