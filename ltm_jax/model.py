"""The decoder LM: token embedding, a stack of pre-norm blocks (mixer, latent cross-attention, FFN), final norm and
LM head.

Every block maps (x, state) -> (y, new_state), so a long sequence can be processed segment by segment:
`logits, state = model.apply(params, tokens_a)` then `model.apply(params, tokens_b, state)` equals one call on both.
With `latent.enabled`, every block (or the top latent.top_layers blocks) also reads its layer's latent thought
vectors through cross-attention, and every call takes z [B, latent layers, n_per_layer, d_model] (see
ltm_jax/latent.py for how z is inferred). The blocks below the first that reads z are the model's trunk: their output
(`Trunk`) does not depend on z, so a caller that scores one batch under many z computes it once (`trunk_only=True`)
and passes it back (`trunk=`) for each z.

`model.remat` picks what each block keeps for the backward pass (`remat_plan`). `model.scan_layers` runs the repeats of
the layer pattern's smallest unit under `nn.scan` (`scan_layout`), so compile time stays flat as depth grows; their
parameters and states then carry a leading "layers" axis (`scan_params`, `unscan_params`, `unscan_state` map between
the two layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ltm_jax import sublayers
from ltm_jax.config import LatentConfig, ModelConfig
from ltm_jax.layers.add_norm import AddNorm, NormParameters
from ltm_jax.layers import CrossAttention, SplitLatents
from ltm_jax.layers.common import init, norm
from ltm_jax.layers import pattern as layer_pattern
from ltm_jax.layers import pipeline
from ltm_jax.layers.latent_encoder import LatentEncoder
from ltm_jax.ops import cross_entropy
from ltm_jax.ops.quant_matmul import weights as quant_weights

SCANNED = "blocks"  # The parameter (and module) name of the scanned stack of blocks.
LAYER_AXIS = "layers"  # The logical name of the stacked parameters' leading axis; sharding leaves it whole.


class Trunk(NamedTuple):
  """What the blocks below the first latent-reading block hand on: the residual stream x [B, T, d_model] float32 and
  the first RWKV-7 layer's values v_first [B, T, d_model] (None if no RWKV-7 layer lies below). Slice both along T
  to score a prefix."""
  x: jax.Array
  v_first: jax.Array | None

  def prefix(self, length: int | None) -> Trunk:
    """The first `length` positions (all of them for None)."""
    cut = lambda a: None if a is None else a[:, :length]
    return Trunk(cut(self.x), cut(self.v_first))


class BlockState(NamedTuple):
  mixer: Any  # KVCache for attention, TimeMixState for RWKV-4, TimeMix7State for RWKV-7, TitansState for M and G.
  ffn: Any  # ChannelMixState for both channel-mixes, None for SwiGLU.


# ------------------------------------------------------------------------------------------------------------- remat


class RematPlan(NamedTuple):
  """How a remat policy is applied. `block_policy`: the whole block runs under nn.remat with this jax checkpoint
  policy (None: the block is not rematerialised as a whole). `recompute`: the sub-layers ("mixer",
  "cross_attention", "ffn") that run under their own nn.remat, so only their inputs are kept and their insides are
  recomputed in the backward pass while the other sub-layers keep all their residuals."""
  block_policy: Callable[..., bool] | None
  recompute: frozenset[str]


SUBLAYERS = frozenset({"mixer", "cross_attention", "ffn"})


def remat_plan(policy: str) -> RematPlan:
  """The plan for a `model.remat` value.

  none: nothing recomputed. full: each block keeps only its input and recomputes everything. minimal: each block keeps
  the outputs of its weight matmuls (q/k/v/out, r/k/v, FFN up/gate/down...) and recomputes the cheap rest (norms,
  activations, the attention or WKV core). save_<sub-layers>: those sub-layers keep their residuals and the others are
  recomputed from their inputs. A sub-layer is saved or recomputed whole because its own backward needs its insides:
  keeping only its output would still recompute it.
  """
  if policy == "none":
    return RematPlan(None, frozenset())
  if policy == "full":
    return RematPlan(jax.checkpoint_policies.nothing_saveable, frozenset())
  if policy == "minimal":
    return RematPlan(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, frozenset())
  saved = {"save_mixer": {"mixer"}, "save_ffn": {"ffn"}, "save_cross_attention": {"cross_attention"},
           "save_mixer_ffn": {"mixer", "ffn"}}
  if policy not in saved:
    raise ValueError(f"unknown remat policy {policy!r}")
  return RematPlan(None, SUBLAYERS - saved[policy])


def _std(cfg: ModelConfig) -> tuple[float, float]:
  """(input projections, output projections): outputs scaled by 1/sqrt(2 L) so the residual stream starts small."""
  return cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)


def cache_capacity(cfg: ModelConfig, capacity: int | None = None) -> int:
  """Ring size of the attention caches: the window for sliding-window layers, else `capacity` (None:
  model.max_seq_len), which must cover every position the cache will see."""
  return cfg.window if cfg.window is not None else (cfg.max_seq_len if capacity is None else capacity)


class Block(nn.Module):
  """x + mixer(norm(x)), then x + cross_attention(norm(x), z_l) when latents are on, then x + ffn(norm(x));
  x: [B, T, d_model], z_l: [B, n_per_layer, d_model], positions: [B, T] (only for latent RoPE).

  The last residual add is left to the caller: the block returns the stream as (x, d) with d the FFN's output, and
  the next block takes d as `pending` and adds it with its first norm as one op (`AddNorm`), as it does between its
  own sub-layers; `pending` None means x is the whole stream.

  Returns (x, d, state, v_first): the stream after the block is x + d; v_first [B, T, d_model] is the first RWKV-7
  layer's values, made by that layer and read by every later RWKV-7 layer (value residual); other blocks pass it
  through."""
  cfg: ModelConfig
  layer: int
  latent: LatentConfig | None = None
  scanned: bool = False  # Inside nn.scan, where remat needs no CSE barrier (the loop body already is one).
  capacity: int | None = None  # Attention cache capacity (see `cache_capacity`).

  def _sublayer(self, cls: type[nn.Module], role: str) -> type[nn.Module]:
    """`cls`, under nn.remat when the remat policy recomputes this sub-layer (same parameters either way)."""
    if role in remat_plan(self.cfg.remat).recompute:
      return nn.remat(cls, prevent_cse=not self.scanned)
    return cls

  @nn.compact
  def __call__(self, x, state: BlockState | None = None, z=None, positions=None, v_first=None, valid=None,
               pending=None):
    cfg, mixer_kind = self.cfg, self.cfg.mixers[self.layer]
    std, out_std = _std(cfg)
    site = sublayers.Site(cfg, self.layer, std, out_std, cache_capacity(cfg, self.capacity))
    mixer_entry = sublayers.MIXER_KINDS[mixer_kind]
    mixer_cls, mixer_args = mixer_entry.build(site)
    mixer = self._sublayer(mixer_cls, "mixer")(**mixer_args, name="mixer")
    ffn_entry = sublayers.FFN_KINDS[cfg.ffn_kind(mixer_kind)]
    ffn_cls, ffn_args = ffn_entry.build(site)
    ffn = self._sublayer(ffn_cls, "ffn")(**ffn_args, name="ffn")
    mixer_state, ffn_state = (None, None) if state is None else state
    if mixer_entry.normalizes_input:  # The mixer normalises the stream with its own input stage (one op).
      x = _added(x, pending)
      h, mixer_kw = x, dict(norm=NormParameters(cfg.norm, name="mixer_norm")(x.shape[-1]))
    else:
      x, h = _add_norm(cfg, "mixer_norm", x, pending, token_shifted=mixer_entry.token_shift)
      mixer_kw = {}
    if mixer_entry.value_residual:
      h, mixer_state, v_first, *stream = mixer(h, mixer_state, v_first, valid, **mixer_kw)
    else:
      h, mixer_state, *stream = mixer(h, mixer_state, valid, **mixer_kw)
    if mixer_entry.normalizes_input:  # The stream as the mixer returns it: the residual's gradient joins its op's.
      x = stream[0]
    # Each sub-layer's residual add and the next one's norm as one op (one kernel each way on GPU; on CPU flax's
    # arithmetic, the values of the add followed by the norm module, whose parameters it keeps), unless the next
    # sub-layer normalises its input itself.
    if self.latent is not None:
      cross = self._sublayer(CrossAttention, "cross_attention")(
          n_heads=cfg.n_heads, head_dim=cfg.head_dim, std=std, out_std=out_std,
          rope_span=self.latent.rope_span if self.latent.rope else None, rope_theta=cfg.rope_theta,
          impl=cfg.attention_impl, dtype=cfg.dtype, fp8=cfg.fp8, name="cross_attention")
      x, h = _add_norm(cfg, "cross_norm", x, h)
      h = cross(h, z, positions)
    if ffn_entry.normalizes_input:  # As the mixer's: the FFN normalises the stream and hands it back.
      x = _added(x, h)
      h, ffn_state, x = ffn(x, ffn_state, valid, norm=NormParameters(cfg.norm, name="ffn_norm")(x.shape[-1]))
    else:
      x, h = _add_norm(cfg, "ffn_norm", x, h, token_shifted=ffn_entry.token_shift)
      h, ffn_state = ffn(h, ffn_state, valid)
    return x, h, BlockState(mixer_state, ffn_state), v_first


def _added(x, pending):
  """The residual stream x + pending in x's dtype (x where nothing is pending)."""
  return x if pending is None else x + pending.astype(x.dtype)


def _add_norm(cfg: ModelConfig, name: str, x, d, token_shifted: bool = False, impl: str = "auto"):
  """(x + d, norm(x + d)) as one `AddNorm` op named `name` (`impl` its backend); d None: (x, norm(x)) by the norm
  module, whose parameters are the same. The norm's output is in the compute dtype."""
  if d is None:
    return x, norm(cfg.norm, cfg.norm_eps, cfg.dtype, name)(x)
  return AddNorm(cfg.norm, cfg.norm_eps, cfg.dtype, impl=impl, token_shifted=token_shifted, name=name)(x, d)


def _defers_residual_add(cfg: ModelConfig) -> bool:
  """Whether a block's last residual add joins the next block's first norm. Not under whole-block remat: a block
  keeps its inputs for the backward pass, and x and a pending d would be two streams to keep where one is now."""
  return remat_plan(cfg.remat).block_policy is None


def _block_class(cfg: ModelConfig, scanned: bool) -> type[Block]:
  """Block, under nn.remat with the policy's jax checkpoint policy when it rematerialises whole blocks."""
  policy = remat_plan(cfg.remat).block_policy
  return Block if policy is None else nn.remat(Block, policy=policy, prevent_cse=not scanned)


# ------------------------------------------------------------------------------------------------------ scanned layers


class ScanLayout(NamedTuple):
  """How the layers are laid out. The first `prefix_layers` layers are separate blocks (`block_{i}`); then
  `scanned_units` repeats of the pattern's smallest unit of `period` layers run under nn.scan, stacked under `blocks`
  with children `block_{j}` (j < period) whose parameters have a leading [scanned_units] axis. Layer
  prefix_layers + u * period + j is repeat u's block j."""
  period: int
  prefix_layers: int
  scanned_units: int


def scan_layout(cfg: ModelConfig) -> ScanLayout:
  """Every layer is a separate block unless `scan_layers`. When scanning, the unit holding the first RWKV-7 layer
  stays separate: that layer makes v_first and has no value-residual parameters, unlike the RWKV-7 layers after it."""
  period = layer_pattern.period(cfg.layer_pattern)
  if not cfg.scan_layers:
    return ScanLayout(period, cfg.n_layers, 0)
  return ScanLayout(period, layer_pattern.prefix_units(cfg.layer_pattern) * period, cfg.scanned_units)


class _Unit(nn.Module):
  """One repeat of the layer pattern's unit: the body of the layer scan. carry: (x [B, T, d_model], v_first), x the
  whole stream (the unit adds its last block's output);
  per repeat: states (one BlockState per block of the unit, or None) and z [B, period, n_per_layer, d_model] (or
  None); positions are shared by every repeat."""
  cfg: ModelConfig
  first_layer: int  # The layer index of the unit's first block in the first scanned repeat (picks mixers).
  latent: LatentConfig | None = None
  capacity: int | None = None

  @nn.compact
  def __call__(self, carry, states, z, positions, valid):
    x, v_first = carry
    block_cls, new_states, pending = _block_class(self.cfg, scanned=True), [], None
    for j in range(scan_layout(self.cfg).period):
      x, pending, block_state, v_first = block_cls(self.cfg, self.first_layer + j, self.latent, scanned=True,
                                                   capacity=self.capacity, name=f"block_{j}")(
          x, None if states is None else states[j], None if z is None else z[:, j], positions, v_first, valid, pending)
      if not _defers_residual_add(self.cfg):
        x, pending = _added(x, pending), None
      new_states.append(block_state)
    return (_added(x, pending), v_first), tuple(new_states)


class LM(nn.Module):
  """tokens [B, T] int -> (logits [B, T, vocab_size] float32, state). The LM head is padded to a multiple of 128
  for fast matmuls; the padded columns are sliced off the logits. With `targets` [B, T] int the call returns the
  token NLL [B, T] float32 instead of the logits (`ops.cross_entropy.token_nll`): model.loss_chunk positions at a
  time, the padded columns masked out of the softmax rather than sliced off. The residual stream is
  model.residual_dtype: float32 by default whatever `dtype` is (sub-layers compute in `dtype` and their outputs are
  added in float32), as PyTorch autocast does, so deep bfloat16 models do not accumulate rounding in the residual sum;
  bfloat16 halves the stream's bytes.

  `latent`: None (or disabled) for the plain decoder; enabled adds a cross-attention sub-layer to every block of the
  top latent.top_layers (all by default), and `latents` [B, top layers, n_per_layer, d_model] (`latent_shape`) must
  then be given, or a `SplitLatents` pair of such z (each position reading one of them; not with scan_layers).
  `positions` [B, T] are the tokens' absolute
  positions, needed only by latent RoPE when decoding past position 0 (default: 0..T-1).

  `state`: as `init_state` makes it: one BlockState per layer, or with scan_layers one per separate layer followed by
  one per unit block with every leaf stacked over the scanned repeats. Without a state every layer starts empty and
  full-attention layers make caches of `cache_capacity` (None: model.max_seq_len) slots.

  `valid` [B, T] bool marks left padding (False) of ragged prompts: padding changes no state and is seen by no
  token, so each row's valid tokens get the logits and final state they would get alone. Padding must precede a
  row's tokens; with latent RoPE, `positions` must then count valid tokens only. `last_only` returns the logits of
  the last position only ([B, 1, vocab_size]) and every layer's state, as a prefill needs (under a pipeline mesh too).

  `trunk_only=True` returns the `Trunk` (the output of the blocks below the first latent-reading block) and nothing
  else; `trunk=` a Trunk of the same tokens starts from it instead, running only the latent-reading blocks and the
  head: the same result as a call without it. Both are stateless (no `state`).
  """
  cfg: ModelConfig
  latent: LatentConfig | None = None
  cache_capacity: int | None = None

  @nn.compact
  def __call__(self, tokens, state: tuple[BlockState, ...] | None = None, latents=None, positions=None, valid=None,
               last_only: bool = False, targets=None, *, trunk_only: bool = False, trunk: Trunk | None = None):
    # Every float32 matmul traced below takes the configured precision (on GPU, XLA's default would be TF32).
    with jax.default_matmul_precision(self.cfg.matmul_precision):
      return self._forward(tokens, state, latents, positions, valid, last_only, targets, trunk_only, trunk)

  def _forward(self, tokens, state, latents, positions, valid, last_only, targets, trunk_only, trunk):
    cfg, latent = self.cfg, uses_latents(self.latent)
    if (trunk_only or trunk is not None) and (latent is None or state is not None):
      raise ValueError("a trunk is what a latent model's lower blocks make from tokens alone: it needs "
                       "latent.enabled and no state")
    first = first_latent_layer(cfg, latent)
    if latent is not None and not trunk_only:
      expected = latent_shape(cfg, latent, tokens.shape[0])
      if latents is None or latents.shape != expected:
        got = None if latents is None else latents.shape
        raise ValueError(f"this model reads latent thought vectors: pass latents of shape {expected}, got {got}")
    elif latents is not None:
      raise ValueError("latents were given to a model without latent cross-attention (latent.enabled=false)")
    embed = nn.Embed(cfg.padded_vocab_size, cfg.d_model, dtype=jnp.float32, param_dtype=jnp.float32,
                     embedding_init=init(cfg.init_std, ("vocab", "embed")), name="embed")
    if trunk is not None:
      x, pending, new_state, _ = _run_blocks(cfg, trunk.x, None, latent, latents, positions, valid,
                                             self.cache_capacity, first, None, trunk.v_first)
    else:
      x = embed(tokens)
      if cfg.ln0:  # In float32: it feeds the residual stream.
        x = norm(cfg.norm, cfg.norm_eps, jnp.float32, "embed_norm")(x)
      x = x.astype(cfg.residual_dtype)  # Every block adds its sub-layers' outputs in this dtype.
      if trunk_only:
        x, pending, _, v_first = _run_blocks(cfg, x, None, latent, None, positions, valid, self.cache_capacity, 0,
                                             first)
        return Trunk(_added(x, pending), v_first)
      # A prefill (last_only) hands its state to decoding, so its scanned layers cannot run as pipeline stages.
      x, pending, new_state, _ = _run_blocks(cfg, x, state, latent, latents, positions, valid, self.cache_capacity,
                                             0, None, pipelined=not last_only)
    if last_only:  # A prefill needs the next token's logits only: skip the [B, T, vocab] head product.
      x, pending = x[:, -1:], None if pending is None else pending[:, -1:]
    # Nothing reads the final stream: XLA's form drops its sum and fuses the add into the norm, where the kernels
    # would write the sum and read back a zero gradient for it.
    _, x = _add_norm(cfg, "final_norm", x, pending, impl="xla")
    # The head multiplies in the compute dtype and accumulates into float32 logits: rounding them to bfloat16 would
    # cost every logit (and the loss's softmax) 8 mantissa bits.
    if cfg.tie_embeddings:
      kernel = embed.embedding.T
    else:
      kernel = _HeadKernel(cfg, name="head")()
    if quant_weights.is_quantized(kernel):  # An untied head stored quantised (see common.Dense).
      if targets is None:
        logits = quant_weights.matmul(x.astype(jnp.float32), kernel, 1, (cfg.padded_vocab_size,))
        return logits[..., :cfg.vocab_size], new_state
      kernel = quant_weights.dequantize(kernel)
    x, kernel = x.astype(cfg.dtype), kernel.astype(cfg.dtype)
    if targets is not None:
      return cross_entropy.token_nll(x, kernel, targets, cfg.vocab_size, cfg.loss_chunk), new_state
    logits = jnp.dot(x, kernel, preferred_element_type=jnp.float32)
    return logits[..., :cfg.vocab_size], new_state


class _HeadKernel(nn.Module):
  """The untied LM head's kernel [d_model, padded vocab] (the parameter `head/kernel`), for the caller to multiply:
  either into logits or chunk by chunk inside the loss; as stored when it is quantised."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self) -> jax.Array:
    cfg = self.cfg
    if self.has_variable("params", "kernel") and quant_weights.is_quantized(self.get_variable("params", "kernel")):
      return self.get_variable("params", "kernel")
    return self.param("kernel", init(cfg.init_std, ("embed", "vocab")), (cfg.d_model, cfg.padded_vocab_size),
                      jnp.float32)


def run_blocks(cfg: ModelConfig, x, state: tuple[BlockState, ...] | None = None, *, latent: LatentConfig | None = None,
               latents=None, positions=None, valid=None, capacity: int | None = None):
  """The block stack of `cfg` over x [B, T, d_model] -> (x [B, T, d_model] before the final norm, new state in
  `init_state`'s layout). Arguments as `LM` takes them (`latent` already filtered by `uses_latents`).

  Called inside a compact method, the blocks become the caller's submodules (`block_{i}`, and `blocks` when
  scanned), so a model with its own input embedding and head (ltm_jax/timeseries) runs the same layers with the same
  parameter layout, state API and padding rules as the decoder."""
  x, pending, new_state, _ = _run_blocks(cfg, x, state, latent, latents, positions, valid, capacity, 0, None)
  return _added(x, pending), new_state


def _run_blocks(cfg: ModelConfig, x, state, latent, latents, positions, valid, capacity, start: int,
                stop: int | None, v_first=None, *, pipelined: bool = True):
  """Layers start..stop-1 (stop None: to the last) from x and v_first -> (x, pending, new state of those layers,
  v_first): the stream after them is x + pending (`Block`; pending None where nothing is left to add).
  The blocks from `first_latent_layer` on read latents[:, layer - first_latent_layer]; the layer scan runs only when
  the range reaches the end and starts at or before the scanned repeats (a latent model that scans has no trunk).
  `pipelined`: whether a stateless call may run the scanned repeats as pipeline stages (`_scanned`)."""
  layout = scan_layout(cfg)
  first = first_latent_layer(cfg, latent)
  stop = cfg.n_layers if stop is None else stop
  block_cls, new_state, pending = _block_class(cfg, scanned=False), [], None
  for i in range(start, min(stop, layout.prefix_layers)):
    reads = latent is not None and i >= first
    z = None if not reads else (
        latents.layer(i - first) if isinstance(latents, SplitLatents) else latents[:, i - first])
    x, pending, block_state, v_first = block_cls(cfg, i, latent if reads else None, capacity=capacity,
                                                 name=f"block_{i}")(
        x, None if state is None else state[i], z, positions, v_first, valid, pending)
    if not _defers_residual_add(cfg):
      x, pending = _added(x, pending), None
    new_state.append(block_state)
  if layout.scanned_units and stop == cfg.n_layers:
    if start > layout.prefix_layers or (latent is not None and first):
      raise ValueError("the layer scan runs every scanned repeat, each reading z: it cannot start part-way")
    x, pending = _added(x, pending), None
    x, v_first, scanned_state = _scanned(cfg, latent, capacity, layout, x, v_first, state, latents, positions, valid,
                                         pipelined)
    new_state.extend(scanned_state)
  return x, pending, tuple(new_state), v_first


def _scanned(cfg: ModelConfig, latent, capacity, layout: ScanLayout, x, v_first, state, latents, positions, valid,
             pipelined: bool = True):
  """Runs the scanned repeats; v_first rides in the carry (made by a separate layer or None without RWKV-7).

  Under a mesh with a pipeline axis of S > 1 stages, a stateless `pipelined` call whose batch divides into
  model.pipeline_micro_batches runs the repeats as S pipeline stages (`_Pipelined`), and returns no state for them
  (None per unit block): training and scoring read none. Decoding passes a state and a prefill is not `pipelined`,
  so both take the plain scan and get every layer's state."""
  start, units, period = layout.prefix_layers, layout.scanned_units, layout.period
  states = None if state is None else tuple(state[start:])
  z = None
  if isinstance(latents, SplitLatents):
    raise ValueError("SplitLatents (latents chosen per position) need model.scan_layers=false")
  if latents is not None:  # [B, n_layers, n, d] -> [units, B, period, n, d]: repeat u's blocks are its layers.
    z = latents[:, start:].reshape(latents.shape[0], units, period, *latents.shape[2:]).swapaxes(0, 1)
  n_stages = pipeline.stages() if pipelined else 1
  if n_stages > 1 and state is None and x.shape[0] % cfg.pipeline_micro_batches:
    warnings.warn(f"model: a batch of {x.shape[0]} rows does not divide into model.pipeline_micro_batches="
                  f"{cfg.pipeline_micro_batches}, so the {n_stages} pipeline stages run as one plain scan (every "
                  f"stage's weights gathered to every device)", stacklevel=2)
  elif n_stages > 1 and state is None:
    x = _Pipelined(cfg, start, latent, capacity, name=SCANNED)(x, v_first, z, positions, valid, n_stages)
    return x, v_first, (None,) * period
  scan = nn.scan(_Unit, variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(0, 0, nn.broadcast, nn.broadcast), length=units, metadata_params={nn.PARTITION_NAME: LAYER_AXIS})
  (x, v_first), new_states = scan(cfg, start, latent, capacity, name=SCANNED)((x, v_first), states, z, positions, valid)
  return x, v_first, new_states


class _Pipelined(nn.Module):
  """The scanned repeats as pipeline stages (ltm_jax.layers.pipeline): it reads the weights nn.scan(_Unit) made
  under the same name, so both run the same parameters. Stage k runs repeats k*L .. k*L+L-1 (L = units / stages)
  under lax.scan on one pipeline micro-batch at a time. Never initialises: parameters come from the plain layout."""
  cfg: ModelConfig
  first_layer: int
  latent: LatentConfig | None = None
  capacity: int | None = None

  @nn.compact
  def __call__(self, x, v_first, z, positions, valid, n_stages: int):
    if self.is_initializing():
      raise ValueError("a pipelined layer stack cannot initialise parameters: initialise without a pipeline mesh")
    unit = _Unit(self.cfg, self.first_layer, self.latent, self.capacity, parent=None)

    def stage(weights, x, rows, z):
      """weights [L, ...], x [b, T, d_model], rows: (positions, valid, v_first) [b, ...], z [L, b, ...] or None."""
      positions, valid, v_first = rows

      def repeat(x, per_unit):
        unit_weights, z_u = per_unit
        (x, _), _ = unit.apply({"params": unit_weights}, (x, v_first), None, z_u, positions, valid)
        return x, None

      return lax.scan(repeat, x, (weights, z))[0]

    return pipeline.run(stage, self.variables["params"], x, (positions, valid, v_first), z, n_stages,
                        self.cfg.pipeline_micro_batches)


def uses_latents(latent: LatentConfig | None) -> LatentConfig | None:
  """`latent` when it turns latent cross-attention on, else None."""
  return latent if latent is not None and latent.enabled else None


def latent_layers(cfg: ModelConfig, latent: LatentConfig) -> int:
  """How many blocks read z: the top latent.top_layers, or every block."""
  return cfg.n_layers if latent.top_layers is None else latent.top_layers


def first_latent_layer(cfg: ModelConfig, latent: LatentConfig | None) -> int:
  """The index of the lowest block that reads z (n_layers for a model without latents): the trunk's height."""
  latent = uses_latents(latent)
  return cfg.n_layers if latent is None else cfg.n_layers - latent_layers(cfg, latent)


def latent_shape(cfg: ModelConfig, latent: LatentConfig, batch: int) -> tuple[int, int, int, int]:
  """The shape of z for a batch: [B, latent layers, n_per_layer, d_model] (`latent_layers`)."""
  return (batch, latent_layers(cfg, latent), latent.n_per_layer, cfg.d_model)


def _layer_state(cfg: ModelConfig, mixer_kind: str, batch: int, capacity: int | None) -> BlockState:
  slots = cache_capacity(cfg, capacity)
  return BlockState(sublayers.MIXER_KINDS[mixer_kind].empty_state(cfg, batch, slots),
                    sublayers.FFN_KINDS[cfg.ffn_kind(mixer_kind)].empty_state(cfg, batch, slots))


def init_state(cfg: ModelConfig, batch: int, capacity: int | None = None) -> tuple[BlockState, ...]:
  """The state before any token: empty caches and recurrent states for every layer, in the layout `LM` reads (with
  scan_layers, the scanned layers' states stacked per unit block; `unscan_state` gives one per layer). Full-attention
  caches hold `capacity` positions (None: model.max_seq_len); sliding-window caches hold the window."""
  return _scan_tree(cfg, tuple(_layer_state(cfg, kind, batch, capacity) for kind in cfg.mixers))


# --------------------------------------------------------------------------------------------- layout conversions


def _stack(trees):
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _index(tree, i: int):
  return jax.tree.map(lambda leaf: leaf[i], tree)


def _scan_tree(cfg: ModelConfig, per_layer: tuple) -> tuple:
  """Per-layer tuple -> the layout `LM` reads: separate layers, then per unit block the scanned layers stacked."""
  layout = scan_layout(cfg)
  start, period = layout.prefix_layers, layout.period
  stacked = tuple(_stack([per_layer[start + u * period + j] for u in range(layout.scanned_units)])
                  for j in range(period if layout.scanned_units else 0))
  return tuple(per_layer[:start]) + stacked


def unscan_state(cfg: ModelConfig, state: tuple) -> tuple[BlockState, ...]:
  """A state in `LM`'s layout -> one BlockState per layer (the identity without scan_layers)."""
  layout = scan_layout(cfg)
  start, period = layout.prefix_layers, layout.period
  per_layer = list(state[:start])
  for u in range(layout.scanned_units):
    per_layer += [_index(state[start + j], u) for j in range(period)]
  return tuple(per_layer)


def scan_params(cfg: ModelConfig, params: dict) -> dict:
  """Parameters (or gradients) in the per-layer layout (`block_{i}`) -> the layout of `LM(cfg)`: with scan_layers the
  scanned layers' blocks stacked under `blocks/block_{j}`, each leaf with a leading [scanned_units] axis."""
  layout = scan_layout(cfg)
  if not layout.scanned_units:
    return dict(params)
  start, period = layout.prefix_layers, layout.period
  out = {k: v for k, v in params.items() if not (k.startswith("block_") and int(k[6:]) >= start)}
  out[SCANNED] = {f"block_{j}": _stack([params[f"block_{start + u * period + j}"]
                                        for u in range(layout.scanned_units)]) for j in range(period)}
  return out


def unscan_params(cfg: ModelConfig, params: dict) -> dict:
  """The inverse of `scan_params`: one `block_{i}` per layer."""
  layout = scan_layout(cfg)
  if not layout.scanned_units:
    return dict(params)
  start, period = layout.prefix_layers, layout.period
  out = {k: v for k, v in params.items() if k != SCANNED}
  for u in range(layout.scanned_units):
    for j in range(period):
      out[f"block_{start + u * period + j}"] = _index(params[SCANNED][f"block_{j}"], u)
  return out


def is_stacked(path) -> bool:
  """Whether a parameter (a jax tree path) belongs to the scanned stack, so its leading axis is the layer axis: a
  per-layer vector then has ndim 2 (weight-decay masks and FLOP counts should look at ndim - 1)."""
  return any(getattr(entry, "key", None) == SCANNED for entry in path)


# ------------------------------------------------------------------------------------------------------- parameters


def _init_variables(cfg: ModelConfig, latent: LatentConfig | None, key: jax.Array, seq_len: int = 8):
  latent = uses_latents(latent)
  latents = None if latent is None else jnp.zeros(latent_shape(cfg, latent, 1), jnp.float32)
  return LM(cfg, latent).init(key, jnp.zeros((1, seq_len), jnp.int32), latents=latents)


def init_params(cfg: ModelConfig, key: jax.Array, latent: LatentConfig | None = None):
  """Float32 parameters (unboxed) of `LM(cfg, latent)`; logical axis names stay available via `param_axes`. With
  latent.encoder they also hold the amortised posterior encoder's, under ENCODER (see `latent_encoder`).

  The decoder's parameters do not depend on `latent`: the same key gives the same decoder with or without latents,
  which only add each block's cross-attention (so comparisons start from identical decoders). Nor do they depend on
  `scan_layers` beyond their layout: a scanned model starts from the per-layer initialisation stacked, so every layer
  keeps its depth-dependent RWKV initialisation, and the same key gives the same model either way."""
  return _init_params(cfg, latent, key)


# One compiled program: flax's init run eagerly compiles each of its operations on its own (over a hundred small
# programs for a 2-layer model, seconds on a CPU, and none big enough for the persistent compilation cache).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_params(cfg: ModelConfig, latent: LatentConfig | None, key: jax.Array):
  if cfg.scan_layers:
    return scan_params(cfg, _init_params(dataclasses.replace(cfg, scan_layers=False), latent, key))
  params = nn.meta.unbox(_init_variables(cfg, latent, key)["params"])
  encoder = latent_encoder(cfg, latent)
  if encoder is not None:
    params[ENCODER] = nn.meta.unbox(_init_encoder(encoder, jax.random.fold_in(key, _ENCODER_SEED))["params"])
  return params


def param_axes(cfg: ModelConfig, latent: LatentConfig | None = None):
  """The logical axis names of every parameter, as a pytree of PartitionSpec-like tuples (no computation); stacked
  parameters of scanned layers lead with LAYER_AXIS."""
  variables = jax.eval_shape(lambda: _init_variables(cfg, latent, jax.random.key(0)))
  axes = nn.get_partition_spec(variables["params"])
  encoder = latent_encoder(cfg, latent)
  if encoder is not None:
    axes = dict(axes, **{ENCODER: nn.get_partition_spec(
        jax.eval_shape(lambda: _init_encoder(encoder, jax.random.key(0)))["params"])})
  return axes


ENCODER = "latent_encoder"  # The encoder's parameters sit beside the decoder's under this key.
_ENCODER_SEED = 0x1A7E  # Folded into the init key: the decoder's own initialisation is left as it was.


def latent_encoder(cfg: ModelConfig, latent: LatentConfig | None) -> LatentEncoder | None:
  """The amortised posterior encoder of a model with latent.encoder (None otherwise): it proposes q(z|x) for every
  latent vector, [B, latent layers * n_per_layer, d_model] (see `ltm_jax.latent.propose`)."""
  latent = uses_latents(latent)
  if latent is None or not latent.encoder:
    return None
  return LatentEncoder(cfg.padded_vocab_size, latent_layers(cfg, latent) * latent.n_per_layer, cfg.d_model,
                       latent.encoder_width, latent.encoder_context, latent.init_logvar, latent.encoder_logvar,
                       cfg.init_std)


def _init_encoder(encoder: LatentEncoder, key: jax.Array, seq_len: int = 8):
  return encoder.init(key, jnp.zeros((1, seq_len), jnp.int32), jnp.ones((1, seq_len), bool))


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
