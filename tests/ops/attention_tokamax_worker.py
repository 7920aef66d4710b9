"""Runs the tokamax attention backend (`ltm_jax.ops.attention.tokamax_mgpu`) where tokamax is installed and saves what
tests/ops/test_attention_tokamax.py checks.

`python attention_tokamax_worker.py mapping OUT.npz`: our masks mapped onto tokamax's arguments, run through
tokamax's XLA implementation (`implementation="xla"`, the same arguments its Mosaic GPU kernels take) on the CPU:
inputs, outputs and the gradients of sum(out * cotangent), float32, fresh random inputs per case.

`python attention_tokamax_worker.py compile OUT.json`: the forward and backward Mosaic GPU kernels compiled for an
H100 (sm_90a) without one, through the CUDA plugin's deviceless path (as benchmarks/gpu_aot.py sets it up). tokamax
picks its kernels by the default device, which here is the CPU, so the worker presents it an H100 for the trace.
Needs jax >= 0.11.1 with the CUDA plugin (.venv-aot) and tokamax.
"""

from __future__ import annotations

import json
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops.attention import tokamax_mgpu

# name -> (B, T, S, Hq, Hkv, D, causal, window, segments)
MAPPING_CASES = {
    "window_gqa": (2, 96, 96, 4, 2, 64, True, 20, False),
    "causal_mqa": (1, 64, 64, 4, 1, 64, True, None, False),
    "window_covers_all": (1, 40, 40, 2, 1, 64, True, 40, False),
    "end_aligned_window": (1, 24, 80, 2, 1, 64, True, 30, False),
    "end_aligned_causal": (2, 24, 80, 4, 2, 64, True, None, False),
    "segments_window": (2, 64, 64, 4, 2, 64, True, 16, True),
    "non_causal_cross": (1, 24, 40, 2, 2, 64, False, None, False),
    # Blocked (`tokamax_mgpu.uses_blocks`): blocks of 128 and 256 queries, the last one ragged.
    "blocked_window_gqa": (1, 600, 600, 4, 2, 64, True, 100, False),
    "blocked_segments_window": (2, 520, 520, 2, 1, 64, True, 130, True),
    # Explicit positions, as the model's calls over a key/value cache make them (`cache_positions`).
    "cache_window": (2, 16, 48, 4, 2, 64, True, 20, False),
    "cache_causal_segments": (2, 16, 48, 4, 1, 64, True, None, True),
}
# name -> (B, T, Hq, Hkv, D, window, segments): training shapes of the models' attention layers; the first three
# run blocked (`tokamax_mgpu.uses_blocks`).
COMPILE_CASES = {
    "window_gqa_d64": (2, 2048, 8, 2, 64, 256, False),
    "window_gqa_d128": (2, 2048, 8, 2, 128, 512, False),
    "segments_window_d64": (2, 1024, 8, 2, 64, 256, True),
    "whole_window_d64": (1, 1024, 8, 2, 64, 512, False),
    # 512 new tokens over a cache of 1536 keys, by explicit positions.
    "cache_window_d128": (2, 512, 8, 2, 128, 1024, False),
}


def segment_ids(rng, b, t):
  """[B, T] int32: sorted ids, so each row packs a few contiguous sequences."""
  return np.sort(rng.integers(0, 3, size=(b, t)), axis=1).astype(np.int32)


def cache_positions(rng, b, t, s):
  """([B, T], [B, S]) int32 positions of T new tokens after a cache of S - T slots, keys laid out as the model
  concatenates them (cache, then the new tokens): each row's cache ring holds the S - T positions before its first
  new token in ring order, three of its slots empty (int32 max, invisible), and every query sees its own key."""
  capacity = s - t
  starts = rng.integers(capacity, 3 * capacity, size=b)
  q_pos = starts[:, None] + np.arange(t)[None]
  ring = starts[:, None] - capacity + np.arange(capacity)[None]
  ring = np.stack([np.roll(row, int(r)) for row, r in zip(ring, rng.integers(0, capacity, size=b))])
  for row in ring:
    row[rng.choice(capacity, size=3, replace=False)] = np.iinfo(np.int32).max
  return q_pos.astype(np.int32), np.concatenate([ring, q_pos], axis=1).astype(np.int32)


def run_mapping(path: str) -> None:
  saved = {}
  for seed, (name, (b, t, s, hq, hkv, d, causal, window, segments)) in enumerate(MAPPING_CASES.items()):
    rng = np.random.default_rng(1000 + seed)
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    cot = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    scale = d**-0.5
    q_pos = kv_pos = None
    if name.startswith("cache"):
      q_pos, kv_pos = cache_positions(rng, b, t, s)
      saved.update({f"{name}/q_pos": q_pos, f"{name}/kv_pos": kv_pos})
    # Self-attention ids, or with positions a pair: the new tokens' ids, then the cache's and theirs.
    ids = segment_ids(rng, b, t) if segments else None
    kv_ids = ids if ids is None or t == s else np.concatenate([segment_ids(rng, b, s - t), ids], axis=1)
    if kv_ids is not None:
      saved[f"{name}/kv_ids"] = kv_ids

    def fn(q, k, v, ids=ids, kv_ids=kv_ids, q_pos=q_pos, kv_pos=kv_pos, causal=causal, window=window, scale=scale):
      return tokamax_mgpu.attention(q, k, v, causal=causal, window=window, scale=scale, q_segment_ids=ids,
                                    kv_segment_ids=kv_ids, q_positions=q_pos, kv_positions=kv_pos,
                                    implementation="xla")

    @jax.jit
    def run(q, k, v, cot, fn=fn):
      out, pullback = jax.vjp(fn, q, k, v)
      return (out, *pullback(cot))

    out, dq, dk, dv = run(q, k, v, cot)
    saved.update({f"{name}/q": q, f"{name}/k": k, f"{name}/v": v, f"{name}/cot": cot, f"{name}/out": np.asarray(out),
                  f"{name}/dq": np.asarray(dq), f"{name}/dk": np.asarray(dk), f"{name}/dv": np.asarray(dv)})
    if ids is not None:
      saved[f"{name}/ids"] = ids
  saved["second_order_error"] = np.array(second_order_error())
  np.savez(path, **saved)


def second_order_error() -> str:
  """The error a second derivative through the backend raises ("" if none)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 2, 64)), jnp.float32)
  first = jax.grad(lambda x: tokamax_mgpu.attention(x, x, x, causal=True, window=None, scale=0.125,
                                                    implementation="xla").sum())
  try:
    jax.grad(lambda x: first(x).sum())(x)
  except NotImplementedError as e:
    return str(e)
  return ""


def run_compile(path: str) -> None:
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, "benchmarks")
  from gpu_aot import H100_TARGET_CONFIG  # pylint: disable=g-import-not-at-top

  topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  sharding = NamedSharding(mesh, PartitionSpec())
  h100 = mock.Mock(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3", core_count=132)
  results = {}
  for name, (b, t, hq, hkv, d, window, segments) in COMPILE_CASES.items():
    s = 4 * t if name.startswith("cache") else t
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16, sharding=sharding)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding) if segments else None
    positions = None
    if name.startswith("cache"):
      positions = (jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding),
                   jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sharding))

    def train_step(q, k, v, ids, positions, window=window, d=d):
      q_pos, kv_pos = (None, None) if positions is None else positions
      fn = lambda q, k, v: tokamax_mgpu.attention(q, k, v, causal=True, window=window, scale=d**-0.5,
                                                  q_segment_ids=ids, kv_segment_ids=ids, q_positions=q_pos,
                                                  kv_positions=kv_pos)
      out, pullback = jax.vjp(fn, q, k, v)
      return pullback(out)

    try:
      with mock.patch("jax.extend.backend.get_default_device", return_value=h100):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
          lowered = jax.jit(train_step).trace(q, kv, kv, ids, positions).lower()
        compiled = lowered.compile()
      # Every kernel of the compiled program is a custom call; Mosaic GPU's are named "mosaic_gpu...".
      results[name] = {"ok": True, "custom_calls": re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())}
    except Exception as e:  # pylint: disable=broad-except  (reported per case)
      results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
  with open(path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  {"mapping": run_mapping, "compile": run_compile}[sys.argv[1]](sys.argv[2])
  print("ok")
