"""Numerics of the Pallas WKV-4 kernels (`ltm_pallas.wkv4`, interpreted on CPU) against a float64 recurrence written here.

Both paths are checked, the sequential one (grid over batch and channel blocks, a loop over T) and the time-parallel
one (chunk summaries, a scan over chunks, a second pass). A chunk of 4 tokens makes small T span several chunks and
end in a partial one; a channel block of 4 makes C = 5 span two blocks, the second padded.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ltm_jax.ops.wkv4 import EMPTY_MAX
from ltm_jax.ops.wkv4 import wkv4 as ops_wkv4
from ltm_pallas import wkv4 as kernel

# Tolerances relative to the largest magnitude in the compared array (atol = rtol·max|expected|). float32 over a few
# dozen tokens lands near 1e-7..1e-6 (the running-max form rescales at every token); bfloat16 inputs: y within one
# bfloat16 ulp (2^-8) of the float64 result on the same rounded inputs, dk, dv rounded again, four ulps (2^-6).
F32_RTOL = 4e-6
BF16_Y_RTOL, BF16_GRAD_RTOL = 2.0**-8, 2.0**-6
CHUNK, BLOCK_C = 4, 4
B, T, C = 2, 13, 5  # 4 chunks, the last holding one token; 2 channel blocks, the last holding one channel.
PATHS = {"sequential": False, "parallel": True}
# The compiled forward's form (a chunk's tokens unrolled, the next chunk's rows loaded ahead), interpreted on the cases
# that reach its masking and reloading; elsewhere the interpreter's default, a fori_loop over tokens, does the same
# arithmetic.
UNROLLED = {"sequential_unrolled": False, "parallel_unrolled": True}
FORMS = {**PATHS, **UNROLLED}
NAMES = ("w", "u", "k", "v", "state.num", "state.den", "state.max")


def _inputs(seed, b=B, t=T, c=C, *, k_scale=1.0, w=None):
  """Random float32 (w, u, k, v, state): w = -exp(U(-3, 1)), a state with a/b ~ N(0, 1), max in [-2, 2]."""
  rng = np.random.default_rng(seed)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  w = -np.exp(rng.uniform(-3.0, 1.0, c)) if w is None else w
  u = rng.normal(0.0, 0.5, c)
  k = rng.normal(0.0, k_scale, (b, t, c))
  v = rng.normal(0.0, 1.0, (b, t, c))
  den = rng.uniform(0.5, 2.0, (b, c))
  state = (f32(den * rng.normal(0.0, 1.0, (b, c))), f32(den), f32(rng.uniform(-2.0, 2.0, (b, c))))
  return f32(w), f32(u), f32(k), f32(v), state


def _cotangents(seed, b=B, t=T, c=C):
  """Random weights for y, for a/b and log b of the final state, and for its raw (num, max)."""
  rng = np.random.default_rng(seed + 1000)
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, c),) + ((b, c),) * 4)


def _loss(cot, y, num, den, log_scale):
  """A random-weighted sum of the outputs. The final state enters as a/b and log b (scale-free) and also as the raw
  num and max, whose gradients depend on which log-scale the kernel picked: those parts are checked against the
  float64 reference carrying the same running max."""
  cy, cr, cb, cn, cm = cot
  return (jnp.sum(cy * y) + jnp.sum(cr * num / den) + jnp.sum(cb * (jnp.log(den) + log_scale))
          + jnp.sum(cn * num) + jnp.sum(cm * log_scale))


def _reference(w, u, k, v, state):
  """The recurrence in float64 with a running max like the kernel's (max_t = max(max_{t-1} + w, k_t)), so the raw
  (num, den, max) are comparable too; y and the update are written in plain (a, b) form."""
  num, den, mx = state

  def step(carry, kv):
    num, den, mx = carry
    k_t, v_t = kv
    a, b = num * jnp.exp(mx), den * jnp.exp(mx)  # Finite in float64 for the keys used here.
    bonus = jnp.exp(u + k_t)
    y_t = (a + bonus * v_t) / (b + bonus)
    new_mx = jnp.maximum(mx + w, k_t)
    scale = jnp.exp(-new_mx)
    return ((jnp.exp(w) * a + jnp.exp(k_t) * v_t) * scale, (jnp.exp(w) * b + jnp.exp(k_t)) * scale, new_mx), y_t

  (num, den, mx), y = jax.lax.scan(step, (num, den, mx), (jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)))
  return jnp.swapaxes(y, 0, 1), (num, den, mx)


@jax.jit
def _reference_and_grads(inputs, cot):
  def loss(inputs):
    y, state = _reference(*inputs)
    return _loss(cot, y, *state), (y, state)

  (_, out), grads = jax.value_and_grad(loss, has_aux=True)(inputs)
  return out, grads


def _run_reference(inputs, cot):
  with jax.enable_x64(True):
    to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))  # Exact for float32 and bfloat16 inputs.
    return jax.tree.map(np.asarray, _reference_and_grads(jax.tree.map(to64, inputs), jax.tree.map(to64, cot)))


def _unroll(path):
  return True if path in UNROLLED else None


def _kernel_fn(parallel, transform=lambda f: f, unroll=None):
  """(inputs, cot) -> ((y, state), grads of `_loss`), through the Pallas kernels."""
  forward = functools.partial(kernel.wkv4, chunk=CHUNK, block_c=BLOCK_C, parallel=parallel, unroll=unroll)

  def loss(inputs, cot):
    y, state = transform(forward)(*inputs)
    return _loss(cot, y.astype(jnp.float32), *state), (y, state)

  return jax.value_and_grad(loss, has_aux=True)


# One jitted function per path, shared by the tests so that equal shapes compile once.
_JITTED = {name: jax.jit(lambda i, c, p=parallel, u=_unroll(name): _kernel_fn(p, unroll=u)(i, c)[::-1])
           for name, parallel in FORMS.items()}


def _assert_close(actual, expected, rtol, what):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), what
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.max(np.abs(expected)), err_msg=what)


def _assert_matches_reference(path, inputs, cot, rtol=F32_RTOL, y_rtol=None, grad_rtol=None):
  grads, ((_, (y, state))) = _JITTED[path](inputs, cot)
  (y_ref, state_ref), grads_ref = _run_reference(inputs, cot)
  _assert_close(y, y_ref, y_rtol or rtol, "y")
  for name, s, s_ref in zip(("num", "den", "max"), state, state_ref):
    _assert_close(s, s_ref, rtol, f"final {name}")
  for name, g, g_ref in zip(NAMES, jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    _assert_close(g, g_ref, grad_rtol or rtol, f"grad {name}")
  return y, state, grads


@pytest.mark.parametrize("path", FORMS)
def test_matches_reference_odd_shapes_several_chunks(path):
  _assert_matches_reference(path, _inputs(0), _cotangents(0))


@pytest.mark.parametrize("path", FORMS)
def test_matches_reference_whole_chunks(path):
  # T a multiple of the chunk: no token is masked, and the unrolled sequential forward's last chunk reloads itself as
  # the chunk ahead.
  t = 3 * CHUNK
  _assert_matches_reference(path, _inputs(9, t=t), _cotangents(9, t=t))


@pytest.mark.parametrize("path", PATHS)
def test_extreme_decays_and_large_keys(path):
  # Decays near 0 (long memory) and near -20 (forgets within a token); keys up to ~±100, where e^k overflows
  # float32 and only the running-max form stays finite. The reference keeps the same max, so raw num, den, max and
  # their gradients compare directly.
  w = np.array([-1e-4, -1e-2, -19.0, -20.0, -0.5])
  _assert_matches_reference(path, _inputs(1, w=w, k_scale=30.0), _cotangents(1))


@pytest.mark.parametrize("path", FORMS)
def test_bfloat16_inputs(path):
  w, u, k, v, state = _inputs(2)
  inputs = (w, u, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), state)
  y, state, grads = _assert_matches_reference(
      path, inputs, _cotangents(2), y_rtol=BF16_Y_RTOL, grad_rtol=BF16_GRAD_RTOL)
  assert y.dtype == jnp.bfloat16 and grads[2].dtype == jnp.bfloat16 and grads[3].dtype == jnp.bfloat16
  assert all(s.dtype == jnp.float32 for s in state)


@pytest.mark.parametrize("path", PATHS)
def test_empty_state(path):
  w, u, k, v, _ = _inputs(3)
  empty = (jnp.zeros((B, C)), jnp.zeros((B, C)), jnp.full((B, C), EMPTY_MAX, jnp.float32))
  _assert_matches_reference(path, (w, u, k, v, empty), _cotangents(3))


def test_segmented_equals_whole():
  w, u, k, v, state = _inputs(4)
  run = jax.jit(kernel.wkv4, static_argnames=("chunk", "block_c", "parallel"))
  kw = {"chunk": CHUNK, "block_c": BLOCK_C}
  y_seq, s_seq = run(w, u, k, v, state, parallel=False, **kw)
  cut = 6  # Not a chunk boundary: the second segment starts mid-chunk of the whole run.
  y1, s1 = run(w, u, k[:, :cut], v[:, :cut], state, parallel=False, **kw)
  y2, s2 = run(w, u, k[:, cut:], v[:, cut:], s1, parallel=False, **kw)
  _assert_close(jnp.concatenate([y1, y2], axis=1), y_seq, F32_RTOL, "segmented y")
  a, b = (np.asarray(x, np.float64) * np.exp(np.asarray(s2[2], np.float64)) for x in s2[:2])
  a_whole, b_whole = (np.asarray(x, np.float64) * np.exp(np.asarray(s_seq[2], np.float64)) for x in s_seq[:2])
  _assert_close(a, a_whole, F32_RTOL, "segmented a")
  _assert_close(b, b_whole, F32_RTOL, "segmented b")


def test_checkpoint_vmap_and_ops_entry_point():
  inputs, cot = _inputs(5), _cotangents(5)
  expected = _JITTED["sequential"](inputs, cot)
  checkpointed = jax.jit(lambda i, c: _kernel_fn(False, jax.checkpoint)(i, c)[::-1])(inputs, cot)
  jax.tree.map(lambda x, y: _assert_close(x, y, F32_RTOL, "checkpoint"), checkpointed, expected)
  # vmap over three independent problems (their own w, u too), forward and gradients, equals one by one.
  stack = [_inputs(6 + i) for i in range(3)]
  batched = jax.jit(jax.vmap(_JITTED["sequential"]))(jax.tree.map(lambda *xs: jnp.stack(xs), *stack),
                                                     jax.tree.map(lambda *xs: jnp.stack(xs), *[cot] * 3))
  for i, one in enumerate(stack):
    jax.tree.map(lambda x, y, i=i: _assert_close(x[i], y, F32_RTOL, "vmap"), batched,
                 _JITTED["sequential"](one, cot))
  # The op's impl="pallas" runs the same kernels (default chunk and block: one chunk here) and matches the reference.
  y, s = jax.jit(lambda *a: ops_wkv4(*a, impl="pallas"))(*inputs)
  (y_ref, state_ref), _ = _run_reference(inputs, cot)
  _assert_close(y, y_ref, F32_RTOL, "ops y")
  jax.tree.map(lambda a, b: _assert_close(a, b, F32_RTOL, "ops state"), tuple(s), tuple(state_ref))


# The Pallas kernels in the gradient's jaxpr, without and with jax.checkpoint, per path.
KERNELS = {
    "sequential": (["wkv4_backward", "wkv4_forward"],
                   ["wkv4_backward", "wkv4_forward", "wkv4_forward_primal"]),
    "parallel": (["wkv4_chunk_adjoint", "wkv4_chunk_grads", "wkv4_chunk_output", "wkv4_chunk_summary"],
                 ["wkv4_chunk_adjoint", "wkv4_chunk_grads", "wkv4_chunk_output", "wkv4_chunk_output",
                  "wkv4_chunk_summary", "wkv4_chunk_summary"]),
}


@pytest.mark.parametrize("path", PATHS)
def test_pallas_under_remat_writes_checkpoints_once(path):
  """Under jax.checkpoint the forward pass runs the primal and only the recomputation writes checkpoints: on the
  sequential path the primal is the forward kernel without them; on the time-parallel one, whose forward writes
  nothing the second pass does not read, the same kernels. Without remat the forward writes them once."""
  inputs, cot = _inputs(8), _cotangents(8)
  forward = functools.partial(kernel.wkv4, chunk=CHUNK, block_c=BLOCK_C, parallel=PATHS[path], interpret=True)

  def loss(*inputs):
    y, state = forward(*inputs)
    return _loss(cot, y, *state), (y, state)

  grad = lambda fn: jax.grad(fn, argnums=2, has_aux=True)
  kernels = lambda fn: sorted(re.findall(r"name=(wkv4_\w+)", str(jax.make_jaxpr(grad(fn))(*inputs))))
  assert (kernels(loss), kernels(jax.checkpoint(loss))) == KERNELS[path]
  # Equal gradients, and equal outputs: under remat they come from the primal, without it from the forward rule.
  plain, rematted = (jax.jit(grad(fn))(*inputs) for fn in (loss, jax.checkpoint(loss)))
  jax.tree.map(np.testing.assert_array_equal, plain, rematted)


@pytest.mark.parametrize("path", FORMS)
def test_every_output_element_is_written(path):
  # Every pallas_call runs with its outputs aliased to NaN-filled buffers (int outputs: INT_MIN), on the padded
  # shapes, so an element no program writes keeps the poison. Padded rows and channels included.
  w, u, k, v, state = _inputs(7)
  parallel = FORMS[path]
  layout = kernel._Layout.make(B, T, C, CHUNK, BLOCK_C, parallel)
  w_p, u_p, state_p = layout.pad_params(w, u, state)
  k_p, v_p = layout.pad_seq(k), layout.pad_seq(v)
  forward = functools.partial(kernel._forward_parallel if parallel else kernel._forward_sequential,
                              unroll=_unroll(path))
  backward = kernel._backward_parallel if parallel else kernel._backward_sequential
  y, ckpts = jax.jit(functools.partial(forward, poison=True, **layout.kwargs()))(w_p, u_p, k_p, v_p, state_p)
  g_final = tuple(layout.pad_channels(g, 0.0) for g in _cotangents(7)[1:4])
  grads = jax.jit(functools.partial(backward, poison=True, **layout.kwargs()))(
      w_p, u_p, k_p, v_p, layout.pad_seq(_cotangents(7)[0]), ckpts, state_p, g_final)
  for name, x in [("y", y), *zip(("num", "den", "anchor"), ckpts), ("dk, dv, dw, du", grads[:4]),
                  ("dstate", grads[4])]:
    for leaf in jax.tree.leaves(x):
      assert np.all(np.isfinite(np.asarray(leaf))), name
  assert np.all(np.asarray(ckpts[3]) >= 0), "n"
  if not parallel:  # The primal kernel: y and the final state, equal to the last checkpoint (finite, checked).
    y_primal, final = jax.jit(functools.partial(forward, checkpoints=False, poison=True, **layout.kwargs()))(
        w_p, u_p, k_p, v_p, state_p)
    np.testing.assert_array_equal(y_primal, y)
    jax.tree.map(lambda f, c: np.testing.assert_array_equal(f, c[:, -1]), final, ckpts)
  # The poison really reaches the outputs: a kernel that writes nothing leaves every element NaN.
  nothing = lambda *refs: None
  spec = kernel.pl.BlockSpec((4,), lambda i: (i,))
  out = kernel._call(nothing, [jnp.ones(8)], [spec], [jax.ShapeDtypeStruct((8,), jnp.float32)], [spec], (2,),
                     poison=True, interpret=None, name="nothing")[0]
  assert np.all(np.isnan(np.asarray(out)))
