"""Runs the Mosaic GPU WKV-7 kernels (`ltm_pallas.wkv7_mgpu`) in Mosaic GPU interpret mode on the CPU and saves their
inputs, outputs and gradients for tests/ops/test_wkv7_mgpu.py to check against the float64 reference.

Needs jax >= 0.11 (Mosaic GPU interpret mode): run by .venv-aot's Python, `python wkv7_mgpu_worker.py OUT.npz`.
`python wkv7_mgpu_worker.py --compiled OUT.npz` on a Hopper GPU runs the same cases compiled on it instead; the test
file checks such a file in place of its own run with WKV7_MGPU_RESULTS=OUT.npz.
Cases (name -> shape, dtype, log-decays). At N = 64 the kernels overlap each chunk's loads with the previous chunk's
products (`wkv7_mgpu.pipelines`), at N = 128 they do not:
  kernel_f32_ragged:   [1, 100, 2, 64] float32, T = one chunk and 36 tokens
  kernel_bf16:         [1, 150, 1, 64] bfloat16 (y bfloat16), three chunks, the last padded
  kernel_f32_n128:     [2, 70, 1, 128] float32, two value blocks per head
  kernel_bf16_n128:    [1, 64, 1, 128] bfloat16, one whole chunk
  op_grad_f32:         [1, 150, 1, 64] float32 through ops.wkv7(impl="pallas_mgpu"): y, state and the gradients of
                       all seven inputs (the forward kernel with chunk states, then the backward kernel), three
                       chunks, the last padded
  op_grad_bf16:        [1, 150, 2, 64] bfloat16, the same, with the op's w_min = min_log_decay() (the cases' own
                       bound: no run-time range check)
  op_grad_bf16_n128:   [1, 100, 1, 128] bfloat16, the same, two value blocks per head
  op_strong_decay_f32: [1, 40, 1, 64] float32, the same with w = -2 in one channel (beyond the kernels' range:
                       "chunked" runs both ways)
  grad_bf16_serial:    [1, 150, 1, 64] bfloat16, the kernels called directly with pipelined=False (each chunk's loads
                       before its products, as at N = 128): y, state and the seven gradients, and the forward's
                       residuals for the backward (`residual_<field>`: R̂, Ǩ, Â, B̌ and g, padded to 192 tokens)
  grad_bf16_xbar:      [1, 150, 1, 64] bfloat16, the same with the loads overlapped and explicit_barriers=True (the
                       kernels' own barriers only: compiled on a GPU, where a missing one would show)
  states_f32_ragged:   [1, 100, 2, 64] float32, the state-only kernels: `end_states` from the random state (saved as
                       y = nothing, state = the end state), from the identity without values (the transition,
                       `transition`) and `state_gradients` of random dy and ds
                       from the forward's residuals (`state_grad`)
  states_bf16_n128:    [1, 128, 1, 128] bfloat16, the same, two value blocks per head
  op_grad_segmented_bf16: [1, 256, 1, 64] bfloat16 through ops.wkv7(impl="pallas_mgpu") with
                       pallas_segmented.MIN_SEGMENT = SEGMENT = 128, so that the op runs two segments of 128 tokens
                       (`wkv7_segmented` with the Mosaic GPU kernels): y, state and the seven gradients, and
                       the bytes of what the differentiated op keeps for its backward
For every op case, the run-time range checks of w in the jaxpr of the op and its pullback as it ran (`range_checks`),
and for the segmented case also with w_min = min_log_decay() (`bounded_range_checks`).
Log-decays are drawn per channel from [min_log_decay() = -0.9375, -1e-6] unless stated.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops.wkv7 import pallas_mgpu
from ltm_jax.ops.wkv7 import pallas_segmented
from ltm_jax.ops.wkv7 import wkv7 as op
from ltm_pallas import wkv7_mgpu

CASES = {
    "kernel_f32_ragged": ((1, 100, 2, 64), "float32"),
    "kernel_bf16": ((1, 150, 1, 64), "bfloat16"),
    "kernel_f32_n128": ((2, 70, 1, 128), "float32"),
    "kernel_bf16_n128": ((1, 64, 1, 128), "bfloat16"),
    "op_grad_f32": ((1, 150, 1, 64), "float32"),
    "op_grad_bf16": ((1, 150, 2, 64), "bfloat16"),
    "op_grad_bf16_n128": ((1, 100, 1, 128), "bfloat16"),
    "op_strong_decay_f32": ((1, 40, 1, 64), "float32"),
    "grad_bf16_serial": ((1, 150, 1, 64), "bfloat16"),
    "grad_bf16_xbar": ((1, 150, 1, 64), "bfloat16"),
    "states_f32_ragged": ((1, 100, 2, 64), "float32"),
    "states_bf16_n128": ((1, 128, 1, 128), "bfloat16"),
    "op_grad_segmented_bf16": ((1, 256, 1, 64), "bfloat16"),
}
BOUNDED = ("op_grad_bf16",)  # Run with the op's w_min = min_log_decay().
SEGMENT = 128  # pallas_segmented.MIN_SEGMENT for op_grad_segmented_bf16: T = 256 gives S = 2.


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


def main(path: str, compiled: bool = False) -> None:
  saved = {"device": np.array(str(jax.devices()[0].device_kind))}
  started = time.time()
  kernel = jax.jit(lambda *x: wkv7_mgpu.forward(*x, interpret=not compiled))

  def op_and_pullback(args, cot, w_min=None):
    """The op's (y, state) and the pullback of the cotangents `cot` (y's, the state's) to all seven inputs."""
    outputs, pullback = jax.vjp(lambda *x: op(*x, impl="pallas_mgpu", w_min=w_min), *args)  # Compiled on a GPU.
    return outputs, pullback(cot)

  # The range check: the minimum of all of w (the kernels' own minima reduce one axis of a tile).
  range_checks = lambda args, cot, w_min=None: np.array(str(jax.make_jaxpr(
      lambda a, c: op_and_pullback(a, c, w_min))(args, cot)).count("reduce_min[axes=(0, 1, 2, 3)"))
  op_and_pullback = jax.jit(op_and_pullback, static_argnames="w_min")

  @functools.partial(jax.jit, static_argnames=("pipelined", "explicit_barriers"))
  def kernels_and_gradients(args, cot, pipelined, explicit_barriers):
    """The kernels' (y, state) and gradients as the op composes them, in the form the flags name."""
    form = dict(interpret=not compiled, pipelined=pipelined, explicit_barriers=explicit_barriers)
    y, state, residuals = wkv7_mgpu.forward(*args, checkpoints=True, **form)
    grads = wkv7_mgpu.backward(*args[:6], residuals, *cot, **form)
    return (y, state), grads, residuals

  @jax.jit
  def state_kernels(args, cot):
    """`end_states` from the state, the transition (from the identity, no values) and `state_gradients`."""
    r, w, k, v, a, b, state = args
    ends = wkv7_mgpu.end_states(w, k, v, a, b, state, interpret=not compiled)
    identity = jnp.broadcast_to(jnp.eye(state.shape[-1], dtype=jnp.float32), state.shape)
    transition = wkv7_mgpu.end_states(w, None, None, a, b, identity, interpret=not compiled)
    residuals = wkv7_mgpu.forward(*args, checkpoints=True, interpret=not compiled)[2]
    return ends, transition, wkv7_mgpu.state_gradients(residuals, *cot, interpret=not compiled)

  for seed, (name, (shape, dtype)) in enumerate(CASES.items()):
    x = inputs(seed, shape, strong_decay=name == "op_strong_decay_f32")
    args = [jnp.asarray(z, dtype) for z in x[:6]] + [jnp.asarray(x[6])]
    segment = pallas_segmented.MIN_SEGMENT
    if "segmented" in name:
      pallas_segmented.MIN_SEGMENT = SEGMENT
      saved[f"{name}/segments"] = np.array(pallas_mgpu.segments(*shape))
      # What the differentiated op keeps for its backward (traced, not run), against its inputs' size.
      kept = jax.eval_shape(lambda *x: jax.vjp(lambda *y: op(*y, impl="pallas_mgpu"), *x)[1], *args)
      saved[f"{name}/residual_bytes"] = np.array(sum(t.size * t.dtype.itemsize for t in jax.tree.leaves(kept)))
      saved[f"{name}/input_bytes"] = np.array(sum(t.size * t.dtype.itemsize for t in args))
    if name.startswith("kernel"):
      y, state = kernel(*args)
    elif name.startswith("states"):
      rng = np.random.default_rng(100 + seed)
      cot = (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=x[6].shape), jnp.float32))
      state, transition, state_grad = state_kernels(args, cot)
      y = jnp.zeros((0,), jnp.float32)
      saved.update({f"{name}/cot{i}": np.asarray(c, np.float32) for i, c in enumerate(cot)})
      saved[f"{name}/transition"], saved[f"{name}/state_grad"] = np.asarray(transition), np.asarray(state_grad)
    else:
      rng = np.random.default_rng(100 + seed)
      # y's cotangent in y's dtype (as autodiff hands it to the op), the state's in float32.
      cot = (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=x[6].shape), jnp.float32))
      if name.startswith("grad"):
        xbar = name.endswith("xbar")
        (y, state), grads, residuals = kernels_and_gradients(args, cot, pipelined=xbar, explicit_barriers=xbar)
        saved.update({f"{name}/residual_{field}": np.asarray(getattr(residuals, field), np.float32)
                      for field in ("r_hat", "k_check", "a_hat", "b_check", "g")})
      else:
        w_min = wkv7_mgpu.min_log_decay() if name in BOUNDED else None
        (y, state), grads = op_and_pullback(args, cot, w_min)
        saved[f"{name}/range_checks"] = range_checks(args, cot, w_min)
        if "segmented" in name:
          saved[f"{name}/bounded_range_checks"] = range_checks(args, cot, wkv7_mgpu.min_log_decay())
      pallas_segmented.MIN_SEGMENT = segment
      saved.update({f"{name}/cot{i}": np.asarray(c, np.float32) for i, c in enumerate(cot)})
      saved.update({f"{name}/grad_dtype{i}": np.array(str(g.dtype)) for i, g in enumerate(grads)})
      saved.update({f"{name}/grad{i}": np.asarray(g, np.float32) for i, g in enumerate(grads)})
    # The inputs as the kernel saw them (bfloat16 cases: rounded), in float32.
    saved.update({f"{name}/in{i}": np.asarray(z, np.float32) for i, z in enumerate(args)})
    saved[f"{name}/y"], saved[f"{name}/state"] = np.asarray(y, np.float32), np.asarray(state)
    saved[f"{name}/y_dtype"] = np.array(str(y.dtype))
    print(name, f"{time.time() - started:.1f} s", file=sys.stderr)
  np.savez(path, **saved)
  print("ok")


if __name__ == "__main__":
  main(sys.argv[-1], compiled="--compiled" in sys.argv[1:-1])
