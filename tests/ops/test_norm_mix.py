"""A token-shift sub-layer's input stage, the norm and its token-shift mixes (`ltm_jax.ops.norm_mix`, which also
passes the stream through for the residual): the gradients of both backends against a float64 statement of the
formula written here, the Pallas backward
(`ltm_pallas.norm_mix`, interpreted on CPU) included, with every row of xn or only the last (the channel mix's
carried token); and the RWKV-7 model that normalises inside its time and channel mixes against the same model
normalising before them, value for value."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_gradients_close, logits_and_gradients, micro_config, random_model_params
from ltm_jax import model as lm
from ltm_jax import sublayers
from ltm_jax.ops import norm_mix as op
from ltm_pallas import norm_mix as kernel

EPS = 1e-5
M = 3
# The kernel's row layouts: (B, T, C). 2 x 24: three programs of one 16-row step, a sequence ending inside the second
# step, C = 48 in a 64-wide block with 16 columns masked. 1 x 256: two programs of 8 steps (the second program's
# first row reaches the first through the one-row block). 2 x 136: seventeen one-step programs, a sequence ending
# inside the ninth, each program's next row in the next program.
LAYOUTS = {"2x24x48": (2, 24, 48), "1x256x32": (1, 256, 32), "2x136x40": (2, 136, 40)}
# float32 against float64: sums over at most 256 rows, measured ~2e-7 of the largest magnitude. bfloat16 x, xn and
# cotangents (the reference reads the same rounded values): the mixes and xn are rounded once in the forward and the
# kernel rounds dx once; XLA's derivative rounds each elementwise step of the mixes' adjoint (measured 1.2e-2 for the
# shift fractions' gradient against the kernel's 1.6e-3), so it gets a looser bound.
F32_RTOL = 1e-5
BF16_RTOL = {"pallas": 2.0**-6, "xla": 2.0**-5}
NAMES = ("x", "last", "scale", "bias", "shifts")


def _inputs(seed, b, t, c, dtype):
  """Fresh random (x, last, scale, bias, shifts): x with a per-row offset and spread so the mean matters."""
  rng = np.random.default_rng(seed)
  x = rng.normal(0, 1, (b, t, c)) * rng.uniform(0.3, 3, (b, t, 1)) + rng.normal(0, 2, (b, t, 1))
  values = (x, rng.normal(0, 1, (b, c)), rng.normal(1, 0.3, c), rng.normal(0, 0.5, c), rng.uniform(0, 1, (M, c)))
  return tuple(jnp.asarray(v, dt) for v, dt in zip(values, (dtype,) + (jnp.float32,) * 4))


def _reference(x, last, scale, bias, shifts, kind, xn_rows="all"):
  """The formula in float64 jax.numpy."""
  xc = x - jnp.mean(x, axis=-1, keepdims=True) if kind == "layernorm" else x
  xn = xc / jnp.sqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + EPS) * scale
  if kind == "layernorm":
    xn = xn + bias
  prev = jnp.concatenate([last[:, None], xn[:, :-1]], axis=1)
  return x, xn if xn_rows == "all" else xn[:, -1], tuple(xn + (prev - xn) * s for s in shifts)


def _grads(fn, inputs, cotangents):
  _, vjp = jax.vjp(fn, *inputs)
  return vjp(cotangents)


@pytest.mark.parametrize("kind", op.KINDS)
@pytest.mark.parametrize("impl, layout, dtype", [("xla", "2x24x48", jnp.float32), ("xla", "2x24x48", jnp.bfloat16),
                                                 ("pallas", "2x24x48", jnp.bfloat16)] +
                         [("pallas", layout, jnp.float32) for layout in LAYOUTS],
                         ids=["xla-f32", "xla-bf16", "pallas-bf16"] + [f"pallas-{layout}-f32" for layout in LAYOUTS])
def test_gradients_match_float64(impl, layout, kind, dtype):
  """Every row layout for the kernel in float32, one in bfloat16 (the rounding of xn and dx); XLA's derivative at
  one layout (it does not depend on it)."""
  b, t, c = LAYOUTS[layout]
  inputs = _inputs(2 * list(LAYOUTS).index(layout) + op.KINDS.index(kind), b, t, c, dtype)
  rng = np.random.default_rng(7)
  cotangents = tuple(jnp.asarray(rng.normal(size=(b, t, c)), dtype) for _ in range(M + 2))  # x, xn, the mixes.
  run = lambda x, last, s, bias, shifts: op.norm_mix(x, last, s, bias if kind == "layernorm" else None, shifts,
                                                     kind=kind, eps=EPS, dtype=dtype, impl=impl)
  grads = jax.jit(lambda *a: _grads(run, a, (*cotangents[:2], cotangents[2:])))(*inputs)
  with jax.enable_x64(True):
    as64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    ref = _grads(lambda *v: _reference(*v, kind), [as64(v) for v in inputs],
                 (as64(cotangents[0]), as64(cotangents[1]), tuple(as64(v) for v in cotangents[2:])))
  rtol = F32_RTOL if dtype == jnp.float32 else BF16_RTOL[impl]
  for name, grad, want, given in zip(NAMES, grads, ref, inputs):
    if name == "bias" and kind == "rmsnorm":
      continue  # rmsnorm has none.
    assert grad.shape == given.shape and grad.dtype == given.dtype, name
    scale = np.abs(np.asarray(want)).max()
    assert scale > 0.1, name
    np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(want), rtol=0, atol=rtol * scale,
                               err_msg=f"d{name}")


@pytest.mark.parametrize("kind", op.KINDS)
def test_kernel_launch_settings_keep_the_gradients(kind):
  """The kernel with other launch settings (two steps a program, 16-column chunks over C = 40: three chunks, the last
  masked; 4 warps) against float64, float32: what benchmarks/norm_mix.py times."""
  b, t, c = 1, 256, 40
  inputs = _inputs(11 + op.KINDS.index(kind), b, t, c, jnp.float32)
  assert kernel.program_steps(b * t, max_steps=2) == 2
  rng = np.random.default_rng()
  cotangents = tuple(jnp.asarray(rng.normal(size=(b, t, c)), jnp.float32) for _ in range(M + 2))
  backward = functools.partial(op.pallas_backward, max_steps=2, chunk_columns=16, num_warps=4)
  run = op.with_backward(backward, kind=kind, eps=EPS, dtype=jnp.float32, xn_rows="all")
  bias = lambda v: v if kind == "layernorm" else jnp.zeros_like(v)
  grads = jax.jit(lambda x, last, s, b_, shifts: _grads(run, (x, last, s, bias(b_), shifts),
                                                         (*cotangents[:2], cotangents[2:])))(*inputs)
  with jax.enable_x64(True):
    as64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    ref = _grads(lambda *v: _reference(*v, kind), [as64(v) for v in inputs],
                 (as64(cotangents[0]), as64(cotangents[1]), tuple(as64(v) for v in cotangents[2:])))
  for name, grad, want in zip(NAMES, grads, ref):
    if name == "bias" and kind == "rmsnorm":
      continue
    scale = np.abs(np.asarray(want)).max()
    np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(want), rtol=0, atol=F32_RTOL * scale,
                               err_msg=f"d{name}")


@pytest.mark.parametrize("impl", op.AVAILABLE)
@pytest.mark.parametrize("kind", op.KINDS)
def test_last_row_only_gradients_match_float64(impl, kind):
  """xn_rows='last' with one mix, as the channel mix calls it: the last tokens' xn gradient (random here; zero in
  training, where the carried state is not differentiated) reaches their rows, the scale and the bias. float32,
  three programs of one step with a sequence ending inside the second (the last rows are 23 and 47). Tolerance 3e-5
  of the largest value: these inputs hold a row whose mean is ~10 times its spread, where flax's variance
  (E[x^2] - E[x]^2, which both backends' statistics follow) loses digits; measured 1.1e-5 there, in both backends,
  and 8e-8 in the last rows."""
  b, t, c = LAYOUTS["2x24x48"]
  inputs = _inputs(30 + op.KINDS.index(kind), b, t, c, jnp.float32)
  inputs = (*inputs[:4], inputs[4][:1])
  rng = np.random.default_rng(31)
  cot = (jnp.asarray(rng.normal(size=(b, t, c)), jnp.float32), jnp.asarray(rng.normal(size=(b, c)), jnp.float32),
         (jnp.asarray(rng.normal(size=(b, t, c)), jnp.float32),))
  run = lambda x, last, s, bias, shifts: op.norm_mix(x, last, s, bias if kind == "layernorm" else None, shifts,
                                                     kind=kind, eps=EPS, dtype=jnp.float32, impl=impl, xn_rows="last")
  assert run(*inputs)[1].shape == (b, c)
  grads = jax.jit(lambda *a: _grads(run, a, cot))(*inputs)
  with jax.enable_x64(True):
    as64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    ref = _grads(lambda *v: _reference(*v, kind, "last"), [as64(v) for v in inputs],
                 (as64(cot[0]), as64(cot[1]), (as64(cot[2][0]),)))
  for name, grad, want in zip(NAMES, grads, ref):
    if name == "bias" and kind == "rmsnorm":
      continue
    np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(want), rtol=0,
                               atol=3e-5 * np.abs(np.asarray(want)).max(), err_msg=f"d{name}")


def test_rwkv7_model_normalising_in_its_mixes_is_the_model_normalising_before_them(monkeypatch):
  """A float32 WWA model (two RWKV-7 blocks, one attention block) whose time and channel mixes take the stream and
  normalise it with their token shifts (impl='xla', what the CPU runs), against the same model with the norm modules
  before them as it was built before the op: the same parameters, identical logits and gradients. Then with the
  interpreted kernel backward: the same logits, the gradients of every parameter within float32 rounding. Random
  parameters, so that no zero-initialised projection hides a path."""
  cfg = micro_config(layer_pattern="WWA", n_layers=3, rwkv7_head_size=8, norm="layernorm").model
  tokens = jnp.asarray(np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 16)))
  params = random_model_params(lm.LM(cfg), tokens, 12)
  fused = logits_and_gradients(lm.LM(cfg), tokens, params)

  def unfused(entry):
    def build(site):
      cls, args = entry.build(site)
      return cls, {k: v for k, v in args.items() if k not in ("norm_kind", "norm_eps")}
    return entry._replace(build=build, normalizes_input=False)

  with monkeypatch.context() as patch:
    patch.setitem(sublayers.MIXER_KINDS, "rwkv7", unfused(sublayers.MIXER_KINDS["rwkv7"]))
    patch.setitem(sublayers.FFN_KINDS, "channel_mix7", unfused(sublayers.FFN_KINDS["channel_mix7"]))
    assert jax.tree.structure(random_model_params(lm.LM(cfg), tokens, 12)) == jax.tree.structure(params)
    unfused = logits_and_gradients(lm.LM(cfg), tokens, params)
  jax.tree.map(np.testing.assert_array_equal, fused, unfused)

  monkeypatch.setattr(op, "AUTO", {"cpu": "pallas"})
  logits, grads = logits_and_gradients(lm.LM(cfg), tokens, params)
  np.testing.assert_array_equal(logits, fused[0])  # The forward is the xla form's.
  assert_gradients_close(grads, fused[1], 1e-4)


def test_rows_the_kernel_does_not_take_run_xla_gradients():
  inputs = _inputs(3, 1, 13, 32, jnp.float32)
  assert not kernel.supported(13) and kernel.supported(48)
  full = lambda v: jnp.full((1, 13, 32), v)
  cot = full(-0.5), full(1.0), tuple(full(0.5 * (j + 1)) for j in range(M))
  run = lambda impl: _grads(lambda *a: op.norm_mix(*a, kind="layernorm", eps=EPS, dtype=jnp.float32, impl=impl),
                            inputs, cot)
  jax.tree.map(np.testing.assert_array_equal, run("pallas"), run("xla"))
  # Only the last rows of xn, which no gradient reaches (the pallas backend's backward is given None for them).
  without_xn = lambda impl: jax.grad(lambda *a: sum(jnp.sum(jnp.sin(t)) for t in jax.tree.leaves(op.norm_mix(
      *a, kind="layernorm", eps=EPS, dtype=jnp.float32, impl=impl, xn_rows="last")[::2])), argnums=range(5))(*inputs)
  jax.tree.map(np.testing.assert_array_equal, without_xn("pallas"), without_xn("xla"))


def test_shape_errors_and_unknown_impl_and_kind():
  x, last, s, b, shifts = _inputs(8, 2, 16, 32, jnp.float32)
  call = lambda *a, **k: op.norm_mix(*a, eps=EPS, dtype=jnp.float32, **k)
  with pytest.raises(ValueError, match="last"):
    call(x, last[:1], s, b, shifts, kind="layernorm")
  with pytest.raises(ValueError, match="shifts"):
    call(x, last, s, b, shifts[:, :4], kind="layernorm")
  with pytest.raises(ValueError, match="kind"):
    call(x, last, s, b, shifts, kind="groupnorm")
  with pytest.raises(ValueError, match="no bias"):
    call(x, last, s, b, shifts, kind="rmsnorm")
  with pytest.raises(ValueError, match="unknown impl"):
    call(x, last, s, b, shifts, kind="layernorm", impl="cuda")
  with pytest.raises(ValueError, match="xn_rows"):
    call(x, last, s, b, shifts, kind="layernorm", xn_rows="first")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: the Triton kernel is compiled only for one")
@pytest.mark.parametrize("dtype, xn_rows", [(jnp.float32, "all"), (jnp.bfloat16, "all"), (jnp.bfloat16, "last")],
                         ids=["f32", "bf16", "bf16-channel-mix"])
def test_compiled_kernel_matches_float64_on_a_gpu(dtype, xn_rows):
  """The Triton-compiled backward (impl='pallas' under jit on a GPU) at base_125m_rwkv7's width (six column chunks),
  two programs of eight steps and a sequence ending inside a program: gradients against float64 within the GPU
  tests' tolerances (tests/ops/test_gpu_kernels.py: 2e-3 in float32 for another summation order, 2^-5 in bfloat16).
  The time mix's three mixes, and the channel mix's one with xn's last rows (their gradient random)."""
  b, t, c = 4, 64, 768
  inputs = _inputs(21, b, t, c, dtype)
  mixes = M if xn_rows == "all" else 1
  inputs = (*inputs[:4], inputs[4][:mixes])
  rng = np.random.default_rng(22)
  xn_shape = (b, t, c) if xn_rows == "all" else (b, c)
  shapes = [(b, t, c), xn_shape] + [(b, t, c)] * mixes
  cotangents = tuple(jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes)
  run = lambda *a: op.norm_mix(*a, kind="layernorm", eps=EPS, dtype=dtype, impl="pallas", xn_rows=xn_rows)
  fn = lambda *a: _grads(run, a, (*cotangents[:2], cotangents[2:]))
  assert "__gpu$xla.gpu.triton" in jax.jit(fn).lower(*inputs).as_text()
  grads = jax.jit(fn)(*inputs)
  with jax.enable_x64(True):
    as64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    ref = _grads(lambda *v: _reference(*v, "layernorm", xn_rows), [as64(v) for v in inputs],
                 (as64(cotangents[0]), as64(cotangents[1]), tuple(as64(v) for v in cotangents[2:])))
  rtol = 2e-3 if dtype == jnp.float32 else 2.0**-5
  for name, grad, want in zip(NAMES, grads, ref):
    np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(want), rtol=0,
                               atol=rtol * np.abs(np.asarray(want)).max(), err_msg=f"d{name}")
