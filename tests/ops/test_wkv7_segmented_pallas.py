"""Numerics of the segmented WKV-7 kernels (`ltm_pallas.wkv7_segmented`, interpreted) and of the op backend built on
them, against a plain float64 token-by-token recurrence."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.wkv7 import pallas_segmented
from ltm_jax.ops.wkv7 import wkv7 as op
from ltm_pallas import wkv7_chunked
from ltm_pallas import wkv7_segmented
from wkv7_reference import wkv7_reference

import test_wkv7_chunked_pallas as chunked_tests  # Its random inputs, cotangents and loss-and-gradients program.

# Two rows of 120 tokens in 4 segments: padded to 128, segments of 32 tokens (two chunks of 16). Head size 16 in
# value blocks of 8 for the backward (partial key-side gradients summed), 16 for the forward and the state passes.
SHAPE = (2, 120, 2, 16)
SETTINGS = dict(segments=4, chunk=16, forward_block=16, backward_block=8, interpret=True)
# Per key channel, from the kernels' bound (-3.75 at chunks of 16: a segment of 32 tokens decays by e^-120 there) to
# e^w = 1 - 1e-6, RWKV-7's bound -e^{-0.5} among them.
DECAYS = np.array([wkv7_chunked.min_log_decay(16), -3.0, -2.0, -1.2, -0.6065, -0.5, -0.3, -0.1, -3e-2, -1e-2, -3e-3,
                   -1e-3, -1e-4, -1e-5, -3e-6, -1e-6])
# Relative to max |expected| of each array. The segments' states pass through a float32 scan of [N, N] products.
# Measured at SHAPE in 4 segments: 1.5e-7 to 2.1e-7 (float32); bfloat16 inputs 1.8e-3 (final state) to 5.2e-3 (grad
# w), the chunked kernels' own level (product operands rounded to bfloat16 once).
F32_RTOL = 1e-5
BF16_RTOL = 2.0**-6
_NAMES = ("r", "w", "k", "v", "a", "b", "state")


def _inputs(seed, shape=SHAPE):
  return chunked_tests._inputs(seed, shape, DECAYS)


def _cotangents(seed, shape=SHAPE):
  return chunked_tests._cotangents(seed, shape)


_loss_and_grads = chunked_tests._loss_and_grads

_REFERENCE = _loss_and_grads(wkv7_reference)
_SEGMENTED = _loss_and_grads(lambda *x: wkv7_segmented.wkv7(*x, **SETTINGS))


def _check(run, inputs, cot, rtol):
  """Runs `run` and compares y, the final state and the seven gradients with the float64 reference."""
  (_, out), grads = run(inputs, cot)
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    (_, out_ref), grads_ref = _REFERENCE(jax.tree.map(to64, inputs), jax.tree.map(to64, cot))
  pairs = list(zip(("y", "final state"), out, out_ref)) + [
      (f"grad {n}", g, g_ref) for n, g, g_ref in zip(_NAMES, grads, grads_ref)]
  for name, actual, expected in pairs:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), name
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=name)
  return out, grads


def test_segments_match_reference():
  _check(_SEGMENTED, _inputs(0), _cotangents(0), F32_RTOL)


def test_bfloat16_inputs_in_two_segments():
  # Two segments: no scan step between them.
  *inputs, state = _inputs(1)
  inputs = (*(x.astype(jnp.bfloat16) for x in inputs), state)
  run = _loss_and_grads(lambda *x: wkv7_segmented.wkv7(*x, **dict(SETTINGS, segments=2)))
  (y, final), grads = _check(run, inputs, _cotangents(1), BF16_RTOL)
  assert y.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in grads[:6]) and grads[6].dtype == jnp.float32


def test_remat_runs_the_primal():
  # The gradient runs both state passes and the chunked forward and backward; under jax.checkpoint the forward pass
  # runs the state passes and the primal forward (no chunk states), the recomputation all of them again.
  inputs, cot = _inputs(2), _cotangents(2)
  loss = lambda *x: jnp.sum(cot[0] * wkv7_segmented.wkv7(*x, **SETTINGS)[0])
  kernels = lambda fn: sorted(re.findall(r"name=(wkv7_chunked_\w+)", str(jax.make_jaxpr(jax.grad(fn))(*inputs))))
  names = ["wkv7_chunked_backward", "wkv7_chunked_end_state", "wkv7_chunked_forward", "wkv7_chunked_state_gradient",
           "wkv7_chunked_transition"]
  assert kernels(loss) == names
  assert kernels(jax.checkpoint(loss)) == sorted(names + ["wkv7_chunked_end_state", "wkv7_chunked_forward_primal",
                                                          "wkv7_chunked_transition"])


def test_segment_rule():
  # 64 programs of the chunked forward at (1, 32768, 64, 64) bf16: 8 segments of 4096 tokens, 512 programs. Enough
  # programs already, a short sequence, or a head size the chunked kernels do not take: no segments.
  assert pallas_segmented.segments(1, 32768, 64, 64, jnp.bfloat16) == 8
  assert pallas_segmented.segments(1, 4096, 64, 64, jnp.bfloat16) == 4
  assert pallas_segmented.segments(8, 4096, 64, 64, jnp.bfloat16) == 1
  assert pallas_segmented.segments(1, 2047, 64, 64, jnp.bfloat16) == 1
  assert pallas_segmented.segments(1, 32768, 8, 256, jnp.bfloat16) == 1


def test_op_backend(monkeypatch):
  # At the suite's small shapes the rule leaves the chunked kernels alone; with shorter segments allowed it cuts
  # (1, 64, 2, 16) into 4, and the op's outputs match the reference. (Two shapes: the op's trace is cached by shape.)
  run = lambda *x: op(*x, impl="pallas_segmented")
  kernels = lambda inputs: set(re.findall(r"name=(wkv7_chunked_\w+)", str(jax.make_jaxpr(run)(*inputs))))
  assert kernels(_inputs(3, (1, 32, 2, 16))) == {"wkv7_chunked_forward_primal"}
  monkeypatch.setattr(pallas_segmented, "MIN_SEGMENT", 16)
  inputs = _inputs(3, (1, 64, 2, 16))
  assert pallas_segmented.segments(1, 64, 2, 16, jnp.float32) == 4
  assert kernels(inputs) == {"wkv7_chunked_end_state", "wkv7_chunked_transition", "wkv7_chunked_forward_primal"}
  out = jax.jit(run)(*inputs)
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
    out_ref = wkv7_reference(*(to64(x) for x in inputs))
  for name, actual, expected in zip(("y", "final state"), out, out_ref):
    np.testing.assert_allclose(actual, expected, rtol=F32_RTOL, atol=F32_RTOL * np.max(np.abs(expected)),
                               err_msg=name)


def test_rejects_one_segment():
  with pytest.raises(ValueError, match="segments must be an int >= 2"):
    wkv7_segmented.wkv7(*_inputs(4, (1, 32, 1, 16)), segments=1, interpret=True)
