"""A residual add and the norm after it, as every block does between its sub-layers:

  x_new = x + d,  h = norm(x_new) * scale (+ bias)

with x the residual stream, d a sub-layer's output (cast to x's dtype) and norm a LayerNorm or RMSNorm over the last
axis, its statistics in float32 and h rounded to `dtype`.

Backends (the first is the reference):
  xla:    the formula as JAX operations, in flax's arithmetic (`nn.LayerNorm` / `nn.RMSNorm` with dtype=`dtype`,
          param_dtype float32, as `ltm_jax.layers.common.norm` builds them): the same values as the add followed by
          those modules.
  pallas: one kernel forward and one backward (`ltm_pallas.add_norm`), float32 throughout and rounded once (the
          variance as the mean of squared deviations); B * T without a power-of-two factor of at least 8 runs the
          xla form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_pallas import add_norm as kernel

AVAILABLE = ("xla", "pallas")
KINDS = kernel.KINDS

# cpu: xla (the Pallas kernels only run interpreted there, to be checked). gpu: pallas, by the deviceless step budget
# (benchmarks/step_budget.py on sm_90a, docs/kernels.md, benchmarks/results/rwkv7-block-norm-h100-aot.json): XLA's
# form is two passes over the stream forward (the add with the statistics, then the normalisation re-reading x_new)
# and three or four backward; small_rwkv7 32 x 1024 39.72 -> 39.45 ms predicted.
AUTO = {"cpu": "xla", "gpu": "pallas"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "xla"}
# Streams "auto" gives the kernels whatever follows the norm. A bfloat16 stream (model.residual_dtype) whose h feeds
# a token shift (`token_shifted`: the RWKV-4 channel mix; RWKV-7's normalises its input itself, `ops.norm_mix`) takes
# the xla form: XLA's two passes then move about the kernel's bytes and keep the shift inside the normalisation's
# fusion, which the kernel's output breaks (measured with the RWKV-7 channel mix then: small_rwkv7 32 x 1024,
# deviceless sm_90a step budget: 37.11 ms with the xla form, 37.56 with the kernels; with the kernels' backward
# writing d's gradient once and fewer partial sums, 35.37 against 35.67). Followed by a matmul (SwiGLU) the
# kernels win at either stream: base_125m 64 x 2048 238.5 -> 235.4 ms (step-budget-base_125m-addnorm-h100-aot.json.gz).
AUTO_STREAMS = ("float32",)


def _check(x, d, scale, bias, kind):
  if kind not in KINDS:
    raise ValueError(f"add_norm: kind must be one of {KINDS}; got {kind!r}")
  if x.ndim != 3 or d.shape != x.shape:
    raise ValueError(f"add_norm: x and d must be [B, T, C] of one shape; got {x.shape} and {d.shape}")
  bad = [f"{name} {v.shape}" for name, v in (("scale", scale), ("bias", bias)) if v.shape != x.shape[-1:]]
  if bad:
    raise ValueError(f"add_norm: x is {x.shape}; " + ", ".join(bad) + f" (want ({x.shape[-1]},))")


def statistics(x, *, kind, eps, dtype):
  """(mean, 1 / sqrt(var + eps)) [..., 1] float32 over the last axis in flax's arithmetic (`_compute_stats`; the
  mean is zero for rmsnorm, var its mean square)."""
  xf = x.astype(jnp.promote_types(dtype, jnp.float32))
  if kind == "layernorm":
    square = jax.lax.square(xf)  # Before the mean, as flax: the backward then sums x's cotangents in its order.
    mean, mean2 = xf.mean(-1), square.mean(-1)
    var = jnp.maximum(0.0, mean2 - jax.lax.square(mean))
  else:
    var = jax.lax.square(xf).mean(-1)
    mean = jnp.zeros_like(var)
  return mean[..., None], jax.lax.rsqrt(var[..., None] + eps)


def normalize(x, scale, bias, *, kind, eps, dtype, stats=None):
  """norm(x) * scale (+ bias) over the last axis in flax's arithmetic (`statistics`, then the affine and the final
  cast as `_normalize`): the values of `ltm_jax.layers.common.norm`'s module, in `dtype`. `stats`: `statistics(x)`
  when the caller has them."""
  mean, rstd = statistics(x, kind=kind, eps=eps, dtype=dtype) if stats is None else stats
  y = (x - mean) * (rstd * scale.reshape(1, 1, -1))
  if kind == "layernorm":
    y = y + bias.reshape(1, 1, -1)
  return jnp.asarray(y, dtype)


def xla(x, d, scale, bias, *, kind, eps, dtype):
  """The reference: the add, then flax's normalisation arithmetic (`normalize`)."""
  x_new = x + d.astype(x.dtype)
  return x_new, normalize(x_new, scale, bias, kind=kind, eps=eps, dtype=dtype)


def pallas(x, d, scale, bias, *, kind, eps, dtype, interpret=None):
  """The fused kernels on rows of [B * T, C]; the xla form where they do not take the shape."""
  batch, length, c = x.shape
  rows = batch * length
  if not kernel.supported(rows, c):
    return xla(x, d, scale, bias, kind=kind, eps=eps, dtype=dtype)
  f32 = lambda t: t.astype(jnp.float32)
  x_new, h = kernel.add_norm(x.reshape(rows, c), d.reshape(rows, c), f32(scale), f32(bias), kind, float(eps),
                             jnp.dtype(dtype), kernel.row_block(rows, c), interpret)
  return x_new.reshape(x.shape), h.reshape(x.shape)


_BACKENDS = {"xla": xla, "pallas": pallas}


def add_norm(x, d, scale, bias=None, *, kind: str, eps: float, dtype, impl: str = "auto", token_shifted: bool = False):
  """(x_new, h) of the module docstring.

  Args:
    x: [B, T, C] the residual stream; d: [B, T, C] a sub-layer's output, any float dtype.
    scale, bias: [C] float32, the norm's affine (bias None for rmsnorm, which has none, and given for layernorm).
    kind: "layernorm" or "rmsnorm"; eps: added to the variance (mean square for rmsnorm).
    dtype: h's dtype.
    impl: "auto" (see AUTO and AUTO_STREAMS; one token, T = 1, takes the reference) or one of AVAILABLE.
    token_shifted: whether h feeds a token shift (each position also reads the previous one's h), which "auto"
      weighs for streams outside AUTO_STREAMS. Values are the same either way.

  Returns:
    x_new: [B, T, C] in x's dtype; h: [B, T, C] in `dtype`.
  """
  if (bias is None) != (kind == "rmsnorm"):
    raise ValueError(f"add_norm: {kind} takes {'no bias' if kind == 'rmsnorm' else 'a bias'}")
  if bias is None:
    bias = jnp.zeros_like(scale)  # Read by neither backend for rmsnorm; keeps one signature.
  _check(x, d, scale, bias, kind)
  if impl == "auto" and token_shifted and jnp.dtype(x.dtype).name not in AUTO_STREAMS:
    impl = "xla"
  run = backend.select("add_norm", impl, _BACKENDS, AUTO, length=x.shape[1], without_kernels=AUTO_WITHOUT_KERNELS)
  # Rows are independent but each needs all of its channels: only the batch is split over the mesh.
  fn = lambda *args: run(*args, kind=kind, eps=eps, dtype=dtype)
  seq, vec = ("batch", None, None), (None,)
  return sharding.per_shard(fn, (x, d, scale, bias), in_axes=(seq, seq, vec, vec), out_axes=(seq, seq),
                            sizes={"batch": x.shape[0]})
