"""Checks that need 8 devices, run as `python tests/parallel/eight_devices.py CHECK [ARG]` by test_mesh.py.

XLA_FLAGS must give the CPU 8 devices before jax starts, which the pytest process (and its xdist workers) has already
done with 1; so every check runs in a fresh interpreter and prints one JSON object of measurements on its last line,
which the test asserts on.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import unittest.mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from conftest import CLASSIC_OVERRIDES, micro_config  # noqa: E402

from ltm_jax import config as config_lib  # noqa: E402
from ltm_jax import data as data_lib  # noqa: E402
from ltm_jax import model as model_lib  # noqa: E402
from ltm_jax import ops, parallel  # noqa: E402
from ltm_jax.ops import ffn as ffn_op  # noqa: E402
from ltm_jax.train import checkpoint as ckpt_lib  # noqa: E402
from ltm_jax.train.optimizer import learning_rate, make_optimizer  # noqa: E402
from ltm_jax.train.step import create_train_state, make_train_step, run_keys  # noqa: E402

MESHES = {"data": (8, 1, 1), "fsdp": (1, 8, 1), "tensor": (2, 1, 4), "mixed": (2, 2, 2)}


def _config(sizes, **model):
  # A vocabulary of 1000 (head padded to 1024, split over tensor; the padded columns masked in the loss, never sliced
  # off) and the loss in chunks of 8 positions, so the sharded steps run the chunked, masked cross-entropy.
  cfg = micro_config(**{"vocab_size": 1000, "loss_chunk": 8, **model})
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=16, seq_len=16, grad_accum=2))
  overrides = [f"mesh.{axis}={size}" for axis, size in zip(("data", "fsdp", "tensor"), sizes)]
  return config_lib.validate(config_lib.apply_overrides(cfg, overrides))


def _batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  return {"inputs": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
          "targets": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)}


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _gradients(cfg, state, batch, layout=None):
  """One train step at lr 0 of Adam's first moment: mu = (1 - b1) * grad, so the step exposes the gradients."""
  optimizer = make_optimizer(cfg.train)
  step = make_train_step(model_lib.LM(cfg.model, cfg.latent), optimizer, learning_rate(cfg.train),
                         cfg.train.grad_accum, layout)
  compiled = step.lower(state, batch).compile()  # Compiled once: run, and its HLO inspected.
  new_state, metrics = compiled(state, batch)
  mu = new_state.opt_state[1][0].mu  # chain(clip, adamw): adamw's scale_by_adam state.
  grads = jax.tree.map(lambda m: np.asarray(m) / (1 - cfg.train.b1), mu)
  return float(metrics["loss"]), grads, jax.device_get(new_state.params), compiled.as_text(), new_state


def equivalence(mesh_names: str):
  """Loss, gradients and updated parameters of one train step on each mesh against one device."""
  out = {}
  base = _config((8, 1, 1))
  optimizer = make_optimizer(base.train)
  host_state = create_train_state(model_lib.init_params(base.model, jax.random.key(0), base.latent), optimizer, 0)
  host_state = jax.device_get(host_state)
  batch = _batch(base)
  one = jax.devices()[0]
  ref_loss, ref_grads, ref_params, _, _ = _gradients(base, jax.device_put(host_state, one),
                                                     jax.device_put(batch, one))
  out["grad_scale"] = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
  micro = base.train.batch_size // base.train.grad_accum
  for name in mesh_names.split(","):
    cfg = _config(MESHES[name])
    layout = parallel.make_layout(cfg, optimizer)
    state = jax.device_put(host_state, layout.state)
    loss, grads, params, hlo, new_state = _gradients(cfg, state, parallel.put_batch(batch, layout.batch), layout)
    q = new_state.params["block_1"]["mixer"]["q"]["kernel"]  # [embed, heads, head_dim]
    mu = new_state.opt_state[1][0].mu["block_0"]["ffn"]["key"]["kernel"]  # RWKV channel-mix [embed, mlp]
    out[name] = {"loss": loss, "ref_loss": ref_loss, "grad_diff": _max_diff(grads, ref_grads),
                 "param_diff": _max_diff(params, ref_params), "q_shape": q.shape,
                 "q_shard": q.addressable_shards[0].data.shape, "mu_shape": mu.shape,
                 "mu_shard": mu.addressable_shards[0].data.shape,
                 "activation_gathers": _activation_gathers(hlo, (micro, cfg.train.seq_len)),
                 "accumulation": _accumulation_loop(hlo, state.params, layout.state.params),
                 "vocab_shapes": _shapes_with_dim(hlo, cfg.model.vocab_size)}
  return out


_COLLECTIVE = re.compile(r"=\s*(\S+?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)"
                         r"(?:-start)?\(")


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = head.group(1)
      comps[name] = []
    elif line == "}":
      name = None
    elif name:
      comps[name].append(line)
  return comps


def _accumulation_loop(hlo: str, params, shardings) -> dict:
  """The compiled micro-batch loop (the step's outermost while): its collectives, and which of them produce a whole
  (unsplit) copy of a parameter that the layout splits, as a replicated gradient accumulator would."""
  split = {f"f32[{','.join(map(str, p.shape))}]" for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))
           if not s.is_fully_replicated}
  shards = [f"f32[{','.join(map(str, s.shard_shape(p.shape)))}]"
            for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)) if not s.is_fully_replicated]
  comps = _computations(hlo)
  loop = next(line for lines in comps.values() for line in lines
              if " while(" in line and 'op_name="jit(step)/while"' in line)
  body = comps[re.search(r"body=%(\S+?),", loop).group(1)]
  collectives = [(m.group(2), m.group(1).split("{")[0]) for m in map(_COLLECTIVE.search, body) if m]
  carry = [shape.split("{")[0] for shape in re.findall(r"[a-z0-9]+\[[0-9,]*\]\{?", loop.split(" while(")[0])]
  return {"collectives": len(collectives), "whole_split_params": [c for c in collectives if c[1] in split],
          "shards_in_carry": all(shard in carry for shard in shards), "split_params": len(shards),
          "step_collectives": len([m for m in map(_COLLECTIVE.search, hlo.splitlines()) if m])}


def _shapes_with_dim(hlo: str, dim: int) -> list[str]:
  """Array shapes in the compiled step with a dimension of `dim` (e.g. logits sliced to the unpadded vocabulary)."""
  return sorted({m.group(0) for m in re.finditer(rf"[a-z0-9]+\[(?:[0-9]+,)*{dim}(?:,[0-9]+)*\]", hlo)})


def _activation_gathers(hlo: str, leading: tuple[int, ...]) -> list[str]:
  """The all-gathers whose result starts with the activations' [micro-batch, seq_len] dimensions (sizes the test
  config gives no parameter): gathers of activations, as opposed to FSDP's gathers of parameters."""
  prefix = ",".join(map(str, leading)) + ","
  found = []
  for line in hlo.splitlines():
    if "all-gather(" in line or "all-gather-start(" in line:
      shape = re.search(r"=\s*\(?\s*[a-z0-9]+\[([0-9,]*)\]", line)
      if shape and (shape.group(1) + ",").startswith(prefix):
        found.append(line.strip()[:160])
  return found


def init_matches():
  """parallel.init_state (created in shards) equals create_train_state on one device."""
  cfg = _config(MESHES["mixed"])
  optimizer = make_optimizer(cfg.train)
  layout = parallel.make_layout(cfg, optimizer)
  sharded = parallel.init_state(cfg, optimizer, layout)
  ref = create_train_state(model_lib.init_params(cfg.model, run_keys(cfg.train.seed)[0], cfg.latent), optimizer,
                           cfg.train.seed)
  specs = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in
           jax.tree_util.tree_flatten_with_path(sharded.params)[0]}
  return {"diff": _max_diff(jax.device_get(sharded), jax.device_get(ref)), "specs": specs}


def checkpoint_across_meshes(workdir: str):
  """Saves a trained-looking state under the fsdp mesh and restores it under the tensor and mixed meshes."""
  save_cfg = _config(MESHES["fsdp"])
  optimizer = make_optimizer(save_cfg.train)
  rng = np.random.default_rng(1)
  host = create_train_state(model_lib.init_params(save_cfg.model, jax.random.key(3), save_cfg.latent), optimizer, 0)
  # Fresh random values everywhere (Adam moments are zeros at init): a restore that mixes up shards must show.
  host = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype)
                      if jnp.issubdtype(x.dtype, jnp.floating) else np.asarray(x), jax.device_get(host))
  layout = parallel.make_layout(save_cfg, optimizer)
  saver = ckpt_lib.Checkpointer(workdir, async_save=False)
  saver.save(5, jax.device_put(host, layout.state), {"format": "test"}, save_cfg)
  saver.close()
  out = {}
  for name in ("tensor", "mixed"):
    cfg = _config(MESHES[name])
    target_layout = parallel.make_layout(cfg, optimizer)
    reader = ckpt_lib.Checkpointer(workdir, read_only=True)
    restored, _ = reader.restore(5, parallel.abstract_state(cfg, optimizer, target_layout))
    reader.close()
    targets = jax.tree.leaves(target_layout.state)
    same_sharding = all(a.sharding == b for a, b in zip(jax.tree.leaves(restored), targets))
    out[name] = {"diff": _max_diff(jax.device_get(restored), host), "shardings_match": same_sharding}
  return out


def kernels_under_mesh():
  """The Pallas WKV-4, WKV-7 and attention kernels (interpreted on CPU) inside a 2x2x2 mesh: same values as one
  device, and no all-gather in the compiled forward + backward."""
  cfg = _config(MESHES["mixed"])
  layout = parallel.make_layout(cfg, make_optimizer(cfg.train))
  rng = np.random.default_rng(2)
  b, t, h, n = 4, 16, 4, 8
  bsh = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor"))
  bsh4 = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None))
  out = {}

  def check(name, fn, args, shardings, without_hook=False):
    def loss(*a):
      return sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(fn(*a)))
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    ref = grad(*args)
    placed = [jax.device_put(x, s) for x, s in zip(args, shardings)]
    with layout.activate():
      got = grad(*placed)
      hlo = grad.lower(*placed).compile().as_text()
    out[name] = {"diff": _max_diff(got, ref), "all_gathers": hlo.count("all-gather")}
    if without_hook:  # The mesh without the ops' rules: the hook is off and XLA partitions the kernel alone.
      with jax.set_mesh(layout.mesh):
        unwrapped = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))))).lower(*placed).compile()
      out[name]["all_gathers_without_hook"] = unwrapped.as_text().count("all-gather")

  k, v = (rng.standard_normal((b, t, h * n)).astype(np.float32) for _ in range(2))
  w, u = -np.exp(rng.standard_normal(h * n)).astype(np.float32), rng.standard_normal(h * n).astype(np.float32)
  cs = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec("tensor"))
  check("wkv4", lambda w, u, k, v: ops.wkv4(w, u, k, v, impl="pallas")[0], (w, u, k, v), (cs, cs, bsh, bsh),
        without_hook=True)
  r7 = [rng.standard_normal((b, t, h, n)).astype(np.float32) * 0.5 for _ in range(6)]
  r7[1] = -np.exp(r7[1])  # log-decay <= 0
  kk = r7[4] / np.linalg.norm(r7[4], axis=-1, keepdims=True)
  r7[4], r7[5] = -kk, kk * 0.5
  check("wkv7", lambda *a: ops.wkv7(*a, impl="pallas")[0], tuple(r7), (bsh4,) * 6)
  q, kq, vq = (rng.standard_normal((b, t, h, 16)).astype(np.float32) for _ in range(3))
  check("attention", lambda q, k, v: ops.attention(q, k, v, impl="pallas"), (q, kq, vq), (bsh4,) * 3)
  # The feed-forward op's kernel path (rows split over the mesh, the weights whole on every shard, their gradients
  # summed), with the XLA form standing in for the Mosaic GPU kernel, which has no CPU form under jax 0.10.
  x = rng.standard_normal((b, t, h * n)).astype(np.float32)
  w_in = (rng.standard_normal((h * n, 2, 64)) / np.sqrt(h * n)).astype(np.float32)
  w_out = (rng.standard_normal((64, h * n)) / 8).astype(np.float32)
  spec = lambda *axes: jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec(*axes))
  stand_in = lambda *a, **k: ffn_op.xla(*a, **k)  # Not `xla` itself: the op takes XLA's own path for that backend.
  with unittest.mock.patch.dict(ffn_op._BACKENDS, {"pallas_mgpu": stand_in}):  # pylint: disable=protected-access
    check("ffn", lambda x, w_in, w_out: ffn_op.ffn(x, w_in, w_out, activation="swiglu", impl="pallas_mgpu"),
          (x, w_in, w_out), (bsh, spec(None, None, "tensor"), spec("tensor", None)))
  return out


def scanned_latent_remat():
  """A scanned latent model whose WKV-4 runs the Pallas kernel (interpreted) under remat=full: one train step on the
  2x2x2 mesh against one device. The kernel's custom VJP runs per shard inside remat inside the layer scan and the
  latent inner loop's scan (see ops.sharding.inside_shard_map)."""
  base = _config(MESHES["mixed"], layer_pattern="R", scan_layers=True, remat="full", wkv_impl="pallas")
  base = config_lib.validate(config_lib.apply_overrides(base, CLASSIC_OVERRIDES + ["latent.n_per_layer=2",
                                                                                   "latent.inner_steps=2"]))
  return _against_one_device(base)


def memory_mixers():
  """MM-Rec and Titans layers (D, M): one train step on the 2x2x2 mesh against one device. Rows split over two mesh
  axes and channels over a third is the layout where XLA's own partitioning of MM-Rec's recurrence gave wrong
  gradients (the op now runs per shard of rows)."""
  return _against_one_device(_config(MESHES["mixed"], layer_pattern="DM", n_layers=2))


def strict_short_validation():
  """mesh.strict with a validation split smaller than one batch, whose one batch the data axis cannot split:
  refused by the task, before any step (it failed at the first evaluation, after training steps and before any
  checkpoint); taken where the batch axes do not split the batch at all."""
  from ltm_jax.errors import ConfigError
  from ltm_jax.train import task as task_lib
  open_source = data_lib.open_source

  def short_split(*args, **kwargs):  # A validation split of 5 windows: one batch of 5 rows.
    source = open_source(*args, **kwargs)
    full = source.validation_batches
    source.validation_batches = lambda b, n: [{k: v[:5] for k, v in full(b, 1)[0].items()}]
    return source

  out = {}
  for name, sizes, strict, model in (("data8", (8, 1, 1), True, {}), ("data8_lenient", (8, 1, 1), False, {}),
                                     ("tensor8", (1, 1, 8), True, {"n_heads": 8})):
    cfg = config_lib.validate(config_lib.apply_overrides(_config(sizes, **model), [f"mesh.strict={strict}"]))
    try:
      with unittest.mock.patch.object(task_lib.data_lib, "open_source", short_split):
        task_lib.language_task(cfg, make_optimizer(cfg.train))
      out[name] = None
    except ConfigError as e:
      out[name] = str(e)
  return out


def _against_one_device(base):
  """Loss and gradients of one train step of `base` on its mesh and on one device."""
  optimizer = make_optimizer(base.train)
  host_state = jax.device_get(create_train_state(
      model_lib.init_params(base.model, jax.random.key(0), base.latent), optimizer, 0))
  batch = _batch(base)
  one = jax.devices()[0]
  single = dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, data=1, fsdp=1, tensor=1))
  ref_loss, ref_grads, _, _, _ = _gradients(single, jax.device_put(host_state, one), jax.device_put(batch, one))
  layout = parallel.make_layout(base, optimizer)
  loss, grads, _, _, _ = _gradients(base, jax.device_put(host_state, layout.state),
                                    parallel.put_batch(batch, layout.batch), layout)
  return {"loss": loss, "ref_loss": ref_loss, "grad_diff": _max_diff(grads, ref_grads),
          "grad_scale": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))}


if __name__ == "__main__":
  # CHECK[:ARG] ...: several checks share one interpreter (jax start-up is a good part of each one's time).
  results = {}
  for item in sys.argv[1:]:
    check, _, arg = item.partition(":")
    results[check] = globals()[check](*([arg] if arg else []))
  print(json.dumps(results, default=lambda x: list(x) if isinstance(x, tuple) else str(x)))
