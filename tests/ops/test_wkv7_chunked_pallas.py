"""Numerics of the chunked WKV-7 Pallas kernels (`ltm_pallas.wkv7_chunked`, interpreted) and of the op backend
built on them, against a plain float64 recurrence written out below."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.wkv7 import wkv7 as op
from ltm_pallas import wkv7_chunked
from wkv7_reference import wkv7_reference

# Chunks of 16 over 37 tokens: two full chunks and a padded one. Head size 16 split into value blocks of 8, so the
# backward also sums partial key-side gradients.
SHAPE = (1, 37, 2, 16)
SETTINGS = dict(chunk=16, forward_block=16, backward_block=8, interpret=True)
LOW = wkv7_chunked.min_log_decay(16)  # -3.75: the strongest decay the kernels take at this chunk.
# Per key channel: both ends of the range (the bound itself and -1e-6, e^w = 1 - 1e-6), RWKV-7's bound -e^{-0.5},
# and values between. A chunk at the bound decays by e^{-60}.
DECAYS = np.array([LOW, -3.0, -2.0, -1.2, -0.6065, -0.5, -0.3, -0.1, -3e-2, -1e-2, -3e-3, -1e-3, -1e-4, -1e-5, -3e-6,
                   -1e-6])
# Relative to max |expected| of each array. float32 products and sums over a few dozen tokens land near 3e-7.
F32_RTOL = 1e-5
# bfloat16 inputs (the reference sees the same rounded inputs): products take bfloat16 operands (the decayed keys,
# the state, U; stored chunk states too), each rounded once (2^-9), and outputs are rounded to bfloat16. Measured
# here: y 4.6e-3, final state 2.6e-3, gradients 3.7e-3 to 5.4e-3 of their largest entry.
BF16_RTOL = 2.0**-6


def _inputs(seed, shape=SHAPE, w=DECAYS):
  """Random float32 (r, w, k, v, a, b, state) as RWKV-7 passes them: a = -kk, b = kk·a_lr, kk a unit key."""
  rng = np.random.default_rng(seed)
  batch, _, heads, size = shape
  r, k, v, kk = (rng.normal(size=shape) for _ in range(4))
  kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
  a, b = -kk, kk * rng.uniform(0.0, 1.0, shape)
  state = 0.5 * rng.normal(size=(batch, heads, size, size))
  return tuple(jnp.asarray(x, jnp.float32) for x in (r, np.broadcast_to(w, shape), k, v, a, b, state))


def _cotangents(seed, shape=SHAPE):
  rng = np.random.default_rng(seed + 1000)
  batch, _, heads, size = shape
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in (shape, (batch, heads, size, size)))


def _loss_and_grads(fn):
  def loss(inputs, cot):
    y, state = fn(*inputs)
    return jnp.sum(cot[0] * y.astype(cot[0].dtype)) + jnp.sum(cot[1] * state), (y, state)

  return jax.jit(lambda inputs, cot: jax.value_and_grad(loss, has_aux=True)(inputs, cot))


_REFERENCE = _loss_and_grads(wkv7_reference)
_KERNELS = _loss_and_grads(lambda *x: wkv7_chunked.wkv7(*x, **SETTINGS))
# The backward as one program per head that takes its two value blocks of 8 rows in turn (head size 128's setting).
_LOOPED = _loss_and_grads(lambda *x: wkv7_chunked.wkv7(*x, **SETTINGS, backward_loop=True))
_OP_FORWARD = jax.jit(lambda *x: op(*x, impl="pallas_chunked"))


def _expected(inputs, cot):
  """(y, final state) and the seven gradients, in float64."""
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    (_, out), grads = _REFERENCE(jax.tree.map(to64, inputs), jax.tree.map(to64, cot))
    return jax.tree.map(np.asarray, (out, grads))


def _assert_close(actual, expected, rtol, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


def _check(run, inputs, cot, rtol=F32_RTOL):
  (_, out), grads = run(inputs, cot)
  out_ref, grads_ref = _expected(inputs, cot)
  for name, x, x_ref in zip(("y", "final state"), out, out_ref):
    _assert_close(x, x_ref, rtol, name)
  for name, g, g_ref in zip(("r", "w", "k", "v", "a", "b", "state"), grads, grads_ref):
    _assert_close(g, g_ref, rtol, f"grad {name}")
  return out, grads


def test_kernels_match_reference_across_the_decay_range():
  _check(_KERNELS, _inputs(0), _cotangents(0))


def test_backward_loop_over_value_blocks():
  _check(_LOOPED, _inputs(7), _cotangents(7))
  *inputs, state = _inputs(8)
  inputs = (*(x.astype(jnp.bfloat16) for x in inputs), state)
  (_, _), grads = _check(_LOOPED, inputs, _cotangents(8), rtol=BF16_RTOL)
  assert all(g.dtype == jnp.bfloat16 for g in grads[:6]) and grads[6].dtype == jnp.float32


def test_one_token_from_a_carried_state():
  # One token is one chunk, 15 of it padding; it continues from a state (as decoding does after a prompt).
  inputs, cot = _inputs(1, (1, 1, 2, 16)), _cotangents(1, (1, 1, 2, 16))
  out = jax.jit(lambda *x: wkv7_chunked.wkv7(*x, **SETTINGS))(*inputs)
  (out_ref, _) = _expected(inputs, cot)
  for name, x, x_ref in zip(("y", "final state"), out, out_ref):
    _assert_close(x, x_ref, F32_RTOL, name)


def test_bfloat16_inputs():
  *inputs, state = _inputs(2)
  inputs = (*(x.astype(jnp.bfloat16) for x in inputs), state)
  (y, final), grads = _check(_KERNELS, inputs, _cotangents(2), rtol=BF16_RTOL)
  assert y.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in grads[:6]) and grads[6].dtype == jnp.float32


def test_decays_beyond_the_range():
  # The kernels' factors e^{-g} overflow once a chunk decays past e^{-88}: w = -8 over 16 tokens is e^{-128}, and
  # in_range says so. The op then runs the sequential kernels, exact for any decay.
  w = DECAYS.copy()
  w[:3] = (-8.0, -20.0, -np.exp(6.0))
  inputs, cot = _inputs(3, w=w), _cotangents(3)
  assert not bool(wkv7_chunked.in_range(inputs[1], 16))
  assert bool(wkv7_chunked.in_range(_inputs(3)[1], 16))
  (_, (y, _)), _ = _KERNELS(inputs, cot)
  assert not np.all(np.isfinite(np.asarray(y)))
  (y_ref, state_ref), _ = _expected(inputs, cot)
  y, state = _OP_FORWARD(*inputs)
  _assert_close(y, y_ref, F32_RTOL, "y")
  _assert_close(state, state_ref, F32_RTOL, "final state")
  # Its gradients too: the sequential branch's backward runs its forward again (it keeps only its inputs).
  _check(_loss_and_grads(lambda *x: op(*x, impl="pallas_chunked")), inputs, cot)


def test_differentiated_op_keeps_one_set_of_chunk_states():
  # bfloat16 inputs: the chunked kernels keep bfloat16 chunk states, the sequential ones float32. The branch taken
  # must not also hold (and write zeros into) a [B, H, chunks, N, N] float32 array for the branch not taken.
  *inputs, state = _inputs(9)
  inputs = [x if name == "w" else x.astype(jnp.bfloat16) for name, x in zip("rwkvab", inputs)] + [state]
  _, vjp = jax.vjp(lambda *x: op(*x, impl="pallas_chunked"), *inputs)
  states = [(x.shape, x.dtype) for x in jax.tree.leaves(vjp) if getattr(x, "ndim", 0) == 5]
  assert states == [((1, 2, 3, 16, 16), jnp.bfloat16)]


def test_op_runs_the_chunked_kernels_in_range():
  # In range the op's result is the chunked kernels' own, bit for bit (the sequential ones round differently); its
  # gradient holds both kernel sets, one per branch of the range check.
  inputs, cot = _inputs(4), _cotangents(4)
  np.testing.assert_array_equal(_OP_FORWARD(*inputs)[0], jax.jit(lambda *x: wkv7_chunked.wkv7(*x))(*inputs)[0])
  loss = lambda *x: jnp.sum(cot[0] * op(*x, impl="pallas_chunked")[0])
  names = set(re.findall(r"name=(wkv7\w*)", str(jax.make_jaxpr(jax.grad(loss))(*inputs))))
  assert {"wkv7_chunked_forward", "wkv7_chunked_backward", "wkv7_forward", "wkv7_backward"} <= names


def test_a_bound_within_the_range_leaves_out_the_check():
  # A caller's bound on w within the range (RWKV-7 layers pass -1): the op runs the chunked kernels alone, no cond and
  # no sequential kernels in its gradient, with the same values; a bound beyond the range keeps the check.
  inputs, cot = _inputs(4), _cotangents(4)
  loss = lambda bound: lambda *x: jnp.sum(cot[0] * op(*x, impl="pallas_chunked", w_min=bound)[0])
  jaxpr = lambda bound: str(jax.make_jaxpr(jax.grad(loss(bound)))(*inputs))
  bounded = jaxpr(LOW)
  assert set(re.findall(r"name=(wkv7\w*)", bounded)) == {"wkv7_chunked_forward", "wkv7_chunked_backward"}
  assert " cond[" not in bounded
  assert {"wkv7_forward", "wkv7_backward"} <= set(re.findall(r"name=(wkv7\w*)", jaxpr(2 * LOW)))
  np.testing.assert_array_equal(jax.jit(lambda *x: op(*x, impl="pallas_chunked", w_min=-1.0))(*inputs)[0],
                                _OP_FORWARD(*inputs)[0])
  for bad in (0.5, "-1", True):
    with pytest.raises(ValueError, match="w_min must be a float <= 0"):
      op(*inputs, impl="pallas_chunked", w_min=bad)


def test_remat_runs_the_primal():
  """Under jax.checkpoint the forward pass runs the kernel that writes no chunk states, and only the recomputation
  writes them; without remat the forward writes them once. (The primal's values: test_op_runs_the_chunked...)"""
  inputs, cot = _inputs(5), _cotangents(5)
  loss = lambda *x: jnp.sum(cot[0] * wkv7_chunked.wkv7(*x, **SETTINGS)[0])
  kernels = lambda fn: sorted(re.findall(r"name=(wkv7_chunked_\w+)", str(jax.make_jaxpr(jax.grad(fn))(*inputs))))
  assert kernels(loss) == ["wkv7_chunked_backward", "wkv7_chunked_forward"]
  assert kernels(jax.checkpoint(loss)) == [
      "wkv7_chunked_backward", "wkv7_chunked_forward", "wkv7_chunked_forward_primal"]


def test_kernels_lower_to_triton(cuda_lowering):
  # The GPU path without a GPU: both kernels at head sizes 64 and 128 go through the Pallas Triton lowering, which
  # rejects what Triton cannot express. (benchmarks/gpu_aot.py compiles them on to an H100 binary.)
  for size in (64, 128):
    seq = jax.ShapeDtypeStruct((1, 32, 1, size), jnp.bfloat16)
    state = jax.ShapeDtypeStruct((1, 1, size, size), jnp.float32)

    def loss(*args):
      y, final = wkv7_chunked.wkv7(*args, interpret=False)
      return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    lowered = jax.jit(jax.grad(loss, argnums=tuple(range(7)))).trace(*[seq] * 6, state).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("triton") >= 2


def test_rejects_bad_settings():
  inputs = _inputs(6, (1, 4, 1, 16))
  with pytest.raises(ValueError, match="chunk must be a power of two"):
    wkv7_chunked.wkv7(*inputs, chunk=24, interpret=True)
  with pytest.raises(ValueError, match="forward_block must be a power of two"):
    wkv7_chunked.wkv7(*inputs, forward_block=12, interpret=True)
