"""A token-shift sub-layer's input stage: the norm of the residual stream, then the token-shift mixes of its output
(the RWKV-7 time mix's receptance, key and value inputs):

  xn = norm(x) * scale (+ bias),  prev_t = xn_{t-1} (last at t = 0),  mix_j = xn + (prev - xn) * shift_j

with norm a LayerNorm or RMSNorm over the last axis in flax's arithmetic (`add_norm.normalize`), and xn, prev and the
mixes in `dtype`, as the layer computes them. The op also returns x unchanged, for the caller's residual add: x's
gradient from there then joins the op's backward instead of being added after it. A caller that reads xn only for
the token it carries to its next call (the RWKV-7 channel mix) asks for that row alone (`xn_rows="last"`).

Backends (the first is the reference):
  xla:    the formula as JAX operations; XLA differentiates it. Its backward reads every mix's gradient three times
          (the norm's two passes over the summed gradient, and the shift fractions' sums) and adds the token shift's
          share and the residual's gradient in passes of their own.
  pallas: the xla form forward; one kernel backward (`ltm_pallas.norm_mix`) that sums each row's gradient from the
          mixes (its own token's and the next one's), takes the norm's backward and the parameters' partial sums in
          one pass; B * T not a multiple of 16 runs the xla form's derivative.
The backends differ only in the backward (`xla_backward`, `pallas_backward`), which is all "auto" chooses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ltm_jax.ops import backend, sharding
from ltm_jax.ops.add_norm import normalize, statistics
from ltm_pallas import norm_mix as kernel
from ltm_pallas.backend import first_order_only

AVAILABLE = ("xla", "pallas")
KINDS = kernel.KINDS
XN_ROWS = ("all", "last")  # What the op returns of xn: every row, or each sequence's last (the carried token).

# cpu: xla (the kernel only runs interpreted there, to be checked). gpu: xla, as measured on an H200: in small_rwkv7's
# step its twelve kernels took 3.98 ms (563 GB/s; priced at 0.77 ms), while the step budget prices XLA's derivative
# at 0.64 ms more than that price and measured XLA's fusions at 0.7-1.3 times their prices
# (benchmarks/results/step-budget-small_rwkv7-nvidia-h200.json.gz, docs/kernels.md).
AUTO = {"cpu": "xla", "gpu": "xla"}
# On a GPU where this jax cannot compile the Pallas kernels (no Triton lowering, `ltm_pallas.backend.gpu_lowering`).
AUTO_WITHOUT_KERNELS = {"gpu": "xla"}
_SECOND_ORDER = ("norm_mix: impl='pallas' (the Pallas kernel of the norm and token-shift mixes' backward) has no "
                 "second derivative; impl='xla' has one")


def _check(x, last, scale, bias, shifts, kind):
  if kind not in KINDS:
    raise ValueError(f"norm_mix: kind must be one of {KINDS}; got {kind!r}")
  if x.ndim != 3:
    raise ValueError(f"norm_mix: x must be [B, T, C]; got {x.shape}")
  batch, _, c = x.shape
  want = {"last": (batch, c), "scale": (c,), "bias": (c,)}
  bad = [f"{name} {v.shape} (want {want[name]})" for name, v in (("last", last), ("scale", scale), ("bias", bias))
         if v.shape != want[name]]
  if shifts.ndim != 2 or shifts.shape[1] != c:
    bad.append(f"shifts {shifts.shape} (want (M, {c}))")
  if bad:
    raise ValueError(f"norm_mix: x is {x.shape}; " + ", ".join(bad))


def _forward(x, last, scale, bias, shifts, *, kind, eps, dtype, xn_rows):
  """((x, xn or its last rows, mixes), the norm's statistics (mean, rstd) [B, T, 1] float32)."""
  stats = statistics(x, kind=kind, eps=eps, dtype=dtype)
  xn = normalize(x, scale, bias, kind=kind, eps=eps, dtype=dtype, stats=stats)
  delta = jnp.concatenate([last[:, None].astype(xn.dtype), xn[:, :-1]], axis=1) - xn
  mixes = tuple(xn + delta * shift.astype(xn.dtype) for shift in shifts)
  return (x, xn if xn_rows == "all" else xn[:, -1], mixes), stats


def xla(x, last, scale, bias, shifts, *, kind, eps, dtype, xn_rows="all"):
  """The reference: the norm, then the token shift and the mixes in `dtype`, as the layers compute them."""
  return _forward(x, last, scale, bias, shifts, kind=kind, eps=eps, dtype=dtype, xn_rows=xn_rows)[0]


def xla_backward(x, last, scale, bias, shifts, stats, dres, dxn, dmixes, *, kind, eps, dtype, xn_rows="all"):
  """The gradients of (x, last, scale, bias, shifts) given the cotangents of the outputs (x, xn or its last rows,
  the mixes; dxn None: xn's are zero): XLA's derivative of the reference (`stats`, the forward's statistics,
  unused)."""
  del stats
  fn = functools.partial(xla, kind=kind, eps=eps, dtype=dtype, xn_rows=xn_rows)
  outputs, vjp = jax.vjp(fn, x, last, scale, bias, shifts)
  return vjp((dres, jnp.zeros_like(outputs[1]) if dxn is None else dxn, tuple(dmixes)))


def pallas_backward(x, last, scale, bias, shifts, stats, dres, dxn, dmixes, *, kind, eps, dtype, xn_rows="all",
                    interpret=None, **settings):
  """`xla_backward`'s gradients from the kernel (`ltm_pallas.norm_mix`), plus the sequences' first tokens' terms
  through the carried token (and with xn_rows "last" and dxn given, the last tokens' through xn); `xla_backward`
  where the kernel does not take the rows. settings: the kernel's launch settings (`ltm_pallas.norm_mix.backward`)."""
  batch, length, c = x.shape
  rows = batch * length
  if not kernel.supported(rows):
    return xla_backward(x, last, scale, bias, shifts, stats, dres, dxn, dmixes, kind=kind, eps=eps, dtype=dtype,
                        xn_rows=xn_rows)
  xn_dtype = jnp.dtype(dtype)
  mu = shifts.astype(xn_dtype).astype(jnp.float32)  # The fractions as the forward's mixes used them.
  mean, rstd = (t.astype(jnp.float32).reshape(rows) for t in stats)
  dx, ds, db, dmu = kernel.backward(x.reshape(rows, c), mean, rstd, scale.astype(jnp.float32),
                                    bias.astype(jnp.float32), mu, dres.astype(x.dtype).reshape(rows, c),
                                    dxn.reshape(rows, c) if xn_rows == "all" and dxn is not None else None,
                                    [d.reshape(rows, c) for d in dmixes], kind=kind, length=length,
                                    xn_dtype=xn_dtype, interpret=interpret, **settings)
  dx = dx.reshape(x.shape)
  # Each sequence's first token reads the carried one: its share of the mixes' gradients goes there, and into dmu.
  firsts = jnp.stack([d[:, 0] for d in dmixes]).astype(jnp.float32)  # [M, B, C]
  carried = last.astype(xn_dtype).astype(jnp.float32)
  dlast = jnp.sum(firsts * mu[:, None], axis=0)
  dmu = dmu + jnp.sum(firsts * carried[None], axis=1)
  if xn_rows == "last" and dxn is not None:  # The last tokens' xn gradients: their norm's backward on B rows.
    norm = functools.partial(normalize, kind=kind, eps=eps, dtype=dtype)
    _, vjp = jax.vjp(norm, x[:, -1:].astype(jnp.float32), scale.astype(jnp.float32), bias.astype(jnp.float32))
    dx_end, ds_end, db_end = vjp(dxn[:, None].astype(xn_dtype))
    dx = lax.dynamic_update_slice_in_dim(dx, (dx[:, -1:].astype(jnp.float32) + dx_end).astype(dx.dtype),
                                         length - 1, axis=1)
    ds, db = ds + ds_end, db + db_end
  return (dx, dlast.astype(last.dtype), ds.astype(scale.dtype), db.astype(bias.dtype), dmu.astype(shifts.dtype))


_BACKWARDS = {"xla": xla_backward, "pallas": pallas_backward}


def with_backward(backward, **static):
  """The reference forward with `backward` as its derivative (first order only), as `norm_mix` builds it (a caller
  may pass a backend's backward with settings of its own, as benchmarks/norm_mix.py does); `static`: kind, eps,
  dtype and xn_rows. An xn no gradient reaches (a symbolic zero: the channel mix's carried token in training)
  reaches the backward as None, so that no array of zeros is made or read."""

  @jax.custom_vjp
  def run(x, last, scale, bias, shifts):
    return xla(x, last, scale, bias, shifts, **static)

  def forward(*primals):
    args = first_order_only(_SECOND_ORDER, *(p.value for p in primals))
    outputs, stats = _forward(*args, **static)
    return outputs, (*args, stats)  # The statistics as the forward computed them (also what XLA's fusion wants).

  def derivative(residuals, cotangents):
    dres, dxn, dmixes = cotangents
    dxn = None if _is_zero(dxn) else dxn
    dres, dmixes = jax.tree.map(_instantiate, (dres, dmixes), is_leaf=_is_zero)
    residuals, (dres, dxn, dmixes) = first_order_only(_SECOND_ORDER, residuals, (dres, dxn, dmixes))
    return tuple(backward(*residuals, dres, dxn, tuple(dmixes), **static))

  run.defvjp(forward, derivative, symbolic_zeros=True)
  return run


def _is_zero(t) -> bool:
  return isinstance(t, SymbolicZero)


def _instantiate(t):
  return jnp.zeros(t.shape, t.dtype) if _is_zero(t) else t


def norm_mix(x, last, scale, bias, shifts, *, kind: str, eps: float, dtype, impl: str = "auto", xn_rows: str = "all"):
  """(x, xn, mixes): the stream itself, then xn and the mixes of the module docstring. A caller that also adds x to
  the residual takes the x returned here: its gradient then joins this op's backward (one pass, not an add after).

  Args:
    x: [B, T, C] the residual stream, any float dtype.
    last: [B, C] the normalised input of the token before x (the layer's carried token), any float dtype.
    scale, bias: [C] float32, the norm's affine (bias None for rmsnorm, which has none, and given for layernorm).
    shifts: [M, C] the mixes' shift fractions (rounded to `dtype`, as the layer does).
    kind: "layernorm" or "rmsnorm"; eps: added to the variance (mean square for rmsnorm).
    dtype: the dtype of xn and the mixes.
    impl: "auto" (see AUTO; one token, T = 1, takes the reference) or one of AVAILABLE.
    xn_rows: "all" returns xn [B, T, C]; "last" only xn[:, -1] [B, C], the token a token-shift layer carries to its
      next call, for a caller that reads no other row of xn (the backward then reads no [B, T, C] gradient of xn).

  Returns:
    x unchanged; xn [B, T, C] (or [B, C]) and a tuple of M mixes [B, T, C], in `dtype`.
  """
  if xn_rows not in XN_ROWS:
    raise ValueError(f"norm_mix: xn_rows must be one of {XN_ROWS}; got {xn_rows!r}")
  if (bias is None) != (kind == "rmsnorm"):
    raise ValueError(f"norm_mix: {kind} takes {'no bias' if kind == 'rmsnorm' else 'a bias'}")
  if bias is None:
    bias = jnp.zeros_like(scale)  # Read by neither backend for rmsnorm; keeps one signature.
  _check(x, last, scale, bias, shifts, kind)
  # Both backends share the forward, outside any per-platform choice (which would keep XLA from fusing it with its
  # neighbours); only the backward is chosen per platform.
  backward = backend.select("norm_mix", impl, _BACKWARDS, AUTO, length=x.shape[1],
                            without_kernels=AUTO_WITHOUT_KERNELS)
  static = dict(kind=kind, eps=eps, dtype=dtype, xn_rows=xn_rows)
  fn = functools.partial(xla, **static) if backward is xla_backward else with_backward(backward, **static)
  # Sequences are independent but each row needs all of its channels: only the batch is split over the mesh.
  seq, row, vec = ("batch", None, None), ("batch", None), (None,)
  mixes = tuple(seq for _ in range(shifts.shape[0]))
  return sharding.per_shard(fn, (x, last, scale, bias, shifts), in_axes=(seq, row, vec, vec, (None, None)),
                            out_axes=(seq, seq if xn_rows == "all" else row, mixes), sizes={"batch": x.shape[0]})
