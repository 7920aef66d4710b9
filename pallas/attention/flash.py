"""`flash_attention`: padding, validation and the custom_vjp that joins the forward and backward kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ltm_pallas import backend
from ltm_pallas.attention import kernels
from ltm_pallas.attention.config import BlockSizes, Static, default_block_sizes, fit_block, next_power_of_two

Segments = tuple[jax.Array, jax.Array] | None


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: Segments = None,
    *,
    causal: bool,
    window: int | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
  """softmax(scale * q k^T + mask) v with float32 accumulation; differentiable in q, k, v by its own kernels.

  Masks as in config (module docstring): causal aligns the last query with the last key (query i at position
  S - T + i); window=W keeps keys with q_pos - W < j <= q_pos and needs causal; segment ids keep equal ids.
  A query that sees no key gives a zero row and zero gradients. Any T, S and head dim: the arrays are padded to
  whole blocks (and D to a power of two >= 16) and the padding is masked.

  Args:
    q: [B, T, Hq, D] float16, bfloat16 or float32.
    k: [B, S, Hkv, D], q's dtype; Hq a multiple of Hkv (query head h reads key/value head h // (Hq // Hkv)).
    v: [B, S, Hkv, D], q's dtype.
    segment_ids: None, or (query ids [B, T], key ids [B, S]) integers.
    causal: apply the causal mask.
    window: sliding window W >= 1 (with causal), or None.
    scale: static float; None means D ** -0.5.
    block_sizes: tiles and launch settings; None, or any field left None, takes the defaults for the head dim
      and dtype (config.default_block_sizes).
    interpret: None: interpret off GPU (pallas/backend.py decides).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  st, padded = _prepare(q, k, v, segment_ids, causal=causal, window=window, scale=scale, block_sizes=block_sizes,
                        interpret=interpret)
  o = _flash(st, *padded)
  return o[:, :st.t, :, :q.shape[3]]


def raw_outputs(q, k, v, do, segment_ids: Segments = None, *, causal: bool, window: int | None = None,
                scale: float | None = None, block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                poison: bool = True) -> dict[str, jax.Array]:
  """Every kernel output, padding included, for `do` the cotangent of the output ([B, T, Hq, D]).

  With poison=True each output buffer starts as NaN (aliased into the kernel), so an element that no program
  writes stays NaN: tests use this to check that the kernels write everything they own.

  Returns:
    {"o", "lse", "dq", "dk", "dv"}: the padded arrays as the kernels produced them (lse base 2, +inf for rows
    that see no key).
  """
  st, (qp, kp, vp, segments) = _prepare(q, k, v, segment_ids, causal=causal, window=window, scale=scale,
                                        block_sizes=block_sizes, interpret=interpret)
  o, lse = kernels.forward(st, qp, kp, vp, segments, poison=poison)
  dop = _pad(do, st.t_pad, st.head_dim_pad)
  dq, dk, dv = kernels.backward(st, qp, kp, vp, segments, o, lse, dop, poison=poison)
  return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _prepare(q, k, v, segment_ids, *, causal, window, scale, block_sizes, interpret):
  """Validates, builds the Static settings and pads (q, k, v, segments)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"flash_attention: {name} must be [B, len, heads, D], got {x.shape}")
  if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"flash_attention: takes float16, bfloat16 or float32, got {q.dtype}")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"flash_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % hkv:
    raise ValueError(f"flash_attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
  if window is not None:
    if not causal:
      raise ValueError("flash_attention: window needs causal=True")
    if window < 1:
      raise ValueError(f"flash_attention: window must be >= 1, got {window}")
    if window >= s:  # Every query position is < S, so such a window hides nothing.
      window = None
  head_dim_pad = max(16, next_power_of_two(d))
  blocks = (block_sizes or BlockSizes()).or_defaults(default_block_sizes(head_dim_pad, q.dtype))
  q_tiles = {name: fit_block(getattr(blocks, name), t) for name in ("fwd_q", "dq_q", "dkv_q")}
  k_tiles = {name: fit_block(getattr(blocks, name), s) for name in ("fwd_k", "dq_k", "dkv_k")}
  launch = {name: getattr(blocks, name) for name in ("fwd_warps", "dq_warps", "dkv_warps", "fwd_stages", "dq_stages",
                                                     "dkv_stages")}
  launch["dkv_stream_kv"] = bool(blocks.dkv_stream_kv)
  st = Static(
      causal=bool(causal), window=None if window is None else int(window),
      scale=float(d**-0.5 if scale is None else scale), t=t, s=s,
      t_pad=_round_up(t, max(q_tiles.values())), s_pad=_round_up(s, max(k_tiles.values())), head_dim_pad=head_dim_pad,
      group=hq // hkv, has_segments=segment_ids is not None, **q_tiles, **k_tiles, **launch, interpret=interpret,
      float32_inputs=jnp.dtype(q.dtype) == jnp.float32)
  segments = None
  if segment_ids is not None:
    q_ids, kv_ids = segment_ids
    if q_ids.shape != (b, t) or kv_ids.shape != (b, s):
      raise ValueError(f"flash_attention: segment ids must be [B, T] and [B, S], got {q_ids.shape}, {kv_ids.shape}")
    # Padded keys are masked by index, padded queries are discarded: the fill value does not matter.
    segments = (jnp.pad(q_ids.astype(jnp.int32), ((0, 0), (0, st.t_pad - t))),
                jnp.pad(kv_ids.astype(jnp.int32), ((0, 0), (0, st.s_pad - s))))
  padded = (_pad(q, st.t_pad, head_dim_pad), _pad(k, st.s_pad, head_dim_pad), _pad(v, st.s_pad, head_dim_pad),
            segments)
  return st, padded


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad(x: jax.Array, length: int, head_dim: int) -> jax.Array:
  """Zero-pads [B, len, H, D] to [B, length, H, head_dim]; no copy when nothing is padded."""
  widths = ((0, 0), (0, length - x.shape[1]), (0, 0), (0, head_dim - x.shape[3]))
  if all(w == (0, 0) for w in widths):
    return x
  return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: Static, q, k, v, segments):
  return kernels.forward(st, q, k, v, segments)[0]


# The kernels' custom VJP has a first derivative only (see `backend.first_order_only`).
_SECOND_ORDER = ("attention: impl='pallas' (the Pallas flash attention kernels) has no second derivative; "
                 "impl='xla' is differentiable to any order")


def _flash_fwd(st: Static, q, k, v, segments):
  q, k, v = backend.first_order_only(_SECOND_ORDER, q, k, v)
  o, lse = kernels.forward(st, q, k, v, segments)
  return o, (q, k, v, segments, o, lse)


def _flash_bwd(st: Static, residuals, do):
  (q, k, v, o, lse), do = backend.first_order_only(_SECOND_ORDER, residuals[:3] + residuals[4:], do)
  segments = residuals[3]
  dq, dk, dv = kernels.backward(st, q, k, v, segments, o, lse, do)
  # Segment ids are integers: no cotangent.
  return dq, dk, dv, None if segments is None else (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
