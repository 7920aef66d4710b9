"""What the deviceless GPU compile check (`benchmarks/gpu_aot.py`, `make gpu-aot`) compiles: every kernel of
`ltm_pallas` at its default tiles and at the shapes the models use, and whole model programs.

A case is a function and abstract arguments; the check compiles it for an H100 (sm_90a) without a GPU and reports,
per Pallas kernel in the compiled program, warps, registers, spills, shared memory, grid and an occupancy estimate.

Kernel cases ("kernels") run forward and backward in one program, so one compilation covers every kernel of an op:
  WKV-4: the sequential path (B·C >= PARALLEL_BELOW) and the time-parallel one, bfloat16 and float32.
  WKV-7: the sequential kernels at head sizes 64 and 128, bfloat16 and float32; the chunked kernels at the WKV-7
    benchmark's GPU shapes (head sizes 64 and 128, bfloat16) and at head size 32 in float32.
  RWKV-7 output stage (group norm, r.k bonus, gate) and key side (key norm, delta-rule keys, bonus sums): each at
    small_rwkv7's and base_125m_rwkv7's training shapes in bfloat16, and in float32.
  flash attention (forward, dq, dk/dv): head dims 32, 64, 128 and 256; causal, sliding window, segment ids,
    non-causal; grouped (GQA) and single (MQA) key/value heads; bfloat16 and float32 (and float16 once). Where the
    default settings are listed in `ltm_pallas.attention.config.SPILLING_DEFAULTS` (none today) the case must
    compile and may spill.
Model cases ("models") compile the whole `small_rwkv7` and `base_125m` train steps and their generation (prefill and
the decode loop) as configured: `impl="auto"` takes what it takes when compiled for a GPU (`ltm_jax.ops.backend`
dispatches on the platform being compiled for). They catch lowering failures outside the kernels too.
Controls ("controls") must fail: attention tiles too large for shared memory, and tiles too large for registers. They
show that the check sees both kinds of failure.

Importing this module needs only jax and the kernels; the model cases import `ltm_jax` and the configs when they
are built. It lives beside the check, not in the kernel package, which knows no model.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ltm_pallas import add_norm, quant_matmul, rwkv7_key, rwkv7_out, wkv4, wkv7, wkv7_chunked, wkv7_segmented
from ltm_jax.ops import norm_mix
from ltm_pallas.attention import BlockSizes, config, flash_attention

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (shape, dtype) -> an abstract array (jax.ShapeDtypeStruct) placed on the target device.
Abstract = Callable[[tuple[int, ...], Any], Any]
# (abstract, attention block sizes or None) -> (function to compile, its abstract arguments).
Builder = Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]

WKV4_KERNELS_SEQUENTIAL = ("wkv4_forward", "wkv4_backward")
# Under remat the sequential path's forward pass runs the primal kernel (no checkpoints), the recomputation the full
# forward. The time-parallel path's primal runs its forward kernels (they write nothing the backward alone reads).
WKV4_REMAT_KERNELS_SEQUENTIAL = ("wkv4_forward_primal",) + WKV4_KERNELS_SEQUENTIAL
WKV4_KERNELS_PARALLEL = ("wkv4_chunk_summary", "wkv4_chunk_output", "wkv4_chunk_adjoint", "wkv4_chunk_grads")
WKV7_KERNELS = ("wkv7_forward", "wkv7_backward")
# Under remat the forward pass runs the primal kernel (no state checkpoints), the recomputation the full forward.
WKV7_REMAT_KERNELS = ("wkv7_forward_primal",) + WKV7_KERNELS
WKV7_CHUNKED_KERNELS = ("wkv7_chunked_forward", "wkv7_chunked_backward")
WKV7_CHUNKED_REMAT_KERNELS = ("wkv7_chunked_forward_primal",) + WKV7_CHUNKED_KERNELS
# The segmented form adds the state-only passes: each segment's end state and transition, and the state gradients.
WKV7_SEGMENTED_REMAT_KERNELS = WKV7_CHUNKED_REMAT_KERNELS + (
    "wkv7_chunked_end_state", "wkv7_chunked_transition", "wkv7_chunked_state_gradient")
ATTENTION_KERNELS = ("flash_attention_forward", "flash_attention_dq", "flash_attention_dkv")
QUANT_MATMUL_KERNELS = ("quant_matmul_int8", "quant_matmul_int4")
RWKV7_OUT_KERNELS = ("rwkv7_out_forward", "rwkv7_out_backward")
RWKV7_KEY_KERNELS = ("rwkv7_key_forward", "rwkv7_key_backward")
ADD_NORM_KERNELS = ("add_norm_forward", "add_norm_backward")
NORM_MIX_KERNELS = ("norm_mix_backward",)
# Entry names the compiled program gives the kernels of this package (a suffix _1, _2, ... tells copies apart).
KERNEL_PREFIXES = ("wkv4_", "wkv7_", "flash_attention_", "quant_matmul_", "rwkv7_out_", "rwkv7_key_",
                   "add_norm_", "norm_mix_")


@dataclasses.dataclass(frozen=True)
class Case:
  """One program to compile.

  Attributes:
    name: unique, used on the command line and in the results.
    description: one line: op, dtype, shape, mask.
    kernels: the Pallas kernels the compiled program must contain (a missing one fails the case: the op did not
      lower to the kernel).
    build: `build(abstract, block_sizes=None)` -> (function, abstract arguments); `block_sizes` (a BlockSizes)
      sets the attention settings it names, the rest keeping their defaults (attention cases other than the
      controls; other cases ignore it).
    group: "kernels", "models" or "controls".
    expect: "ok"; "known_spill" where the default settings are known to spill (`ltm_pallas.attention.config
      .SPILLING_DEFAULTS`: it must compile, and may spill); for a control the failure it must show:
      "compile_error" or "spill".
    dtype, head_dim: for the results table (head_dim: WKV-7 head size, attention head dim; None for WKV-4).
  """

  name: str
  description: str
  kernels: tuple[str, ...]
  build: Builder
  group: str = "kernels"
  expect: str = "ok"
  dtype: str = "bfloat16"
  head_dim: int | None = None


def _vjp_program(fn: Callable[..., Any], primals: tuple[Any, ...], abstract: Abstract, differentiable: int):
  """(f, args): f(*primals, *cotangents) returns fn's outputs and its VJP in the first `differentiable` arguments, so
  the program holds every forward kernel (outputs the backward does not read included) and the backward kernels."""

  def run(*args):
    fixed = args[differentiable:len(primals)]
    out, pullback = jax.vjp(lambda *xs: fn(*xs, *fixed), *args[:differentiable])
    return out, pullback(jax.tree.unflatten(jax.tree.structure(out), list(args[len(primals):])))

  out_shape = jax.eval_shape(fn, *primals)
  cotangents = [abstract(x.shape, x.dtype) for x in jax.tree.leaves(out_shape)]
  return run, (*primals, *cotangents)


# ----------------------------------------------------------------------------------------------------------------
# Kernel cases.


def _wkv4(batch: int, length: int, channels: int, dtype, *, remat: bool = False) -> Builder:
  """fwd+bwd of `wkv4`; with `remat`, under jax.checkpoint (the forward pass runs the primal)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    f32 = jnp.float32
    state = tuple(abstract((batch, channels), f32) for _ in range(3))
    seq = abstract((batch, length, channels), dtype)
    primals = (abstract((channels,), f32), abstract((channels,), f32), seq, seq, state)
    fn = functools.partial(wkv4.wkv4, interpret=False)
    return _vjp_program(jax.checkpoint(fn) if remat else fn, primals, abstract, 5)

  return build


def _wkv7(batch: int, length: int, heads: int, size: int, dtype) -> Builder:
  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    seq = abstract((batch, length, heads, size), dtype)
    primals = (seq,) * 6 + (abstract((batch, heads, size, size), jnp.float32),)
    return _vjp_program(jax.checkpoint(functools.partial(wkv7.wkv7, interpret=False)), primals, abstract, 7)

  return build


def _wkv7_chunked(batch: int, length: int, heads: int, size: int, dtype, **settings) -> Builder:
  """fwd+bwd of the chunked kernels at their default settings (or these), under jax.checkpoint (the primal is
  compiled too)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    seq = abstract((batch, length, heads, size), dtype)
    primals = (seq,) * 6 + (abstract((batch, heads, size, size), jnp.float32),)
    fn = functools.partial(wkv7_chunked.wkv7, interpret=False, **settings)
    return _vjp_program(jax.checkpoint(fn), primals, abstract, 7)

  return build


def _wkv7_segmented(batch: int, length: int, heads: int, size: int, dtype, segments: int) -> Builder:
  """fwd+bwd of the segmented chunked kernels at their default settings, under jax.checkpoint."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    seq = abstract((batch, length, heads, size), dtype)
    primals = (seq,) * 6 + (abstract((batch, heads, size, size), jnp.float32),)
    fn = functools.partial(wkv7_segmented.wkv7, segments=segments, interpret=False)
    return _vjp_program(jax.checkpoint(fn), primals, abstract, 7)

  return build


def _rwkv7_out(rows: int, heads: int, size: int, dtype) -> Builder:
  """fwd+bwd of the RWKV-7 output stage over `rows` = B * T rows of `heads` heads of `size` channels, at the row
  block the op picks for that many rows (`rwkv7_out.block_rows_for`)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    f32 = jnp.float32
    c = heads * size
    tile = abstract((rows, c), dtype)
    primals = (tile, abstract((heads, rows), f32), tile, tile, abstract((c,), f32), abstract((c,), f32))
    fn = lambda *xs: rwkv7_out.output(*xs, size, 64e-5, rwkv7_out.block_rows_for(rows), False)
    return _vjp_program(fn, primals, abstract, 6)

  return build


def _rwkv7_key(rows: int, heads: int, size: int, dtype) -> Builder:
  """fwd+bwd of the RWKV-7 key side over `rows` = B * T rows of `heads` heads of `size` channels, at the row block
  the op picks for that many rows (`rwkv7_key.block_rows_for`)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    c = heads * size
    tile, vector = abstract((rows, c), dtype), abstract((c,), jnp.float32)
    fn = lambda *xs: rwkv7_key.key_side(*xs, size, 1e-12, rwkv7_key.block_rows_for(rows), False)
    return _vjp_program(fn, (tile, tile, tile) + (vector,) * 4, abstract, 7)

  return build


def _add_norm(rows: int, channels: int, stream, dtype, kind: str = "rmsnorm") -> Builder:
  """fwd+bwd of the residual add and norm over `rows` = B * T rows of `channels`: the stream in `stream`, the
  sub-layer's output and the norm's output in `dtype`, at the op's row block (`add_norm.row_block`)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    vector = abstract((channels,), jnp.float32)
    fn = lambda *xs: add_norm.add_norm(*xs, kind, 1e-5, jnp.dtype(dtype),
                                       add_norm.row_block(rows, channels), False)
    return _vjp_program(fn, (abstract((rows, channels), stream), abstract((rows, channels), dtype), vector, vector),
                        abstract, 4)

  return build


def _norm_mix(batch: int, length: int, channels: int, dtype, *, mixes: int = 3, xn_rows: str = "all") -> Builder:
  """The norm and token-shift mixes of a token-shift layer, fwd+bwd through the op with the kernel backward
  (`ltm_jax.ops.norm_mix`, impl='pallas'): a layernorm over the stream in `dtype`; the time mix's three mixes and
  every row of xn, or the channel mix's one mix and xn's last rows."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    vector = abstract((channels,), jnp.float32)
    fn = lambda x, last, s, b, shifts: norm_mix.norm_mix(x, last, s, b, shifts, kind="layernorm", eps=1e-5,
                                                         dtype=jnp.dtype(dtype), impl="pallas", xn_rows=xn_rows)
    args = (abstract((batch, length, channels), dtype), abstract((batch, channels), jnp.float32), vector, vector,
            abstract((mixes, channels), jnp.float32))
    return _vjp_program(fn, args, abstract, 5)

  return build


def _attention(batch: int, length: int, q_heads: int, kv_heads: int, head_dim: int, dtype, *, causal: bool = True,
               window: int | None = None, segments: bool = False, kv_length: int | None = None,
               tiles: BlockSizes | None = None) -> Builder:
  """fwd+bwd of `flash_attention`; `tiles` (a BlockSizes) is fixed by the case, else the caller's or the default."""

  def build(abstract: Abstract, block_sizes=None):
    s = kv_length or length
    q = abstract((batch, length, q_heads, head_dim), dtype)
    kv = abstract((batch, s, kv_heads, head_dim), dtype)
    primals = (q, kv, kv)
    if segments:
      primals += (abstract((batch, length), jnp.int32), abstract((batch, s), jnp.int32))

    def fn(q, k, v, *segment_ids):
      return flash_attention(q, k, v, tuple(segment_ids) or None, causal=causal, window=window,
                             block_sizes=tiles or block_sizes, interpret=False)

    return _vjp_program(fn, primals, abstract, 3)

  return build


def _quant_matmul(rows: int, k: int, n: int, group: int, dtype) -> Builder:
  """One program with both quantised matmuls (forward only: inference): int8 per output channel and int4 in groups
  of `group`, x [rows, k] @ a [k, n] weight."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    i8, f32 = jnp.int8, jnp.float32

    def fn(x, w8, s8, w4, s4):
      return (quant_matmul.quant_matmul(x, w8, s8, packed=False, interpret=False),
              quant_matmul.quant_matmul(x, w4, s4, packed=True, interpret=False))

    return fn, (abstract((rows, k), dtype), abstract((1, k, n), i8), abstract((1, n), f32),
                abstract((k // group, group // 2, n), i8), abstract((k // group, n), f32))

  return build


def _kernel_cases() -> list[Case]:
  bf16, f32 = jnp.bfloat16, jnp.float32
  cases = [
      # WKV-4 at configs/small.py's training shape (B32 T1024 C512: B·C = PARALLEL_BELOW, the sequential path), at
      # one prompt of its prefill (B1: time-parallel), and at configs/tiny.py's float32 training shape (parallel).
      # The sequential cases run under jax.checkpoint so that the primal kernel is compiled too.
      Case("wkv4_seq_bf16", "wkv4 fwd+bwd bf16 B32 T1024 C512 (sequential; small)", WKV4_REMAT_KERNELS_SEQUENTIAL,
           _wkv4(32, 1024, 512, bf16, remat=True)),
      Case("wkv4_seq_f32", "wkv4 fwd+bwd f32 B32 T1024 C512 (sequential)", WKV4_REMAT_KERNELS_SEQUENTIAL,
           _wkv4(32, 1024, 512, f32, remat=True), dtype="float32"),
      Case("wkv4_par_bf16", "wkv4 fwd+bwd bf16 B1 T1024 C512 (time-parallel; small prefill)", WKV4_KERNELS_PARALLEL,
           _wkv4(1, 1024, 512, bf16)),
      Case("wkv4_par_f32", "wkv4 fwd+bwd f32 B32 T128 C128 (time-parallel; tiny)", WKV4_KERNELS_PARALLEL,
           _wkv4(32, 128, 128, f32), dtype="float32"),
      # WKV-7 at configs/small_rwkv7.py's training shape (8 heads of 64), and the same width in heads of 128, under
      # jax.checkpoint so that the primal kernel (inference, and the forward pass under remat) is compiled too.
      Case("wkv7_n64_bf16", "wkv7 fwd+bwd bf16 B32 T1024 H8 N64 (small_rwkv7)", WKV7_REMAT_KERNELS,
           _wkv7(32, 1024, 8, 64, bf16), head_dim=64),
      Case("wkv7_n64_f32", "wkv7 fwd+bwd f32 B32 T1024 H8 N64", WKV7_REMAT_KERNELS, _wkv7(32, 1024, 8, 64, f32),
           dtype="float32", head_dim=64),
      Case("wkv7_n128_bf16", "wkv7 fwd+bwd bf16 B32 T1024 H4 N128", WKV7_REMAT_KERNELS,
           _wkv7(32, 1024, 4, 128, bf16), head_dim=128),
      Case("wkv7_n128_f32", "wkv7 fwd+bwd f32 B32 T1024 H4 N128", WKV7_REMAT_KERNELS,
           _wkv7(32, 1024, 4, 128, f32), dtype="float32", head_dim=128),
  ]
  # The chunked WKV-7 kernels at benchmarks/wkv7.py's GPU shapes (C = H·N = 4096), bfloat16, and in float32 at the
  # largest head size they take in float32 (larger heads run the sequential kernels: wkv7_chunked.fits).
  for name, what, shape, dtype in (
      ("wkv7c_n64_bf16", "B8 T4096 H64 N64", (8, 4096, 64, 64), bf16),
      ("wkv7c_n128_bf16", "B8 T4096 H32 N128", (8, 4096, 32, 128), bf16),
      ("wkv7c_n64_long_bf16", "B1 T32768 H64 N64", (1, 32768, 64, 64), bf16),
      ("wkv7c_n32_f32", "B32 T1024 H16 N32", (32, 1024, 16, 32), f32),
  ):
    dtype_name = jnp.dtype(dtype).name
    cases.append(Case(name, f"wkv7 chunked fwd+bwd {dtype_name} {what}", WKV7_CHUNKED_REMAT_KERNELS,
                      _wkv7_chunked(*shape, dtype), dtype=dtype_name, head_dim=shape[3]))
  # The backward's other spill-free launch settings at small_rwkv7's shape (benchmarks/wkv7.py --mode backward times
  # them): its default, 255 registers on 8 warps, fills an SM's register file with one program; 4 warps at 255 hold
  # two independent programs per SM. (BV = 64 on 4 warps spills 340 B, BV = 32 looping on 4 warps 24 B.)
  for name, settings in (
      ("bv32_w4", dict(backward_block=32, backward_warps=4, backward_loop=False)),
      ("bv32_w8", dict(backward_block=32, backward_warps=8, backward_loop=False)),
      ("bv16_loop_w4", dict(backward_block=16, backward_warps=4, backward_loop=True)),
  ):
    cases.append(Case(f"wkv7c_n64_bwd_{name}", f"wkv7 chunked fwd+bwd bfloat16 B32 T1024 H8 N64, backward {settings}",
                      WKV7_CHUNKED_REMAT_KERNELS, _wkv7_chunked(32, 1024, 8, 64, bf16, **settings), dtype="bfloat16",
                      head_dim=64))
  # The long sequence in 8 segments of 4096 tokens (ltm_jax.ops.wkv7.pallas_segmented's choice at that shape).
  cases.append(Case("wkv7s_n64_long_bf16", "wkv7 segmented fwd+bwd bfloat16 B1 T32768 H64 N64, 8 segments",
                    WKV7_SEGMENTED_REMAT_KERNELS, _wkv7_segmented(1, 32768, 64, 64, bf16, 8), head_dim=64))
  # The RWKV-7 output stage and key side at small_rwkv7's training shape (B32 T1024, 8 heads of 64) and base_125m_rwkv7's at
  # batch 32 (B32 T2048, 12 heads of 64), bfloat16, and the first in float32.
  for name, what, shape, dtype in (
      ("rwkv7_out_n64_bf16", "B32 T1024 H8 N64 (small_rwkv7)", (32 * 1024, 8, 64), bf16),
      ("rwkv7_out_n64_h12_bf16", "B32 T2048 H12 N64 (base_125m_rwkv7)", (32 * 2048, 12, 64), bf16),
      ("rwkv7_out_n64_f32", "B32 T1024 H8 N64", (32 * 1024, 8, 64), f32)):
    dtype_name = jnp.dtype(dtype).name
    cases.append(Case(name, f"rwkv7_out fwd+bwd {dtype_name} {what}", RWKV7_OUT_KERNELS, _rwkv7_out(*shape, dtype),
                      dtype=dtype_name, head_dim=shape[2]))
    cases.append(Case(name.replace("_out_", "_key_"), f"rwkv7_key fwd+bwd {dtype_name} {what}", RWKV7_KEY_KERNELS,
                      _rwkv7_key(*shape, dtype), dtype=dtype_name, head_dim=shape[2]))
  # The RWKV-7 block's residual add and channel-mix norm (RMSNorm) at small_rwkv7's training shape (B32 T1024, C 512)
  # and base_125m_rwkv7's at batch 32 (B32 T2048, C 768: masked 1024-wide blocks): the float32 stream with bfloat16
  # sub-layer and norm outputs (the model's mix), and all float32 (the larger tiles).
  for name, rows, c, dtype in (("add_norm_c512_bf16", 32 * 1024, 512, bf16), ("add_norm_c512_f32", 32 * 1024, 512, f32),
                               ("add_norm_c768_bf16", 32 * 2048, 768, bf16)):
    dtype_name = jnp.dtype(dtype).name
    cases.append(Case(name, f"add_norm fwd+bwd float32 stream, {dtype_name} B32 T{rows // 32} C{c} rmsnorm",
                      ADD_NORM_KERNELS, _add_norm(rows, c, f32, dtype), dtype=dtype_name))
  # The time mix's norm and mixes (the backward kernel) at small_rwkv7's shape (C 512) and base_125m_rwkv7's at batch
  # 32 (C 768: six column chunks of 128), bfloat16 as the configs run it, and float32.
  for name, shape, dtype in (("norm_mix_c512_bf16", (32, 1024, 512), bf16), ("norm_mix_c512_f32", (32, 1024, 512), f32),
                             ("norm_mix_c768_bf16", (32, 2048, 768), bf16)):
    dtype_name = jnp.dtype(dtype).name
    cases.append(Case(name, f"norm_mix fwd+bwd {dtype_name} B{shape[0]} T{shape[1]} C{shape[2]} layernorm",
                      NORM_MIX_KERNELS, _norm_mix(*shape, dtype), dtype=dtype_name))
  # The channel mix's: one mix, no gradient of xn but its last rows (base_125m_rwkv7's width).
  cases.append(Case("norm_mix_c768_m1_bf16",
                    "norm_mix fwd+bwd bfloat16 B32 T2048 C768 layernorm, one mix, xn's last rows",
                    NORM_MIX_KERNELS, _norm_mix(32, 2048, 768, bf16, mixes=1, xn_rows="last"), dtype="bfloat16"))
  # Flash attention. Head dim 64: base_125m (B64 T2048, 12 query heads on 4 key/value heads) and small_rwkv7 /
  # small (B32 T1024, 8 heads, window 512); head dim 32: tiny (float32). Head dims 128 and 256: B * T = 16k tokens and
  # Hq * D = 2048 (the benchmark's GPU shapes), GQA 4:1 unless said.
  attention = [
      ("attn_d64_bf16_causal_gqa", "causal, GQA 12:4, B64 T2048 (base_125m)", 64, bf16,
       dict(batch=64, length=2048, q_heads=12, kv_heads=4)),
      ("attn_d64_bf16_window_mha", "window 512, 8 heads, B32 T1024 (small_rwkv7)", 64, bf16,
       dict(batch=32, length=1024, q_heads=8, kv_heads=8, window=512)),
      ("attn_d64_bf16_full_seg", "non-causal, segment ids, GQA 12:4, B8 T2048", 64, bf16,
       dict(batch=8, length=2048, q_heads=12, kv_heads=4, causal=False, segments=True)),
      ("attn_d64_f32_causal_gqa", "causal, GQA 12:4, B8 T2048", 64, f32,
       dict(batch=8, length=2048, q_heads=12, kv_heads=4)),
      ("attn_d32_f32_causal_mha", "causal, 4 heads, B32 T128 (tiny)", 32, f32,
       dict(batch=32, length=128, q_heads=4, kv_heads=4)),
      ("attn_d128_bf16_causal_gqa", "causal, GQA 16:4, B4 T4096", 128, bf16,
       dict(batch=4, length=4096, q_heads=16, kv_heads=4)),
      ("attn_d128_bf16_causal_mqa", "causal, MQA 16:1, B4 T4096", 128, bf16,
       dict(batch=4, length=4096, q_heads=16, kv_heads=1)),
      ("attn_d128_bf16_window_seg", "causal, window 256, segment ids, GQA 16:4, B4 T4096", 128, bf16,
       dict(batch=4, length=4096, q_heads=16, kv_heads=4, window=256, segments=True)),
      ("attn_d128_f16_causal_gqa", "causal, GQA 16:4, B4 T4096", 128, jnp.float16,
       dict(batch=4, length=4096, q_heads=16, kv_heads=4)),
      ("attn_d128_f32_causal_gqa", "causal, GQA 16:4, B4 T4096", 128, f32,
       dict(batch=4, length=4096, q_heads=16, kv_heads=4)),
      ("attn_d256_bf16_causal_gqa", "causal, GQA 8:2, B4 T4096", 256, bf16,
       dict(batch=4, length=4096, q_heads=8, kv_heads=2)),
      ("attn_d256_bf16_window_seg", "causal, window 256, segment ids, GQA 8:2, B4 T4096", 256, bf16,
       dict(batch=4, length=4096, q_heads=8, kv_heads=2, window=256, segments=True)),
      ("attn_d256_f32_causal_mqa", "causal, MQA 8:1, B4 T4096", 256, f32,
       dict(batch=4, length=4096, q_heads=8, kv_heads=1)),
  ]
  for name, what, d, dtype, shape in attention:
    dtype_name = jnp.dtype(dtype).name
    known_spill = config.defaults_spill(d, dtype)
    cases.append(Case(name, f"attention fwd+bwd {dtype_name} D{d} {what}" + (" (known spill)" if known_spill else ""),
                      ATTENTION_KERNELS, _attention(head_dim=d, dtype=dtype, **shape),
                      expect="known_spill" if known_spill else "ok", dtype=dtype_name, head_dim=d))
  # Quantised weights: a decoding step of base_125m's MLP (d_model 768 -> 3072, 8 rows) and a 4096-wide square
  # projection at 64 rows, int8 per channel and int4 in groups of 128.
  for name, what, shape, dtype in (
      ("quant_matmul_bf16_768", "B8 K768 N3072 (base_125m MLP, decoding)", (8, 768, 3072, 128), bf16),
      ("quant_matmul_bf16_4096", "B64 K4096 N4096", (64, 4096, 4096, 128), bf16),
      ("quant_matmul_f32_768", "B8 K768 N3072", (8, 768, 3072, 128), f32)):
    dtype_name = jnp.dtype(dtype).name
    cases.append(Case(name, f"quant_matmul int8 + int4 (group {shape[3]}) {dtype_name} {what}", QUANT_MATMUL_KERNELS,
                      _quant_matmul(*shape, dtype), dtype=dtype_name))
  return cases


def _control_cases() -> list[Case]:
  return [
      # 256 x 256 tiles of head dim 128 in 4 pipeline stages want several times the 227 KiB of shared memory a block
      # may have: the compiler must refuse.
      Case("control_smem", "CONTROL: attention fwd+bwd bf16 D128, fwd tiles 256 x 256, 4 stages (must not compile)",
           ATTENTION_KERNELS,
           _attention(4, 4096, 16, 4, 128, jnp.bfloat16, tiles=BlockSizes(fwd_q=256, fwd_k=256, fwd_stages=4)),
           group="controls", expect="compile_error", head_dim=128),
      # A forward program of 128 rows of head dim 256 on 4 warps keeps a 128 x 256 float32 accumulator, 256 values
      # per thread, besides its tiles: it must spill.
      Case("control_spill", "CONTROL: attention fwd+bwd bf16 D256, forward 128 x 64 tiles on 4 warps (must spill)",
           ATTENTION_KERNELS,
           _attention(4, 4096, 8, 2, 256, jnp.bfloat16,
                      tiles=BlockSizes(fwd_q=128, fwd_k=64, fwd_warps=4, fwd_stages=1)),
           group="controls", expect="spill", head_dim=256),
  ]


# ----------------------------------------------------------------------------------------------------------------
# Model cases.


def _place(tree, abstract: Abstract):
  return jax.tree.map(lambda x: abstract(x.shape, x.dtype), tree)


def _config(name: str, overrides: tuple[str, ...] = ()):
  from ltm_jax.config import apply_overrides, load_config, validate  # pylint: disable=g-import-not-at-top

  cfg = load_config(ROOT / "configs" / f"{name}.py")
  return validate(apply_overrides(cfg, list(overrides))) if overrides else cfg


def train_step(config_name: str, overrides: tuple[str, ...] = ()) -> Builder:
  """The config's whole train step (ltm_jax.train.step, one device) at its batch_size x seq_len; `overrides`:
  key=value config overrides."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    # pylint: disable=g-import-not-at-top
    from ltm_jax import model as model_lib
    from ltm_jax.train.optimizer import learning_rate, make_optimizer
    from ltm_jax.state import abstract_train_state
    from ltm_jax.train.step import make_train_step

    cfg = _config(config_name, overrides)
    m, t = cfg.model, cfg.train
    optimizer = make_optimizer(t)
    state = abstract_train_state(cfg, optimizer)
    batch = {k: abstract((t.batch_size, t.seq_len), jnp.int32) for k in ("inputs", "targets")}
    step = make_train_step(model_lib.LM(m, cfg.latent), optimizer, learning_rate(t), t.grad_accum)
    return step, (_place(state, abstract), batch)

  return build


def _generation(config_name: str, batch: int = 8, prompt: int = 512, new_tokens: int = 64,
                quantize: str | None = None) -> Builder:
  """Prefill of `batch` left-padded prompts and the on-device decode loop (ltm_jax.inference.generate), sampling with
  temperature and top-p, as `LanguageModel.generate` runs them. `quantize` ("int8", "int4"): the weights of
  `LanguageModel.quantize`, every kernel read as stored (a GPU's default; the compiling host is a CPU, so it is
  passed explicitly)."""

  def build(abstract: Abstract, block_sizes=None):
    del block_sizes
    # pylint: disable=g-import-not-at-top
    from ltm_jax import model as model_lib
    from ltm_jax.inference import generate
    from ltm_jax.inference import quantize as quantize_lib

    cfg = _config(config_name)
    capacity = -(-(prompt + new_tokens) // 64) * 64
    model = model_lib.LM(cfg.model, cfg.latent, cache_capacity=capacity)
    axes = model_lib.param_axes(cfg.model, cfg.latent)

    def make_params():
      params = model_lib.init_params(cfg.model, jax.random.key(0), cfg.latent)
      return params if quantize is None else quantize_lib.quantize_params(params, axes, quantize)

    params = jax.eval_shape(make_params)
    keep = None if quantize is None else quantize_lib.kernels_read_quantized("gpu")

    def run(params, tokens, lengths, key):
      decoding = generate.prefill(model, params, tokens, lengths, kernels_as_stored=keep)
      return generate.decode(model, params, decoding, key, steps=new_tokens, temperature=0.8, top_p=0.95,
                             kernels_as_stored=keep)

    args = (_place(params, abstract), abstract((batch, prompt), jnp.int32), abstract((batch,), jnp.int32),
            abstract((2,), jnp.uint32))
    return run, args

  return build


def _model_cases() -> list[Case]:
  attention = ATTENTION_KERNELS
  return [
      # The RWKV-7 layers bound their decay (the op's w_min), so the chunked WKV-7 kernels run without the sequential
      # ones beside them; the attention blocks' add and norm are the add_norm kernels. The norm + mixes' backward is
      # XLA's on GPUs (ops.norm_mix.AUTO; its kernel has cases of its own above).
      Case("train_small_rwkv7", "small_rwkv7 train step, bf16 B32 T1024 (WKV-7 N64, window-512 attention D64)",
           WKV7_CHUNKED_KERNELS + attention + ADD_NORM_KERNELS, train_step("small_rwkv7"),
           group="models",
           head_dim=64),
      Case("train_base_125m", "base_125m train step, bf16 B64 T2048 (GQA 12:4 attention D64)",
           attention + ADD_NORM_KERNELS, train_step("base_125m"), group="models", head_dim=64),
      # Decoding steps take the reference paths (one token: scan, cache attention: xla); the prefill takes the
      # forward kernels (its padding is a segment id).
      Case("generate_small_rwkv7", "small_rwkv7 prefill B8 T512 + 64-token decode loop",
           ("wkv7_chunked_forward_primal", "flash_attention_forward"), _generation("small_rwkv7"), group="models",
           head_dim=64),
      Case("generate_base_125m", "base_125m prefill B8 T512 + 64-token decode loop", ("flash_attention_forward",),
           _generation("base_125m"), group="models", head_dim=64),
      Case("generate_small_rwkv7_int4", "small_rwkv7 int4 g128 weights read as stored: prefill B8 T512 + 64-token "
           "decode loop", ("quant_matmul_int4", "wkv7_chunked_forward_primal"),
           _generation("small_rwkv7", quantize="int4"),
           group="models", head_dim=64),
      Case("generate_small_rwkv7_int8", "small_rwkv7 int8 weights read as stored: prefill B8 T512 + 64-token decode "
           "loop", ("quant_matmul_int8", "wkv7_chunked_forward_primal"), _generation("small_rwkv7", quantize="int8"),
           group="models", head_dim=64),
  ]


# The kernel cases the test suite compiles (tests/test_gpu_aot.py, with both controls); `make gpu-aot` compiles every
# case and the committed report covers them all. One case per kernel (every kernel any case names is compiled): WKV-4
# sequential and time-parallel, WKV-7 at head size 128 in float32 (the largest state per program), the segmented
# WKV-7 (which runs the chunked kernels too), the quantised matmul, the RWKV-7 output stage, key side and block norm
# in float32 (the larger tiles), the time mix's norm backward at C 768, and attention twice: bfloat16 with a window,
# segment ids and grouped heads, and
# float32 at head dim 256 (the most registers of the default tiles). The rest repeat one of these kernels at another
# dtype, shape or default-tile row.
SUITE_CASES = ("wkv4_seq_bf16", "wkv4_par_f32", "wkv7_n128_f32", "wkv7s_n64_long_bf16", "attn_d128_bf16_window_seg",
               "attn_d256_f32_causal_mqa", "quant_matmul_f32_768",
               "rwkv7_out_n64_f32", "rwkv7_key_n64_f32", "add_norm_c512_f32", "norm_mix_c768_bf16")


def all_cases() -> dict[str, Case]:
  """Every case by name: kernels, then models, then controls."""
  cases = _kernel_cases() + _model_cases() + _control_cases()
  names = [c.name for c in cases]
  assert len(names) == len(set(names)), names
  return {c.name: c for c in cases}
