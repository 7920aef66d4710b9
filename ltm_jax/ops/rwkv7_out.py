"""The output stage of an RWKV-7 time-mix: per-head group norm of the WKV output, the r.k bonus and the output gate.

  out = ((groupnorm(y) * scale + bias) + rk * v) * g

with groupnorm per row and head over its N channels (mean and variance, eps added to the variance), rk the per-head
bonus sum_n(r * k * bonus) that the layer computes, v the values and g the output gate.

Backends (the first is the reference):
  xla:    the formula as JAX operations: the normalisation in float32, rounded to g's dtype after the affine and after
          the bonus term, then multiplied by g in that dtype (the RWKV-7 layer's own arithmetic).
  pallas: one kernel forward and one backward (`ltm_pallas.rwkv7_out`), float32 throughout and rounded once; shapes
          it does not take (B * T without a power-of-two factor of at least 8, a head size not a power of two) run
          the xla form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_pallas import rwkv7_out as kernel

AVAILABLE = ("xla", "pallas")

# cpu: xla (the Pallas kernels only run interpreted there, to be checked). gpu: pallas, by the deviceless step budget
# (benchmarks/step_budget.py on sm_90a): the XLA form's backward is seven fusions that write and re-read float32
# intermediates, the kernel's one pass reads y, v, g, rk and d_out and writes the four gradients.
AUTO = {"cpu": "xla", "gpu": "pallas"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "xla"}


def _check(y, rk, v, g, scale, bias):
  if y.ndim != 4:
    raise ValueError(f"rwkv7_out: y must be [B, T, H, N]; got {y.shape}")
  batch, length, heads, n = y.shape
  want = {"rk": (rk, (batch, length, heads)), "v": (v, (batch, length, heads * n)),
          "g": (g, (batch, length, heads * n)), "scale": (scale, (heads * n,)), "bias": (bias, (heads * n,))}
  bad = [f"{name} {x.shape} (want {shape})" for name, (x, shape) in want.items() if x.shape != shape]
  if bad:
    raise ValueError(f"rwkv7_out: y is {y.shape}; " + ", ".join(bad))


def xla(y, rk, v, g, scale, bias, *, eps):
  """The reference: the layer's arithmetic in JAX operations."""
  batch, length, heads, n = y.shape
  dtype = g.dtype
  yf = y.astype(jnp.float32)
  mean = jnp.mean(yf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(yf - mean), axis=-1, keepdims=True)
  yn = (yf - mean) * jax.lax.rsqrt(var + eps)
  z = (yn * scale.reshape(heads, n) + bias.reshape(heads, n)).astype(dtype)
  z = z + (rk[..., None] * v.reshape(batch, length, heads, n).astype(jnp.float32)).astype(dtype)
  return z.reshape(batch, length, heads * n) * g


def pallas(y, rk, v, g, scale, bias, *, eps, interpret=None):
  """The fused kernels on rows of [B * T, C]; the xla form where they do not take the shape."""
  batch, length, heads, n = y.shape
  rows, c = batch * length, heads * n
  if not kernel.supported(rows, n):
    return xla(y, rk, v, g, scale, bias, eps=eps)
  out = kernel.output(y.reshape(rows, c), rk.astype(jnp.float32).reshape(rows, heads).T, v.reshape(rows, c),
                      g.reshape(rows, c), scale.astype(jnp.float32), bias.astype(jnp.float32), n, float(eps),
                      kernel.block_rows_for(rows), interpret)
  return out.reshape(batch, length, c)


_BACKENDS = {"xla": xla, "pallas": pallas}


def rwkv7_out(y, rk, v, g, scale, bias, *, eps: float, impl: str = "auto") -> jax.Array:
  """((groupnorm(y) * scale + bias) + rk * v) * g.

  Args:
    y: [B, T, H, N] the WKV output.
    rk: [B, T, H] float32, the per-head bonus sum_n(r * k * bonus).
    v: [B, T, H * N] values; g: [B, T, H * N] the output gate, whose dtype the output takes.
    scale, bias: [H * N] the group norm's per-channel affine.
    eps: added to each head's variance.
    impl: "auto" (see AUTO; one token, T = 1, takes the reference) or one of AVAILABLE.

  Returns:
    [B, T, H * N] in g's dtype.
  """
  _check(y, rk, v, g, scale, bias)
  run = backend.select("rwkv7_out", impl, _BACKENDS, AUTO, length=y.shape[1], without_kernels=AUTO_WITHOUT_KERNELS)
  batch, _, heads, _ = y.shape
  # Rows and heads are independent, so both can be split over the mesh; channels follow the layer's "wkv" axis.
  fn = lambda y, rk, v, g, scale, bias: run(y, rk, v, g, scale, bias, eps=eps)
  return sharding.per_shard(fn, (y, rk, v, g, scale, bias),
                            in_axes=(("batch", None, "wkv", None), ("batch", None, "wkv"), ("batch", None, "wkv"),
                                     ("batch", None, "wkv"), ("wkv",), ("wkv",)),
                            out_axes=("batch", None, "wkv"), sizes={"batch": batch, "wkv": heads})
