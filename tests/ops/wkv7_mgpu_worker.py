"""Runs the Mosaic GPU WKV-7 kernel (`ltm_pallas.wkv7_mgpu`) in Mosaic GPU interpret mode on the CPU and saves its
inputs and outputs for tests/ops/test_wkv7_mgpu.py to check against the float64 reference.

Needs jax >= 0.11 (Mosaic GPU interpret mode): run by .venv-aot's Python, `python wkv7_mgpu_worker.py OUT.npz`.
Cases (name -> shape, dtype, log-decays):
  kernel_f32_ragged:   [1, 100, 2, 64] float32, T = one chunk and 36 tokens
  kernel_bf16:         [1, 150, 1, 64] bfloat16 (y bfloat16), three chunks, the last padded
  kernel_f32_n128:     [2, 70, 1, 128] float32, two value blocks per head
  kernel_bf16_n128:    [1, 64, 1, 128] bfloat16, one whole chunk
  op_grad_f32:         ops.wkv7(impl="pallas_mgpu") and its gradients (through the "chunked" backend's VJP)
  op_strong_decay_f32: ops.wkv7(impl="pallas_mgpu") with w = -2 (beyond the kernel's range: "chunked" runs)
Log-decays are drawn per channel from [min_log_decay() = -0.9375, -1e-6] unless stated.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops.wkv7 import wkv7 as op
from ltm_pallas import wkv7_mgpu

CASES = {
    "kernel_f32_ragged": ((1, 100, 2, 64), "float32"),
    "kernel_bf16": ((1, 150, 1, 64), "bfloat16"),
    "kernel_f32_n128": ((2, 70, 1, 128), "float32"),
    "kernel_bf16_n128": ((1, 64, 1, 128), "bfloat16"),
    "op_grad_f32": ((1, 80, 1, 64), "float32"),
    "op_strong_decay_f32": ((1, 40, 1, 64), "float32"),
}


def inputs(seed: int, shape, strong_decay: bool = False):
  """float32 (r, w, k, v, a, b, state) as RWKV-7 passes them: a = -kk, b = kk·a_lr, kk a unit key per head."""
  rng = np.random.default_rng(seed)
  batch, _, heads, size = shape
  r, k, v, kk = (rng.normal(size=shape) for _ in range(4))
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  a, b = -kk, kk * rng.uniform(0.0, 1.0, shape)
  low = wkv7_mgpu.min_log_decay()
  w = -np.exp(rng.uniform(np.log(1e-6), np.log(-low), shape))
  w[..., 0] = low  # The range's bound itself in one channel.
  if strong_decay:
    w[..., 1] = -2.0
  state = 0.5 * rng.normal(size=(batch, heads, size, size))
  return [np.asarray(x, np.float32) for x in (r, w, k, v, a, b, state)]


def main(path: str) -> None:
  saved = {}
  kernel = jax.jit(lambda *x: wkv7_mgpu.forward(*x, interpret=True))
  forward = jax.jit(lambda *x: op(*x, impl="pallas_mgpu"))

  def loss(inputs, cot):
    y, state = op(*inputs, impl="pallas_mgpu")
    return jnp.sum(cot[0] * y) + jnp.sum(cot[1] * state)

  grad = jax.jit(jax.grad(loss))
  for seed, (name, (shape, dtype)) in enumerate(CASES.items()):
    x = inputs(seed, shape, strong_decay=name == "op_strong_decay_f32")
    args = [jnp.asarray(z, dtype) for z in x[:6]] + [jnp.asarray(x[6])]
    run = kernel if name.startswith("kernel") else forward
    y, state = run(*args)
    # The inputs as the kernel saw them (bfloat16 cases: rounded), in float32.
    saved.update({f"{name}/in{i}": np.asarray(z, np.float32) for i, z in enumerate(args)})
    saved[f"{name}/y"], saved[f"{name}/state"] = np.asarray(y, np.float32), np.asarray(state)
    saved[f"{name}/y_dtype"] = np.array(str(y.dtype))
    if name == "op_grad_f32":
      rng = np.random.default_rng(100 + seed)
      cot = [rng.normal(size=y.shape).astype(np.float32), rng.normal(size=state.shape).astype(np.float32)]
      grads = grad(args, [jnp.asarray(c) for c in cot])
      saved.update({f"{name}/cot{i}": c for i, c in enumerate(cot)})
      saved.update({f"{name}/grad{i}": np.asarray(g) for i, g in enumerate(grads)})
  np.savez(path, **saved)
  print("ok")


if __name__ == "__main__":
  main(sys.argv[1])
