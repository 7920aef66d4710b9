"""Chunked Pallas kernels for the RWKV-7 WKV recurrence (forward and backward): the WY form on matrix products.

Per (batch, head), with S the [N, N] float32 state (row i = value index, column j = key index):

  S_t = S_{t-1} (diag(e^{w_t}) + a_t b_t^T) + v_t k_t^T,   y_t = S_t r_t

The sequence is cut into chunks of L tokens. Inside a chunk, with g_t = w_1 + ... + w_t (g_0 = 0), g⁻_t = g_t - w_t,
S_0 the state entering the chunk and every [L, N] tile holding one token per row:

  Â = a e^{g⁻}, R̂ = r e^{g}, B̌ = b e^{-g}, Ǩ = k e^{-g}, B̄ = b e^{g_L - g}, K̄ = k e^{g_L - g}   (elementwise)
  M_ab = strict(Â B̌^T), M_ak = strict(Â Ǩ^T), P_rb = incl(R̂ B̌^T), P_rk = incl(R̂ Ǩ^T)         [L, L]
  U = (I - M_ab)^{-1} (Â S_0^T + M_ak V)        u_t = S_{t-1} a_t, the delta rule's "removed" values
  Y = R̂ S_0^T + P_rb U + P_rk V
  S_L = S_0 diag(e^{g_L}) + U^T B̄ + V^T K̄

(strict/incl keep s < t / s <= t). Every step is a product of [L, N], [L, L] or [N, N]-sized tiles: tensor-core
work with float32 accumulation. Operands are bfloat16 for 16-bit inputs (the decayed keys, the state, U: each rounded
once) and float32 otherwise (TF32 products on an H100 at the default precision; exact float32 in the interpreter).
The inverse of the unit lower-triangular I - M_ab is the finite series (I + M)(I + M^2)(I + M^4)... (log2 L - 1
squarings), always on float32 operands.

Forward: grid (B, H, N / BV). A program owns BV value rows of one head's state (rows never interact) and walks the
chunks in order, carrying its [BV, N] block of S: one state pass, everything else inside a chunk is matmuls. It may
store the state entering every chunk, [B, H, T / L, N, N] in the products' operand dtype, the backward's only residual
besides the inputs.

Backward: chunks in reverse, carrying dS (the gradient of the state leaving the chunk). Each chunk recomputes its
forward tiles from its stored entering state and takes the adjoint of the equations above as matrix products
(dU = P_rb^T dY + B̄ dS^T, dX = (I - M_ab)^{-T} dU, dM_ab = strict(dX U^T), ...): no token-by-token replay. The
value-side part (U, dU, dX, dv, the incoming dS) is local to a block of value rows; the key-side gradients (dr, dw,
dk, da, db) sum over all value rows. Two layouts: the forward's grid (B, H, N / BV), where with N / BV > 1 blocks each
adds its key-side share atomically to one zeroed float32 buffer per gradient (converted to the inputs' dtype after);
or (`backward_loop`) grid (B, H), one program per head that takes its value blocks in turn inside each chunk, sums
their key-side shares in registers, computes the key-side tiles and inverse once per chunk, and keeps dS in its own
[N, N] output block in memory between chunks instead of in registers.

State-only kernels, for running segments of one sequence side by side (`wkv7_segmented`): `end_states` walks the
chunks like the forward but keeps only U and the state (no R̂ tiles, no y), from any state, or without values to
apply the sequence's transition ∏ (diag(e^{w_t}) + a_t b_t^T) to a state; `state_gradients` walks them in reverse
carrying only dS (du, dx and the incoming dS, which need neither S nor v nor k). Same grid as the forward.

Range. Factoring e^{g_t - g_s} = e^{g_t} e^{-g_s} is what puts the chunk on matrix products; it needs e^{-g} to stay
finite. |g| <= L·max|w| inside a chunk, so with w >= -LOG_RANGE / L every factor lies in [e^-LOG_RANGE, e^LOG_RANGE]
= [1e-26, 1e26]: no overflow or denormals, and each product keeps float32's relative precision (rounding acts on
each factor, not on the cancellation of e^{g_t} against e^{-g_s}). RWKV-7's layer bounds w >= -e^{-0.5} = -0.6065:
a chunk of 16 then spans at most e^{±9.7}. Beyond the range the factors overflow (inf · 0 = NaN); `in_range` is the
check a caller uses to pick another kernel (the op falls back to the sequential kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ltm_pallas import backend

# Largest |log decay| a factor e^{±g} may take inside a chunk (e^60 = 1e26, 1e12 below float32's largest).
LOG_RANGE = 60.0
CHUNK = 16


def min_log_decay(chunk: int = CHUNK) -> float:
  """The most negative w the chunked kernels take at this chunk length."""
  return -LOG_RANGE / chunk


def in_range(w: jax.Array, chunk: int = CHUNK) -> jax.Array:
  """Whether every log-decay of w is in the kernels' range (a scalar bool array; one read of w)."""
  return jnp.min(w) >= min_log_decay(chunk)


def bounded(w_min: float | None, chunk: int = CHUNK) -> bool:
  """Whether a caller's static bound w >= w_min (None: no bound) keeps every log-decay in the kernels' range, so that
  `in_range` need not read w."""
  return w_min is not None and w_min >= min_log_decay(chunk)


def _dot(x, y, operands=jnp.float32, *, ta=False, tb=False):
  """x @ y on 2-D tiles (x^T with ta, y^T with tb): operands rounded to `operands`, float32 accumulation."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(x.astype(operands), y.astype(operands), dims, preferred_element_type=jnp.float32)


def _masks(size):
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
  return rows > cols, rows >= cols


def _unit_lower_inverse(m):
  """(I - m)^{-1} for strictly lower-triangular m [L, L], L a power of two: (I + m)(I + m^2)(I + m^4)... exactly,
  since m^L = 0. Float32 operands whatever the inputs: [L, L] products are cheap, and every U depends on them."""
  size = m.shape[0]
  rows, cols = lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)
  inverse = jnp.where(rows == cols, 1.0, m)
  power, span = m, 2
  while span < size:
    power = _dot(power, power)
    inverse = inverse + _dot(inverse, power)
    span *= 2
  return inverse


def _key_side(r, w, k, a, b, operands):
  """The value-independent part of a chunk: the decayed keys Â, R̂, B̌, Ǩ (in the operands' dtype: they only ever
  enter products, and a kernel holds half as many registers for them in bfloat16) and the float32 [L, L] pair
  matrices, log-decays and e^{g_L}. With r None the tiles of R̂ (R̂, P_rb, P_rk) are left out, with k None those of
  Ǩ (Ǩ, M_ak, P_rk): the state-only passes (`chunk_end_state`, `chunk_state_gradient`) need neither."""
  strict, incl = _masks(w.shape[0])
  g = jnp.cumsum(w, axis=0)
  t = dict(g=g, gp=g - w, decay_total=jnp.exp(jnp.sum(w, axis=0))[None, :])
  inverse = jnp.exp(-g)
  t["a_hat"], t["b_chk"] = a * jnp.exp(t["gp"]), b * inverse
  if r is not None:
    t["r_hat"] = r * jnp.exp(g)
  if k is not None:
    t["k_chk"] = k * inverse
  for name in ("a_hat", "r_hat", "b_chk", "k_chk"):
    if name in t:
      t[name] = t[name].astype(operands)
  t["m_ab"] = jnp.where(strict, _dot(t["a_hat"], t["b_chk"], operands, tb=True), 0.0)
  if k is not None:
    t["m_ak"] = jnp.where(strict, _dot(t["a_hat"], t["k_chk"], operands, tb=True), 0.0)
  if r is not None:
    t["p_rb"] = jnp.where(incl, _dot(t["r_hat"], t["b_chk"], operands, tb=True), 0.0)
  if r is not None and k is not None:
    t["p_rk"] = jnp.where(incl, _dot(t["r_hat"], t["k_chk"], operands, tb=True), 0.0)
  return t


def _removed(t, s0, v, operands):
  """U [L, BV]: u_t = S_{t-1} a_t for the chunk's tokens, (I - M_ab)^{-1} (Â S_0^T + M_ak V)."""
  x = _dot(t["a_hat"], s0, operands, tb=True) + _dot(t["m_ak"], v, operands)
  return _dot(_unit_lower_inverse(t["m_ab"]), x)


def chunk_forward(s0, r, w, k, v, a, b, operands=jnp.float32):
  """One chunk: (y [L, BV], the state block after it [BV, N]). s0 [BV, N]; r, w, k, a, b [L, N]; v [L, BV]; all
  float32; `operands`: the dtype matrix-product operands are rounded to."""
  t = _key_side(r, w, k, a, b, operands)
  u = _removed(t, s0, v, operands)
  y = _dot(t["r_hat"], s0, operands, tb=True) + _dot(t["p_rb"], u, operands) + _dot(t["p_rk"], v, operands)
  # B̄ = B̌ e^{g_L}, K̄ = Ǩ e^{g_L}: each token's key decayed to the chunk end.
  s_end = (s0 * t["decay_total"] + _dot(u, t["b_chk"] * t["decay_total"], operands, ta=True)
           + _dot(v, t["k_chk"] * t["decay_total"], operands, ta=True))
  return y, s_end


def chunk_end_state(s0, w, k, v, a, b, operands=jnp.float32):
  """The state block after one chunk [BV, N] from s0 [BV, N], without y: `chunk_forward`'s U and S_L alone. With v
  (and k) None the chunk's transition alone, as if v = 0: S_0 ↦ S_0 ∏_t (diag(e^{w_t}) + a_t b_t^T)."""
  t = _key_side(None, w, k if v is not None else None, a, b, operands)
  x = _dot(t["a_hat"], s0, operands, tb=True)
  if v is not None:
    x = x + _dot(t["m_ak"], v, operands)
  u = _dot(_unit_lower_inverse(t["m_ab"]), x)
  s_end = s0 * t["decay_total"] + _dot(u, t["b_chk"] * t["decay_total"], operands, ta=True)
  if v is not None:
    s_end = s_end + _dot(v, t["k_chk"] * t["decay_total"], operands, ta=True)
  return s_end


def chunk_state_gradient(r, w, a, b, dy, ds, operands=jnp.float32):
  """The gradient of the state block entering a chunk [BV, N], given dy [L, BV] and ds [BV, N] (the gradient of the
  state after it): `chunk_backward`'s dS recurrence alone. It is linear in (dy, ds) with key-side coefficients, so
  it needs neither the entering state nor v nor k."""
  t = _decayed_to_end(_key_side(r, w, None, a, b, operands), operands)
  du = _dot(t["p_rb"], dy, operands, ta=True) + _dot(t["b_bar"], ds, operands, tb=True)
  dx = _dot(_unit_lower_inverse(t["m_ab"]), du, ta=True)
  return _dot(dy, t["r_hat"], operands, ta=True) + _dot(dx, t["a_hat"], operands, ta=True) + ds * t["decay_total"]


def _value_block_backward(t, solve, s0, v, dy, ds, operands):
  """The value-side part of a chunk's adjoint for one block of BV value rows: (dv [L, BV], the gradient of the block's
  entering state rows [BV, N], and the block's shares of the key-side sums). `t` and `solve` are the chunk's
  `_key_side` tiles (with `_decayed_to_end`'s) and (I - M_ab)^{-1}; s0 [BV, N] the block's entering state rows, v
  and dy [L, BV], ds [BV, N] (the gradient of the block's state rows after the chunk). The shares add over value
  blocks: [L, N] products dY S_0, dX S_0, U dS, V dS, [L, L] products dY U^T, dY V^T, dX U^T, dX V^T (unmasked) and
  the [1, N] column sums of dS ⊙ S_0; `_key_side_backward` takes their totals."""
  decay_total = t["decay_total"]
  u = _dot(solve, _dot(t["a_hat"], s0, operands, tb=True) + _dot(t["m_ak"], v, operands))
  du = _dot(t["p_rb"], dy, operands, ta=True) + _dot(t["b_bar"], ds, operands, tb=True)
  dx = _dot(solve, du, ta=True)  # The gradient of X = Â S_0^T + M_ak V, through U = (I - M_ab)^{-1} X.
  dv = (_dot(t["p_rk"], dy, operands, ta=True) + _dot(t["m_ak"], dx, operands, ta=True)
        + _dot(t["k_bar"], ds, operands, tb=True))
  ds0 = _dot(dy, t["r_hat"], operands, ta=True) + _dot(dx, t["a_hat"], operands, ta=True) + ds * decay_total
  # Through B̄ = B̌ e^{g_L} and K̄ = Ǩ e^{g_L} (the state after the chunk), and the decay of the carried state.
  sums = dict(db_end=_dot(u, ds, operands), dk_end=_dot(v, ds, operands),
              dg_state=jnp.sum(ds * s0.astype(jnp.float32), axis=0)[None, :],
              dp_rb=_dot(dy, u, operands, tb=True), dp_rk=_dot(dy, v, operands, tb=True),
              dm_ab=_dot(dx, u, operands, tb=True), dm_ak=_dot(dx, v, operands, tb=True),
              dr=_dot(dy, s0, operands), da=_dot(dx, s0, operands))
  return dv, ds0, sums


def _decayed_to_end(t, operands):
  """B̄ = B̌ e^{g_L} and K̄ = Ǩ e^{g_L} in the operands' dtype (as a product rounds them), added to the tiles `t`
  (K̄ only where `t` has Ǩ)."""
  for name, base in (("b_bar", "b_chk"), ("k_bar", "k_chk")):
    if base in t:
      t[name] = (t[base] * t["decay_total"]).astype(operands)
  return t


def _key_side_backward(t, sums, r, k, a, b, store, operands):
  """The key-side gradients of a chunk from the value blocks' summed shares (`_value_block_backward`): dr, da, db,
  dk, dw [L, N] to `store(name, value)`, in that order."""
  strict, incl = _masks(r.shape[0])
  decay_total = t["decay_total"]
  db_end, dk_end = sums["db_end"] * decay_total, sums["dk_end"] * decay_total
  dg_state = sums["dg_state"] * decay_total
  inverse = jnp.exp(-t["g"])
  # Log-decay gradients: through g (R̂ grows with it; B̌, Ǩ shrink), through g⁻ (Â) and through g_L (B̄, K̄ and the
  # carried state). w_s enters g_t for t >= s, g⁻_t for t > s, and g_L.
  dg_total = jnp.sum((db_end * b + dk_end * k) * inverse, axis=0)[None, :] + dg_state
  dp_rb = jnp.where(incl, sums["dp_rb"], 0.0)
  dp_rk = jnp.where(incl, sums["dp_rk"], 0.0)
  dr = (sums["dr"] + _dot(dp_rb, t["b_chk"], operands) + _dot(dp_rk, t["k_chk"], operands)) * jnp.exp(t["g"])
  store("r", dr)
  dg = dr * r
  dm_ab = jnp.where(strict, sums["dm_ab"], 0.0)
  dm_ak = jnp.where(strict, sums["dm_ak"], 0.0)
  da = (sums["da"] + _dot(dm_ab, t["b_chk"], operands) + _dot(dm_ak, t["k_chk"], operands)) * jnp.exp(t["gp"])
  store("a", da)
  dgp = da * a
  db = (_dot(dp_rb, t["r_hat"], operands, ta=True) + _dot(dm_ab, t["a_hat"], operands, ta=True) + db_end) * inverse
  store("b", db)
  dg = dg - db * b
  dk = (_dot(dp_rk, t["r_hat"], operands, ta=True) + _dot(dm_ak, t["a_hat"], operands, ta=True) + dk_end) * inverse
  store("k", dk)
  dg = dg - dk * k
  both = dg + dgp
  suffix = jnp.sum(both, axis=0)[None, :] - jnp.cumsum(both, axis=0) + both  # Sum over t >= s.
  store("w", suffix - dgp + dg_total)


def chunk_backward(s0, r, w, k, v, a, b, dy, ds, operands=jnp.float32, emit=None, reload=None):
  """The adjoint of `chunk_forward` given dy [L, BV] and ds [BV, N] (the gradient of the state after the chunk).

  Returns the gradient of s0 [BV, N]. The input gradients go to `emit(name, value)` as soon as each is complete
  (a kernel stores it there, so that it need not stay live in registers): dv [L, BV], and dr, da, db, dk, dw [L, N],
  sums over this value block. Without `emit` they are returned too, as a dict, after the state's gradient.
  `reload()` gives (r, k, a, b) again for the last step (a kernel reads them from memory rather than holding them).

  The log-decays' gradient uses x ⊙ dx = x̂ ⊙ dx̂ for each decayed key x̂ = x e^{±g}: the float32 inputs and
  gradients stand in for the decayed tiles, which exist only in the operands' dtype."""
  grads = {}
  store = emit or grads.__setitem__
  t = _decayed_to_end(_key_side(r, w, k, a, b, operands), operands)
  dv, ds0, sums = _value_block_backward(t, _unit_lower_inverse(t["m_ab"]), s0, v, dy, ds, operands)
  store("v", dv)
  if reload is not None:
    r, k, a, b = reload()
  _key_side_backward(t, sums, r, k, a, b, store, operands)
  return ds0 if emit else (ds0, grads)


def _load(refs, rows):
  return tuple(ref[rows, :].astype(jnp.float32) for ref in refs)


def _chunk_rows(c, chunk):
  return pl.ds(pl.multiple_of(c * chunk, chunk), chunk)


def _forward_kernel(r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, y_ref, *state_refs, chunk, operands):
  """y and the final state; with a checkpoint output also the state entering every chunk."""
  ckpt_ref, s_out_ref = state_refs if len(state_refs) == 2 else (None, state_refs[0])
  num_chunks = r_ref.shape[0] // chunk

  def one_chunk(c, s):
    if ckpt_ref is not None:
      ckpt_ref[c] = s.astype(ckpt_ref.dtype)
    rows = _chunk_rows(c, chunk)
    r, w, k, v, a, b = _load((r_ref, w_ref, k_ref, v_ref, a_ref, b_ref), rows)
    y, s = chunk_forward(s, r, w, k, v, a, b, operands)
    y_ref[rows, :] = y.astype(y_ref.dtype)
    return s

  s_out_ref[...] = lax.fori_loop(0, num_chunks, one_chunk, s0_ref[...].astype(jnp.float32))


def _backward_kernel(*refs, chunk, operands, accumulate):
  """With `accumulate` (several value blocks per head) the key-side gradients are float32 buffers, zeroed before
  the kernel, that every block adds its share to atomically; else each program writes them whole."""
  inputs, outputs = refs[:9], refs[-7:]  # With `accumulate`, the zeroed buffers' inputs (aliased) lie between.
  r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, ckpt_ref, dy_ref, ds_out_ref = inputs
  dr_ref, dw_ref, dk_ref, dv_ref, da_ref, db_ref, ds0_ref = outputs
  num_chunks = r_ref.shape[0] // chunk
  add = None
  if accumulate:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
    add = pl_triton.atomic_add

  def one_chunk(i, ds):  # Last chunk first.
    c = num_chunks - 1 - i
    rows = _chunk_rows(c, chunk)
    r, w, k, v, a, b, dy = _load((r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, dy_ref), rows)
    refs = dict(r=dr_ref, w=dw_ref, k=dk_ref, v=dv_ref, a=da_ref, b=db_ref)

    def emit(name, grad):
      if add is not None and name != "v":
        add(refs[name], (rows, slice(None)), grad)
      else:
        refs[name][rows, :] = grad.astype(refs[name].dtype)

    reload = lambda: _load((r_ref, k_ref, a_ref, b_ref), rows)
    return chunk_backward(ckpt_ref[c], r, w, k, v, a, b, dy, ds, operands, emit, reload)

  ds0_ref[...] = lax.fori_loop(0, num_chunks, one_chunk, ds_out_ref[...].astype(jnp.float32))


def _backward_loop_kernel(r_ref, w_ref, k_ref, v_ref, a_ref, b_ref, ckpt_ref, dy_ref, ds_out_ref, dr_ref, dw_ref,
                          dk_ref, dv_ref, da_ref, db_ref, ds_ref, *, chunk, block, operands):
  """One program per (batch, head) that takes the head's value rows in blocks of `block`, one after another, inside
  every chunk: the key-side tiles, pair matrices and inverse once per chunk, each block's value-side adjoint
  (`_value_block_backward`) adding its shares to the key-side sums carried in registers, then the key-side gradients
  once (`_key_side_backward`), written whole in the inputs' dtype. The carried state gradient dS [N, N] float32 lives
  in the program's own output block `ds_ref` between chunks (each block reads its rows and writes them back), so no
  [N, N] tile is ever live in registers; it holds the incoming state's gradient at the end. A block's dS rows are
  written by its step in one chunk and read by its step in the next, with the key-side products of the chunk in
  between; their layout conversions pass through shared memory behind block barriers (bar.sync in the compiled
  PTX), which also order the program's global-memory accesses across its threads."""
  num_chunks = r_ref.shape[0] // chunk
  size = r_ref.shape[1]
  num_blocks = size // block
  cols = lambda j: pl.ds(pl.multiple_of(j * block, block), block)

  def copy_in(j, carry):
    ds_ref[cols(j), :] = ds_out_ref[cols(j), :].astype(jnp.float32)
    return carry

  lax.fori_loop(0, num_blocks, copy_in, 0)

  def one_chunk(i, carry):  # Last chunk first.
    c = num_chunks - 1 - i
    rows = _chunk_rows(c, chunk)
    r, w, k, a, b = _load((r_ref, w_ref, k_ref, a_ref, b_ref), rows)
    t = _decayed_to_end(_key_side(r, w, k, a, b, operands), operands)
    solve = _unit_lower_inverse(t["m_ab"])
    del t["g"], t["gp"]  # Recomputed after the value blocks rather than held through them.

    def one_block(j, sums):
      s0 = ckpt_ref[c, cols(j), :]
      v, dy = (ref[rows, cols(j)].astype(jnp.float32) for ref in (v_ref, dy_ref))
      dv, ds0, shares = _value_block_backward(t, solve, s0, v, dy, ds_ref[cols(j), :], operands)
      dv_ref[rows, cols(j)] = dv.astype(dv_ref.dtype)
      ds_ref[cols(j), :] = ds0
      return {name: sums[name] + shares[name] for name in sums}

    zeros = dict(db_end=(chunk, size), dk_end=(chunk, size), dg_state=(1, size), dp_rb=(chunk, chunk),
                 dp_rk=(chunk, chunk), dm_ab=(chunk, chunk), dm_ak=(chunk, chunk), dr=(chunk, size), da=(chunk, size))
    sums = lax.fori_loop(0, num_blocks, one_block, {n: jnp.zeros(shape, jnp.float32) for n, shape in zeros.items()})
    refs = dict(r=dr_ref, w=dw_ref, k=dk_ref, a=da_ref, b=db_ref)

    def store(name, grad):
      refs[name][rows, :] = grad.astype(refs[name].dtype)

    r, w, k, a, b = _load((r_ref, w_ref, k_ref, a_ref, b_ref), rows)
    t["g"] = jnp.cumsum(w, axis=0)
    t["gp"] = t["g"] - w
    _key_side_backward(t, sums, r, k, a, b, store, operands)
    return carry

  lax.fori_loop(0, num_chunks, one_chunk, 0)


def _end_state_kernel(*refs, chunk, operands, values):
  """The state after the sequence from the state before it (no y): with `values` refs (w, k, v, a, b, s0, s_out),
  else (w, a, b, s0, s_out) and v = 0 (the sequence's transition applied to s0)."""
  if values:
    w_ref, k_ref, v_ref, a_ref, b_ref, s0_ref, s_out_ref = refs
  else:
    (w_ref, a_ref, b_ref, s0_ref, s_out_ref), k_ref, v_ref = refs, None, None
  num_chunks = w_ref.shape[0] // chunk

  def one_chunk(c, s):
    rows = _chunk_rows(c, chunk)
    w, a, b = _load((w_ref, a_ref, b_ref), rows)
    k, v = _load((k_ref, v_ref), rows) if values else (None, None)
    return chunk_end_state(s, w, k, v, a, b, operands)

  s_out_ref[...] = lax.fori_loop(0, num_chunks, one_chunk, s0_ref[...].astype(jnp.float32))


def _state_gradient_kernel(r_ref, w_ref, a_ref, b_ref, dy_ref, ds_out_ref, ds0_ref, *, chunk, operands):
  """The gradient of the state before the sequence from dy and the gradient of the state after it: chunks in
  reverse, carrying dS (`chunk_state_gradient`)."""
  num_chunks = w_ref.shape[0] // chunk

  def one_chunk(i, ds):  # Last chunk first.
    rows = _chunk_rows(num_chunks - 1 - i, chunk)
    r, w, a, b, dy = _load((r_ref, w_ref, a_ref, b_ref, dy_ref), rows)
    return chunk_state_gradient(r, w, a, b, dy, ds, operands)

  ds0_ref[...] = lax.fori_loop(0, num_chunks, one_chunk, ds_out_ref[...].astype(jnp.float32))


def _specs(length, size, block, num_chunks):
  """BlockSpecs over grid (B, H, N / BV): whole [T, N] sequences of one (batch, head), the block's [T, BV] values,
  the block's [BV, N] state rows and its [T / L, BV, N] chunk states."""
  seq = pl.BlockSpec((None, length, None, size), lambda b, h, j: (b, 0, h, 0))
  seq_block = pl.BlockSpec((None, length, None, block), lambda b, h, j: (b, 0, h, j))
  state = pl.BlockSpec((None, None, block, size), lambda b, h, j: (b, h, j, 0))
  ckpt = pl.BlockSpec((None, None, num_chunks, block, size), lambda b, h, j: (b, h, 0, j, 0))
  return seq, seq_block, state, ckpt


# Launch settings per (head size N, bytes per product operand), from the deviceless H100 compile report
# (benchmarks/gpu_aot.py): for each, the fewest value blocks per head that compile without register spills.
# forward_block and backward_block: value rows per program (BV), or with backward_loop the backward's value rows per
# step of one program per head; warps per program for each kernel. At bfloat16, N = 64 fits one block per head (its
# backward spills 188 B on 4 warps). N = 128's backward as programs of their own spills at BV = 128, 64 and 32 (2348,
# 896, 96 B) and fits at 16, 8 programs per head adding key-side gradients atomically; looping over the blocks in one
# program per head it spills at BV = 32 (72 B) and fits at 16, with no atomics, and it is the N = 128 default: on an
# H100 at (2, 4096, 4096, 128) it took 11.8 ms forward+backward against 22.1 for the atomic layout, with every gradient
# within one bfloat16 rounding of the other layout's (benchmarks/results/wkv7-chunked-backward-nvidia-h100-80gb-
# hbm3.json; at B = 8 the script's float32 XLA reference runs out of memory). Its dS rows pass between threads
# through global memory, ordered by the barriers that the compiled layout conversions place between them. Chunks of
# 32 at N = 64: the forward fits with BV = 32 (4 warps), the backward spills at every setting tried (BV = 64, 8 warps:
# 640 B; 32: 268 B on 8 warps, 960 on 4; 16: 464 B; 16 looping: 16 B on 8 warps, 784 on 4). Float32
# operands take twice the registers: N = 32 fits, N = 64 spills at every setting tried (8 B at best), so float32
# inputs with larger heads run the sequential kernels (`fits`).
SETTINGS = {
    (64, 2): dict(chunk=16, forward_block=64, backward_block=64, backward_loop=False, forward_warps=4,
                  backward_warps=8),
    (128, 2): dict(chunk=16, forward_block=64, backward_block=16, backward_loop=True, forward_warps=8,
                   backward_warps=8),
    (32, 4): dict(chunk=16, forward_block=32, backward_block=32, backward_loop=False, forward_warps=4,
                  backward_warps=8),
}


def operand_dtype(dtype) -> jnp.dtype:
  """The product operands' dtype for inputs of `dtype`: bfloat16 for 16-bit floats, else float32."""
  return jnp.dtype(jnp.bfloat16 if jnp.dtype(dtype).itemsize == 2 else jnp.float32)


def _item(operands) -> int:
  return 2 if jnp.dtype(operands).itemsize == 2 else 4


def fits(size: int, operands=jnp.bfloat16) -> bool:
  """Whether head size `size` with these operands is within the tabulated (spill-free) settings: N at most the
  largest tabulated N for the operand width (smaller tiles take fewer registers), and a power of two of at least 16
  (tensor-core tiles)."""
  sizes = [n for n, i in SETTINGS if i == _item(operands)]
  return 16 <= size <= max(sizes) and not size & (size - 1)


def settings(size: int, operands=jnp.bfloat16) -> dict:
  """The launch settings for head size `size` and operand dtype (a tabulated size's: the nearest not below it, else
  the largest)."""
  item = _item(operands)
  sizes = sorted(n for n, i in SETTINGS if i == item)
  fitting = [n for n in sizes if n >= size]
  return dict(SETTINGS[(fitting[0] if fitting else sizes[-1]), item])


def forward(r, w, k, v, a, b, state, *, chunk, block, warps, operands, interpret, checkpoints=True):
  """(y, chunk states [B, H, T / L, N, N] in the operands' dtype (None when not asked for), final state).

  The backward reads the stored states only as product operands (and in one elementwise sum of dw), which are
  rounded to the operands' dtype anyway: storing them so halves their bytes with bfloat16 operands."""
  batch, length, heads, size = r.shape
  num_chunks = length // chunk
  seq, seq_block, state_spec, ckpt_spec = _specs(length, size, block, num_chunks)
  ckpt_shape = jax.ShapeDtypeStruct((batch, heads, num_chunks, size, size), operands)
  outputs = backend.call(
      functools.partial(_forward_kernel, chunk=chunk, operands=operands),
      out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),) + ((ckpt_shape,) if checkpoints else ())
      + (jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),),
      grid=(batch, heads, size // block),
      in_specs=[seq, seq, seq, seq_block, seq, seq, state_spec],
      out_specs=[seq_block] + ([ckpt_spec] if checkpoints else []) + [state_spec],
      num_warps=warps,
      interpret=interpret,
      name="wkv7_chunked_forward" if checkpoints else "wkv7_chunked_forward_primal",
  )(r, w, k, v, a, b, state)
  return (outputs[0], outputs[1], outputs[2]) if checkpoints else (outputs[0], None, outputs[1])


def backward(r, w, k, v, a, b, ckpt, dy, ds_out, *, chunk, block, loop, warps, operands, interpret):
  """(dr, dw, dk, dv, da, db in the inputs' dtypes, the entering state's gradient [B, H, N, N] float32) from the
  inputs, `forward`'s chunk states, dy [B, T, H, N] and ds_out [B, H, N, N] (the final state's gradient)."""
  batch, length, heads, size = r.shape
  num_chunks = length // chunk
  blocks = size // block
  if loop and blocks > 1:
    seq = pl.BlockSpec((None, length, None, size), lambda b, h: (b, 0, h, 0))
    state_spec = pl.BlockSpec((None, None, size, size), lambda b, h: (b, h, 0, 0))
    ckpt_spec = pl.BlockSpec((None, None, num_chunks, size, size), lambda b, h: (b, h, 0, 0, 0))
    return backend.call(
        functools.partial(_backward_loop_kernel, chunk=chunk, block=block, operands=operands),
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (r, w, k, v, a, b))
        + (jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),),
        grid=(batch, heads),
        in_specs=[seq] * 6 + [ckpt_spec, seq, state_spec],
        out_specs=[seq] * 6 + [state_spec],
        num_warps=warps,
        interpret=interpret,
        name="wkv7_chunked_backward",
    )(r, w, k, v, a, b, ckpt, dy, ds_out)
  seq, seq_block, state_spec, ckpt_spec = _specs(length, size, block, num_chunks)
  accumulate = blocks > 1
  key_dtypes = [jnp.float32 if accumulate else x.dtype for x in (r, w, k, a, b)]
  dr, dw, dk, da, db = (jax.ShapeDtypeStruct(r.shape, dtype) for dtype in key_dtypes)
  zeros = [jnp.zeros(r.shape, jnp.float32) for _ in range(5)] if accumulate else []
  grads = backend.call(
      functools.partial(_backward_kernel, chunk=chunk, operands=operands, accumulate=accumulate),
      out_shape=(dr, dw, dk, jax.ShapeDtypeStruct(v.shape, v.dtype), da, db,
                 jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32)),
      grid=(batch, heads, blocks),
      in_specs=[seq, seq, seq, seq_block, seq, seq, ckpt_spec, seq_block, state_spec] + [seq] * len(zeros),
      out_specs=[seq, seq, seq, seq_block, seq, seq, state_spec],
      input_output_aliases={9 + i: out for i, out in enumerate((0, 1, 2, 4, 5))} if accumulate else {},
      num_warps=warps,
      interpret=interpret,
      name="wkv7_chunked_backward",
  )(r, w, k, v, a, b, ckpt, dy, ds_out, *zeros)
  dr, dw, dk, dv, da, db, ds0 = grads
  if accumulate:
    dr, dw, dk, da, db = (g.astype(x.dtype) for g, x in zip((dr, dw, dk, da, db), (r, w, k, a, b)))
  return dr, dw, dk, dv, da, db, ds0


def end_states(w, k, v, a, b, state, *, chunk, block, warps, operands, interpret):
  """The state after each sequence [B, H, N, N] float32 from `state` before it, without y (grid (B, H, N / BV)).
  w, k, v, a, b [B, T, H, N] with T a multiple of `chunk`. With k and v None: the sequences' transitions applied to
  `state` (v = 0), the kernel named wkv7_chunked_transition; else wkv7_chunked_end_state."""
  batch, length, heads, size = w.shape
  values = v is not None
  seq, seq_block, state_spec, _ = _specs(length, size, block, length // chunk)
  inputs = (w, k, v, a, b) if values else (w, a, b)
  return backend.call(
      functools.partial(_end_state_kernel, chunk=chunk, operands=operands, values=values),
      out_shape=jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),
      grid=(batch, heads, size // block),
      in_specs=([seq, seq, seq_block, seq, seq] if values else [seq] * 3) + [state_spec],
      out_specs=state_spec,
      num_warps=warps,
      interpret=interpret,
      name="wkv7_chunked_end_state" if values else "wkv7_chunked_transition",
  )(*inputs, state)


def state_gradients(r, w, a, b, dy, ds_out, *, chunk, block, warps, operands, interpret):
  """The gradient of the state before each sequence [B, H, N, N] float32, given dy [B, T, H, N] and ds_out
  [B, H, N, N] (the gradient of the state after it), without the inputs' gradients (grid (B, H, N / BV))."""
  batch, length, heads, size = r.shape
  seq, seq_block, state_spec, _ = _specs(length, size, block, length // chunk)
  return backend.call(
      functools.partial(_state_gradient_kernel, chunk=chunk, operands=operands),
      out_shape=jax.ShapeDtypeStruct((batch, heads, size, size), jnp.float32),
      grid=(batch, heads, size // block),
      in_specs=[seq] * 4 + [seq_block, state_spec],
      out_specs=state_spec,
      num_warps=warps,
      interpret=interpret,
      name="wkv7_chunked_state_gradient",
  )(r, w, a, b, dy, ds_out)


# Both WKV-7 backends that use Pallas name themselves: impl='pallas_chunked' runs the sequential kernels too.
_SECOND_ORDER = ("wkv7: impl='pallas' and impl='pallas_chunked' (the Pallas WKV-7 kernels) have no second "
                 "derivative; impl='scan' and impl='chunked' are differentiable to any order")


@functools.lru_cache(maxsize=None)
def _fused(chunk: int, forward_block: int, backward_block: int, backward_loop: bool, forward_warps: int,
           backward_warps: int, operands: str, interpret: bool | None, optimize_remat: bool):
  """The custom_vjp function for one static configuration (inputs' T must be a multiple of `chunk`)."""
  operands = jnp.dtype(operands)
  fwd = functools.partial(forward, chunk=chunk, block=forward_block, warps=forward_warps, operands=operands,
                          interpret=interpret)

  @jax.custom_vjp
  def run(r, w, k, v, a, b, state):
    y, _, final = fwd(r, w, k, v, a, b, state, checkpoints=False)
    return y, final

  def run_fwd(r, w, k, v, a, b, state):
    r, w, k, v, a, b, state = backend.first_order_only(_SECOND_ORDER, r, w, k, v, a, b, state)
    y, ckpt, final = fwd(r, w, k, v, a, b, state)
    return (y, final), (r, w, k, v, a, b, ckpt)

  def run_bwd(residuals, cotangents):
    residuals, cotangents = backend.first_order_only(_SECOND_ORDER, residuals, cotangents)
    *inputs, ckpt = residuals
    dy, ds_out = cotangents
    return backward(*inputs, ckpt, dy.astype(inputs[3].dtype), ds_out.astype(jnp.float32), chunk=chunk,
                     block=backward_block, loop=backward_loop, warps=backward_warps, operands=operands,
                     interpret=interpret)

  # Under jax.checkpoint the forward pass then runs the primal (no chunk states written), and only the recomputation
  # in the backward pass writes them (jax#21303).
  run.defvjp(run_fwd, run_bwd, optimize_remat=optimize_remat)
  return run


def _power_of_two(name: str, value: int, low: int) -> int:
  if value < low or value & (value - 1):
    raise ValueError(f"wkv7_chunked: {name} must be a power of two >= {low}, got {value}")
  return value


def launch_settings(size: int, operands, **given) -> dict:
  """`settings(size, operands)` with the entries of `given` that are not None in their place (chunk, forward_block,
  backward_block, backward_loop, forward_warps, backward_warps), checked: N, the chunk and the blocks powers of two,
  blocks at most N. Raises ValueError naming a bad one."""
  chosen = settings(size, operands)
  chosen.update({key: value for key, value in given.items() if value is not None})
  _power_of_two("N", size, 1)
  _power_of_two("chunk", chosen["chunk"], 2)
  for key in ("forward_block", "backward_block"):
    chosen[key] = min(_power_of_two(key, chosen[key], 1), size)
  return chosen


def pad_tokens(multiple: int, *xs: jax.Array) -> tuple[jax.Array, ...]:
  """xs [B, T, H, N] padded along T with zero tokens to a multiple of `multiple`: identity steps (e^0 = 1, no rank-1
  terms) that read out y = 0, for the caller to slice off."""
  pad = -xs[0].shape[1] % multiple
  return tuple(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in xs) if pad else xs


def wkv7(
    r: jax.Array,
    w: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a: jax.Array,
    b: jax.Array,
    state: jax.Array,
    *,
    chunk: int | None = None,
    forward_block: int | None = None,
    backward_block: int | None = None,
    backward_loop: bool | None = None,
    forward_warps: int | None = None,
    backward_warps: int | None = None,
    operands=None,
    interpret: bool | None = None,
    optimize_remat: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Chunked WKV-7, differentiable in every argument; exact for w >= min_log_decay(chunk) (see `in_range`).

  Args:
    r, w, k, v, a, b: [B, T, H, N], any float dtype, any T; N a power of two (>= 16 on a GPU: tensor-core tiles).
    state: [B, H, N, N] float32, the state before the first token.
    chunk: tokens per chunk L, a power of two (>= 16 on a GPU); None: `settings(N, operands)`, as are blocks and
      warps.
    forward_block, backward_block: value rows per program (BV, a power of two; min(BV, N) is used); with
      backward_loop, the backward's value rows per step of a program that holds the whole head.
    backward_loop: whether a head's backward value blocks run in turn inside one program (key-side gradients summed
      in registers and written once) rather than as programs of their own (adding them atomically).
    forward_warps, backward_warps: warps per program on the GPU.
    operands: the dtype matrix-product operands (and the stored chunk states) are rounded to, accumulation being
      float32: None for `operand_dtype(r.dtype)`, bfloat16 for 16-bit inputs (full-rate tensor cores, half the
      registers), else float32 (TF32 products on a GPU). The [L, L] inverse always takes float32 operands.
    interpret: force the Pallas interpreter (None: interpret unless compiling for a GPU).
    optimize_remat: under jax.checkpoint, run the checkpoint-free primal forward and write checkpoints only in the
      backward pass's recomputation. False writes them in both passes (jax#21303), which jax needs inside a
      shard_map under remat and nested scans, where its dead-code elimination of the optimised form fails.

  Returns:
    y [B, T, H, N] in v's dtype, and the final state [B, H, N, N] float32.
  """
  batch, length, heads, size = r.shape
  operands = operand_dtype(r.dtype) if operands is None else jnp.dtype(operands)
  chosen = launch_settings(size, operands, chunk=chunk, forward_block=forward_block, backward_block=backward_block,
                           backward_loop=backward_loop, forward_warps=forward_warps, backward_warps=backward_warps)
  r, w, k, v, a, b = pad_tokens(chosen["chunk"], r, w, k, v, a, b)
  run = _fused(chosen["chunk"], chosen["forward_block"], chosen["backward_block"], bool(chosen["backward_loop"]),
               chosen["forward_warps"], chosen["backward_warps"], operands.name, interpret, optimize_remat)
  y, final = run(r, w, k, v, a, b, state.astype(jnp.float32))
  return y[:, :length], final
