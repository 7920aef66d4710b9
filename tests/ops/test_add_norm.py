"""The residual add and the norm after it (`ltm_jax.ops.add_norm`): its backends' values and gradients against a
float64 statement of the formula written here, the Pallas kernels (`ltm_pallas.add_norm`, interpreted on CPU)
included, and the XLA form against the add followed by flax's own norm modules, value for value."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_gradients_close, logits_and_gradients, micro_config, random_model_params
from ltm_jax import model as lm
from ltm_jax.layers.common import norm
from ltm_jax.layers.add_norm import AddNorm
from ltm_jax.ops import add_norm as op
from ltm_pallas import add_norm as kernel

# B * T = 48 rows: forward blocks of 16; backward programs of 16 rows, each in two steps of 8 that carry its partial
# sums of ds and db (three programs' partial sums add up). C = 48 also runs in 64-wide blocks with the last 16 columns
# masked. A float32 d has the stream's dtype (the backward writes its gradient once), a bfloat16 d does not.
B, T, C = 2, 24, 64
EPS = 1e-5
# float32 against float64: sums over C = 64 terms, measured ~1e-6 of the largest magnitude. bfloat16 d and h (the
# reference reads the same rounded d): h is rounded once, the gradients of d once (2^-8 each), a few ulps of margin.
F32_RTOL = 1e-5
BF16_RTOL, BF16_GRAD_RTOL = 4 * 2.0**-8, 4 * 2.0**-8
NAMES = ("x", "d", "scale", "bias")


def _inputs(seed, d_dtype=jnp.float32, b=B, t=T, c=C):
  """Fresh random (x, d, scale, bias): x with a per-row offset and spread so the mean matters, d smaller."""
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 1, (b, t, c)) * rng.uniform(0.3, 3, (b, t, 1)) + rng.normal(0, 2, (b, t, 1))
  arrays = (x, rng.normal(0, 0.7, (b, t, c)), rng.normal(1.0, 0.3, c), rng.normal(0, 0.5, c))
  dtypes = (jnp.float32, d_dtype, jnp.float32, jnp.float32)
  return tuple(jnp.asarray(v, dt) for v, dt in zip(arrays, dtypes))


def _reference(x, d, scale, bias, kind):
  """The formula in float64 jax.numpy (differentiable for the reference gradients)."""
  x_new = x + d
  xc = x_new - jnp.mean(x_new, axis=-1, keepdims=True) if kind == "layernorm" else x_new
  h = xc / jnp.sqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + EPS) * scale
  return x_new, h + bias if kind == "layernorm" else h


def _cotangents(seed, dtype, c=C):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(B, T, c)), jnp.float32), jnp.asarray(rng.normal(size=(B, T, c)), dtype)


def _run(impl, kind, dtype):
  """The op as a function of (x, d, scale, bias); rmsnorm has no bias, so its gradient there is zero."""
  if kind == "rmsnorm":
    return lambda x, d, s, b: op.add_norm(x, d, s, kind=kind, eps=EPS, dtype=dtype, impl=impl)
  return lambda x, d, s, b: op.add_norm(x, d, s, b, kind=kind, eps=EPS, dtype=dtype, impl=impl)


def _value_and_grads(fn, inputs, cotangents):
  out, vjp = jax.vjp(fn, *inputs)
  return out, vjp(tuple(c.astype(o.dtype) for c, o in zip(cotangents, out)))


def _float64(inputs, cotangents, kind):
  with jax.enable_x64(True):
    as64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    out, grads = _value_and_grads(lambda *v: _reference(*v, kind), [as64(v) for v in inputs],
                                  tuple(as64(c) for c in cotangents))
    return [np.asarray(o) for o in out], [np.asarray(g) for g in grads]


def _close(actual, expected, rtol, what):
  scale = np.abs(expected).max()
  assert scale > 0.1, what  # Not trivially small.
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("c", [C, 48], ids=["C64", "C48-masked"])
@pytest.mark.parametrize("kind", op.KINDS)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_values_and_gradients_match_float64(impl, kind, c):
  inputs, cotangents = _inputs(0, c=c), _cotangents(1, jnp.float32, c)
  out, grads = _value_and_grads(_run(impl, kind, jnp.float32), inputs, cotangents)
  ref_out, ref_grads = _float64(inputs, cotangents, kind)
  for name, o, ref in zip(("x_new", "h"), out, ref_out):
    _close(o, ref, F32_RTOL, name)
  names = NAMES if kind == "layernorm" else NAMES[:3]  # rmsnorm has no bias.
  for name, grad, ref in zip(names, grads, ref_grads):
    assert grad.shape == ref.shape and grad.dtype == inputs[NAMES.index(name)].dtype, name
    _close(grad, ref, F32_RTOL, f"d{name}")


@pytest.mark.parametrize("kind", op.KINDS)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bfloat16_sublayer_output_and_norm_within_rounding_of_float64(impl, kind):
  """The model's mix: a float32 stream, a bfloat16 sub-layer output and a bfloat16 norm output."""
  inputs, cotangents = _inputs(2, jnp.bfloat16), _cotangents(3, jnp.bfloat16)
  out, grads = _value_and_grads(_run(impl, kind, jnp.bfloat16), inputs, cotangents)
  assert [o.dtype for o in out] == [jnp.float32, jnp.bfloat16]
  assert grads[1].dtype == jnp.bfloat16
  ref_out, ref_grads = _float64(inputs, cotangents, kind)
  _close(out[0], ref_out[0], F32_RTOL, "x_new")
  _close(out[1], ref_out[1], BF16_RTOL, "h")
  names = NAMES if kind == "layernorm" else NAMES[:3]
  for name, grad, ref in zip(names, grads, ref_grads):
    _close(grad, ref, BF16_GRAD_RTOL if name == "d" else F32_RTOL, f"d{name}")


@pytest.mark.parametrize("stream", [jnp.float32, jnp.bfloat16], ids=["f32-stream", "bf16-stream"])
@pytest.mark.parametrize("kind", op.KINDS)
def test_xla_form_is_the_add_then_flax_norm_exactly(kind, stream):
  """impl='xla' (what the CPU runs) against `x + d` then `ltm_jax.layers.common.norm`'s flax module, under jit:
  identical values and gradients, so the model computes on CPU what it computed before the op existed."""
  x, d, _, _ = _inputs(4, jnp.bfloat16)
  x = x.astype(stream)
  module = norm(kind, EPS, jnp.bfloat16, "n")
  fused = AddNorm(kind, EPS, jnp.bfloat16, impl="xla")
  params = jax.tree.map(lambda p: p + jnp.asarray(np.random.default_rng(5).normal(0, 0.3, p.shape), p.dtype),
                        nn.meta.unbox(module.init(jax.random.key(0), x)["params"]))
  assert jax.tree.structure(params) == jax.tree.structure(nn.meta.unbox(fused.init(jax.random.key(0), x, d)["params"]))

  def before(params, x, d):
    x_new = x + d.astype(x.dtype)
    return x_new, module.apply({"params": params}, x_new)

  after = lambda params, x, d: fused.apply({"params": params}, x, d)
  cot = _cotangents(6, jnp.bfloat16)
  for got, want in zip(jax.jit(lambda *a: _value_and_grads(after, a, cot))(params, x, d),
                       jax.jit(lambda *a: _value_and_grads(before, a, cot))(params, x, d)):
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_rwkv7_model_with_the_kernels_matches_the_xla_form(monkeypatch):
  """A float32 WWA model (two RWKV-7 blocks, one attention block) whose 'auto' takes the interpreted kernels, against
  the same model with the XLA form: logits and the gradients of every parameter, at random parameters (so that no
  zero-initialised projection hides a path)."""
  cfg = micro_config(layer_pattern="WWA", n_layers=3, rwkv7_head_size=8, norm="layernorm").model
  model = lm.LM(cfg)
  tokens = jnp.asarray(np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 16)))
  params = random_model_params(model, tokens, 12)
  logits_xla, grads_xla = logits_and_gradients(model, tokens, params)
  monkeypatch.setattr(op, "AUTO", {"cpu": "pallas"})
  logits_pallas, grads_pallas = logits_and_gradients(model, tokens, params)
  _close(logits_pallas, np.asarray(logits_xla, np.float64), 1e-5, "logits")
  assert_gradients_close(grads_pallas, grads_xla, 1e-4)


def test_shapes_the_kernels_do_not_take_run_the_xla_form():
  inputs = _inputs(7, t=13)
  assert not kernel.supported(B * 13, C) and kernel.supported(B * T, 48)
  for got, want in zip(_run("pallas", "layernorm", jnp.float32)(*inputs), _run("xla", "layernorm", jnp.float32)(*inputs)):
    np.testing.assert_array_equal(got, want)


def test_auto_leaves_a_token_shifted_bfloat16_stream_to_xla(monkeypatch):
  """"auto" hands the backend choice on (the kernels on a GPU) except for a bfloat16 stream whose norm feeds a token
  shift, which takes the xla form (XLA keeps the shift inside its normalising pass)."""
  chosen = []
  real = op.backend.select
  monkeypatch.setattr(op.backend, "select",
                      lambda name, impl, *a, **k: chosen.append(impl) or real(name, impl, *a, **k))
  x, d, s, b = _inputs(11, jnp.bfloat16)
  for stream in (jnp.float32, jnp.bfloat16):
    for shifted in (False, True):
      op.add_norm(x.astype(stream), d, s, b, kind="layernorm", eps=EPS, dtype=jnp.bfloat16, token_shifted=shifted)
  assert chosen == ["auto", "auto", "auto", "xla"]


def test_shape_errors_and_unknown_impl_and_kind():
  x, d, s, b = _inputs(8)
  with pytest.raises(ValueError, match="bias"):
    op.add_norm(x, d, s, b[:4], kind="layernorm", eps=EPS, dtype=jnp.float32)
  with pytest.raises(ValueError, match="kind"):
    op.add_norm(x, d, s, b, kind="groupnorm", eps=EPS, dtype=jnp.float32)
  with pytest.raises(ValueError, match="no bias"):
    op.add_norm(x, d, s, b, kind="rmsnorm", eps=EPS, dtype=jnp.float32)
  with pytest.raises(ValueError, match="unknown impl"):
    op.add_norm(x, d, s, b, kind="layernorm", eps=EPS, dtype=jnp.float32, impl="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the Triton kernels are compiled only for one")
@pytest.mark.parametrize("kind", op.KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_kernels_match_float64_on_a_gpu(dtype, kind):
  """The Triton-compiled kernels (impl='pallas' under jit on a GPU): values and gradients against float64, within
  the GPU tests' tolerances (tests/ops/test_gpu_kernels.py: 2e-3 in float32 for another summation order, 2^-5 in
  bfloat16)."""
  inputs, cotangents = _inputs(9, dtype), _cotangents(10, dtype)
  fn = lambda *v: _value_and_grads(_run("pallas", kind, dtype), v, cotangents)
  assert "__gpu$xla.gpu.triton" in jax.jit(fn).lower(*inputs).as_text()
  out, grads = jax.jit(fn)(*inputs)
  ref_out, ref_grads = _float64(inputs, cotangents, kind)
  rtol = 2e-3 if dtype == jnp.float32 else 2.0**-5
  names = NAMES if kind == "layernorm" else NAMES[:3]
  for name, got, want in zip(("x_new", "h") + tuple(f"d{n}" for n in names), (*out, *grads), (*ref_out, *ref_grads)):
    _close(got, want, rtol, name)
