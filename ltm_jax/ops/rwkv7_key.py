"""The key side of an RWKV-7 time-mix before WKV-7: the in-context learning rate, the normalised key and the delta
rule's inputs, the key WKV-7 writes and the per-head r.k bonus sums.

  a = sigmoid(base + z),  kk = normalize_head(k * scale),  neg_kk = -kk,  b = kk * a,
  k2 = k * (1 + (a - 1) * mix),  rk = sum_head(r * k2 * bonus)

with z the learning rate's low-rank term, base its per-channel base, and normalize_head dividing each row's head of
N channels by max(its L2 norm, eps).

Backends (the first is the reference):
  xla:    the formula as JAX operations, in the RWKV-7 layer's arithmetic: products in k's dtype, the norm in float32
          and rounded to k's dtype, the bonus sums accumulated in float32.
  pallas: one kernel forward and one backward (`ltm_pallas.rwkv7_key`), float32 throughout and rounded once; shapes
          it does not take (B * T without a power-of-two factor of at least 8, a head size not a power of two) run
          the xla form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_pallas import rwkv7_key as kernel

AVAILABLE = ("xla", "pallas")

# cpu: xla (the Pallas kernels only run interpreted there, to be checked). gpu: pallas, by the deviceless step budget
# (benchmarks/step_budget.py on sm_90a, docs/kernels.md): XLA's form is a dozen fusions a layer that re-read k, a
# and r and write float32 intermediates in the backward; the kernels read each once a pass.
AUTO = {"cpu": "xla", "gpu": "pallas"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "xla"}


def _check(k, z, r, base, scale, mix, bonus, head_size):
  if k.ndim != 3 or k.shape[-1] % head_size:
    raise ValueError(f"rwkv7_key: k must be [B, T, C] with C a multiple of head_size={head_size}; got {k.shape}")
  bad = [f"{name} {x.shape}" for name, x in (("z", z), ("r", r)) if x.shape != k.shape]
  bad += [f"{name} {x.shape}" for name, x in (("base", base), ("scale", scale), ("mix", mix), ("bonus", bonus))
          if x.shape != k.shape[-1:]]
  if bad:
    raise ValueError(f"rwkv7_key: k is {k.shape}; " + ", ".join(bad) + f" (want {k.shape} and ({k.shape[-1]},))")


def xla(k, z, r, base, scale, mix, bonus, *, head_size, eps):
  """The reference: the layer's arithmetic in JAX operations."""
  batch, length, c = k.shape
  dtype = k.dtype
  a = jax.nn.sigmoid(base.astype(dtype) + z)
  to_heads = lambda t: t.reshape(batch, length, c // head_size, head_size)
  kk = to_heads(k * scale.astype(dtype)).astype(jnp.float32)
  # max(|kk|, eps) as sqrt(max(|kk|^2, eps^2)): the same value, and a zero head's gradient is 1 / eps, not NaN.
  kk = (kk / jnp.sqrt(jnp.maximum(jnp.sum(kk * kk, axis=-1, keepdims=True), eps * eps))).astype(dtype)
  k2 = k * (1 + (a - 1) * mix.astype(dtype))
  rk = jnp.sum(to_heads(r * k2 * bonus.astype(dtype)), axis=-1, dtype=jnp.float32)
  return -kk, kk * to_heads(a), k2, rk


def pallas(k, z, r, base, scale, mix, bonus, *, head_size, eps, interpret=None):
  """The fused kernels on rows of [B * T, C]; the xla form where they do not take the shape."""
  batch, length, c = k.shape
  rows, heads = batch * length, c // head_size
  if not kernel.supported(rows, head_size):
    return xla(k, z, r, base, scale, mix, bonus, head_size=head_size, eps=eps)
  f32 = lambda t: t.astype(jnp.float32)
  tile = lambda t: t.astype(k.dtype).reshape(rows, c)
  neg_kk, b, k2, rk = kernel.key_side(tile(k), tile(z), tile(r), f32(scale), f32(mix), f32(bonus), f32(base),
                                      head_size, float(eps), kernel.block_rows_for(rows), interpret)
  shape = (batch, length, heads, head_size)
  return neg_kk.reshape(shape), b.reshape(shape), k2.reshape(batch, length, c), rk.T.reshape(batch, length, heads)


_BACKENDS = {"xla": xla, "pallas": pallas}


def rwkv7_key(k, z, r, base, scale, mix, bonus, *, head_size: int, eps: float, impl: str = "auto"):
  """(neg_kk, b, k2, rk) of the module docstring.

  Args:
    k, z, r: [B, T, C] the key, the in-context learning rate's low-rank term and the receptance, one dtype.
    base, scale, mix, bonus: [C] the learning rate's base, the key-norm scale, the key's iclr mix and the bonus.
    head_size: N, the channels of a head (C = H * N).
    eps: the floor of a head's key norm.
    impl: "auto" (see AUTO; one token, T = 1, takes the reference) or one of AVAILABLE.

  Returns:
    neg_kk, b: [B, T, H, N]; k2: [B, T, C], all in k's dtype; rk: [B, T, H] float32.
  """
  _check(k, z, r, base, scale, mix, bonus, head_size)
  run = backend.select("rwkv7_key", impl, _BACKENDS, AUTO, length=k.shape[1], without_kernels=AUTO_WITHOUT_KERNELS)
  batch, _, c = k.shape
  # Rows and heads are independent, so both can be split over the mesh; channels follow the layer's "wkv" axis.
  fn = lambda *args: run(*args, head_size=head_size, eps=eps)
  seq, vec, heads = ("batch", None, "wkv"), ("wkv",), ("batch", None, "wkv", None)
  return sharding.per_shard(fn, (k, z, r, base, scale, mix, bonus), in_axes=(seq, seq, seq, vec, vec, vec, vec),
                            out_axes=(heads, heads, seq, ("batch", None, "wkv")),
                            sizes={"batch": batch, "wkv": c // head_size})
