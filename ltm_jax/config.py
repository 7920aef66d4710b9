"""Typed configuration: dataclasses, Python config files and `key=value` overrides.

A config file under `configs/` defines `get_config() -> Config`. Overrides such as `model.d_model=256` are parsed
against the field's annotated type (never evaluated), and every loaded config is validated before use.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import pathlib
import types
import typing
from typing import Any

from ltm_jax.errors import ConfigError, first_line
from ltm_jax.layers import pattern as layer_pattern
from ltm_jax.layers.pattern import ATTENTION_LETTERS
from ltm_jax.ops.attention import IMPLS as ATTENTION_BACKENDS
from ltm_jax.ops.ffn import AVAILABLE as FFN_BACKENDS
from ltm_jax.ops.mdi import AVAILABLE as MDI_BACKENDS
from ltm_jax.ops.neural_memory import AVAILABLE as MEMORY_BACKENDS
from ltm_jax.ops.norm_mix import AVAILABLE as NORM_MIX_BACKENDS
from ltm_jax.ops.wkv4 import AVAILABLE as WKV4_BACKENDS
from ltm_jax.ops.wkv7 import AVAILABLE as WKV7_BACKENDS
from ltm_jax.parallel.mesh_checks import MESH_AXES, mesh_axes_of, validate_mesh

MIXERS = {"A": "attention", "R": "rwkv4", "W": "rwkv7", "M": "titans_mal", "G": "titans_mag", "D": "mmrec"}
# Backend choices are the ops' own tables, so a backend an op offers is never refused here.
MEMORY_IMPLS = ("auto",) + MEMORY_BACKENDS
MMREC_IMPLS = ("auto",) + MDI_BACKENDS
MMREC_REMAT = ("none", "recurrence", "memory", "recurrence_memory")  # Parts of a D layer recomputed for backward.
FFNS = ("auto", "swiglu", "channel_mix", "channel_mix7")
DECODER_OBJECTIVES = ("final", "iterates")
NORMS = ("rmsnorm", "layernorm")
DTYPES = ("float32", "bfloat16", "float16")  # float16 compute needs dynamic loss scaling (ltm_jax/loss_scale.py).
# What a block keeps for the backward pass (ltm_jax/model.py `remat_plan`): none = everything; full = only its input;
# minimal = matmul outputs; save_<sub-layers> = those sub-layers' residuals, the other sub-layers recomputed.
REMAT_POLICIES = ("none", "full", "minimal", "save_mixer", "save_ffn", "save_cross_attention", "save_mixer_ffn")
WKV_IMPLS = ("auto",) + WKV4_BACKENDS
ATTENTION_IMPLS = ("auto",) + ATTENTION_BACKENDS
WKV7_IMPLS = ("auto",) + WKV7_BACKENDS
FFN_IMPLS = ("auto",) + FFN_BACKENDS
NORM_MIX_IMPLS = ("auto",) + NORM_MIX_BACKENDS
TOKENIZERS = ("byte", "rwkv_world")
VOCAB_MULTIPLE = 128
MARKOV_MAX_SYMBOLS = 62  # data.source=markov writes its symbols as the printable bytes 'A'..'~'.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The decoder. `layer_pattern` letters: A = causal attention, R = RWKV-4 time-mix, W = RWKV-7 (x070) time-mix,
  M = Titans memory as a layer (neural memory, then attention), G = Titans memory as a gate (attention and neural
  memory mixed by a learned gate), D = MM-Rec (the MDI recurrence and its memory bank of segment summaries); tiled
  over `n_layers`."""
  vocab_size: int = 259
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int | None = None  # None: n_heads (multi-head); fewer: grouped-query attention.
  mlp_dim: int | None = None  # None: 4*d_model for channel_mix, 8/3*d_model rounded up to 64 for swiglu.
  layer_pattern: str = "A"
  ffn: str = "auto"  # auto: channel_mix after R, channel_mix7 (RWKV-7's, no receptance gate) after W, swiglu after A.
  window: int | None = None  # Sliding attention window W: query i sees keys i-W < j <= i.
  rope_theta: float = 10_000.0
  max_seq_len: int = 2048  # Key/value cache capacity of full-attention layers.
  tie_embeddings: bool = False
  norm: str = "rmsnorm"
  norm_eps: float = 1e-5
  dtype: str = "float32"  # Compute dtype; parameters stay float32.
  # The residual stream between blocks: "float32" (sub-layer outputs added in float32, as PyTorch autocast does) or,
  # with dtype bfloat16, "bfloat16" (half the stream's bytes; more rounding in the sum).
  residual_dtype: str = "float32"
  # Float32 matmuls inside the model: "highest" is IEEE float32 everywhere (what the Pallas kernels and the CPU
  # compute, so every backend agrees to float32 rounding); "default" lets XLA use TF32 tensor cores on GPU (faster,
  # ~1e-3 relative). No effect on bfloat16/float16 operands.
  matmul_precision: str = "highest"
  # The blocks' projections (q/k/v/out, FFNs, RWKV and Titans projections; not the LM head, the LoRAs or attention's
  # own products) multiply in FP8: e4m3 operands, e5m2 gradients, current per-tensor scaling (ltm_jax.ops.fp8).
  # Emulated off Hopper; use with dtype bfloat16 for FP8 training on H100 tensor cores.
  fp8: bool = False
  init_std: float = 0.02
  wkv_impl: str = "auto"
  attention_impl: str = "auto"
  wkv7_impl: str = "auto"  # Backend of the RWKV-7 (W) layers' WKV-7 op.
  ffn_impl: str = "auto"  # Backend of the SwiGLU and RWKV-7 channel-mix blocks (ltm_jax.ops.ffn).
  norm_mix_impl: str = "auto"  # Backend of the RWKV-7 sub-layers' norm + token-shift mixes (ltm_jax.ops.norm_mix).
  ln0: bool = False  # Normalise the embeddings (model.norm kind) before the first block, as official RWKV models do.
  rwkv7_head_size: int = 64  # RWKV-7 heads of N channels, each with an N x N state; d_model must divide by it.
  # RWKV-7 low-rank widths (decay w, in-context learning rate a, value residual, output gate); None: the official
  # suggestion max(32, round(f * sqrt(d_model) / 32) * 32), f = 2.5, 2.5, 1.7, 5.
  rwkv7_decay_lora: int | None = None
  rwkv7_iclr_lora: int | None = None
  rwkv7_value_lora: int | None = None
  rwkv7_gate_lora: int | None = None
  # Titans neural memory (M, G layers): an MLP of memory_depth layers (hidden width memory_expansion * head_dim) per
  # head, trained at test time with gradients taken at the start of each chunk of memory_chunk tokens (1: exact
  # online gradient descent), learning rate up to (1 - eta) memory_max_lr / memory_chunk per token, eta the
  # momentum (so a chunk's summed step, momentum included, stays within memory_max_lr); memory_impl picks the op's
  # backend.
  # Depth 1 (a linear memory) is the default: with unit keys the bounded rate keeps it contracting. A depth-2 memory
  # in configs/tiny_titans.py trained to non-finite losses twice (steps 436 and 328 of 450) on the embedded corpus.
  memory_depth: int = 1
  memory_expansion: int = 2
  memory_chunk: int = 16
  memory_max_lr: float = 0.5
  memory_impl: str = "auto"
  # MM-Rec (D layers): the MDI recurrence, then attention to a bank of the last mmrec_slots segment summaries (the
  # mean h of each mmrec_segment real tokens); mmrec_precompute makes every projection for the whole sequence before
  # the recurrence (False: inside it, token by token; the same function); mmrec_remat recomputes the recurrence
  # and/or the memory attention in the backward pass; mmrec_impl picks the MDI op's backend.
  mmrec_slots: int = 16
  mmrec_segment: int = 16
  mmrec_precompute: bool = True
  mmrec_remat: str = "none"
  mmrec_impl: str = "auto"
  remat: str = "none"  # One of REMAT_POLICIES: what each block saves for the backward pass (a runtime choice).
  # Stack the blocks of each repeat of layer_pattern's smallest repeating unit under nn.scan (compile time flat in
  # depth); parameters then carry a leading "layers" axis, so this changes the checkpoint layout.
  scan_layers: bool = False
  # Under a mesh with mesh.pipeline = S > 1 stages, every forward pass of the scanned stack splits its batch into
  # this many micro-batches and runs them through the S stages on a GPipe schedule (ltm_jax/layers/pipeline.py);
  # the idle fraction of the schedule is (S - 1) / (micro-batches + S - 1). Unused without a pipeline axis.
  pipeline_micro_batches: int = 1
  # Sequence positions whose [B, loss_chunk, vocab] float32 logits the loss holds at once (ops/cross_entropy.py;
  # the backward recomputes each chunk's logits); 0: all positions at once. A runtime choice: the NLL is the same.
  loss_chunk: int = 256

  @property
  def scanned_units(self) -> int:
    """How many repeats of the pattern's smallest unit run under the layer scan (model.py `scan_layout`): all of
    them, less the unit holding the first RWKV-7 layer, which stays separate; 0 without scan_layers."""
    if not self.scan_layers:
      return 0
    return layer_pattern.scanned_units(self.layer_pattern, self.n_layers)

  @property
  def kv_heads(self) -> int:
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def padded_vocab_size(self) -> int:
    return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

  @property
  def receptive_field(self) -> int | None:
    """How many tokens a logit can depend on (its own included): n_layers * (window - 1) + 1 for a decoder of
    sliding-window attention only (each layer reaches window - 1 further back); None, unbounded, with full
    attention or RWKV layers (whose state carries the whole past)."""
    if self.window is None or set(self.layer_pattern) != {"A"}:
      return None
    return self.n_layers * (self.window - 1) + 1

  @property
  def mixers(self) -> tuple[str, ...]:
    """The mixer name of every layer, e.g. ('rwkv4', 'rwkv4', 'attention')."""
    return tuple(MIXERS[self.layer_pattern[i % len(self.layer_pattern)]] for i in range(self.n_layers))

  def ffn_kind(self, mixer: str) -> str:
    if self.ffn != "auto":
      return self.ffn
    return {"rwkv4": "channel_mix", "rwkv7": "channel_mix7"}.get(mixer, "swiglu")

  def ffn_dim(self, kind: str) -> int:
    if self.mlp_dim is not None:
      return self.mlp_dim
    if kind in ("channel_mix", "channel_mix7"):
      return 4 * self.d_model
    return -(-(8 * self.d_model) // (3 * 64)) * 64

  def rwkv7_lora_dims(self) -> dict[str, int]:
    """The RWKV-7 low-rank widths {decay, iclr, value, gate}: the rwkv7_*_lora fields, or the official suggestion."""
    suggest = lambda f: max(32, int(round(f * math.sqrt(self.d_model) / 32) * 32))
    given = (self.rwkv7_decay_lora, self.rwkv7_iclr_lora, self.rwkv7_value_lora, self.rwkv7_gate_lora)
    return {name: suggest(f) if dim is None else dim
            for (name, f), dim in zip((("decay", 2.5), ("iclr", 2.5), ("value", 1.7), ("gate", 5.0)), given)}


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`source`: "embedded" (Python's own documentation), a text file, a folder of .txt/.md files, a .bin file of
  uint16/uint32 token ids (dtype from `bin_dtype`), or "markov": synthetic documents, one per sequence of
  train.seq_len + 1 symbols, each from its own Markov chain over `markov_symbols` states whose transition rows are
  drawn from a symmetric Dirichlet(`markov_concentration`) (ltm_jax/data/markov.py: the optimal losses are known)."""
  source: str = "embedded"
  tokenizer: str = "byte"
  bin_dtype: str = "uint16"
  val_fraction: float = 0.05  # For user text/.bin sources; the embedded corpus has a fixed split.
  worker_threads: int = 2  # Background threads that assemble batches.
  prefetch: int = 4  # Batches prepared ahead of the training step.
  markov_symbols: int = 16
  markov_concentration: float = 0.1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  batch_size: int = 32
  seq_len: int = 256
  grad_accum: int = 1  # Micro-batches per step; batch_size must divide by it.
  lr: float = 3e-3
  min_lr_ratio: float = 0.1  # Cosine decay ends at lr * min_lr_ratio.
  warmup_steps: int = 100
  weight_decay: float = 0.1
  decay_embeddings: bool = False
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float = 1.0  # Global-norm clipping; 0 disables.
  # The loss-spike guard (ltm_jax/train/divergence.py): the run stops, as on a non-finite loss, once the loss has
  # stayed above max(spike_factor x best, best + spike_margin) for spike_steps steps in a row (0: never), best being
  # the lowest moving average of the loss so far.
  spike_factor: float = 2.0
  spike_margin: float = 1.0
  spike_steps: int = 10
  eval_every: int = 200
  eval_batches: int = 16
  # Titans models: every evaluation also logs the memory layers' statistics (surprise, gates, weight and momentum
  # norms; ltm_jax.diagnostics), averaged over the first validation batch.
  memory_stats: bool = False
  # Quantisation-aware training: "int8" or "int4" trains (and evaluates) through the weights `ltm generate --quantize`
  # would store (ltm_jax.quantize.fake_quantize_params: rounded forward, straight-through backward);
  # qat_group is int4's inputs per scale. The checkpoint keeps the float weights.
  qat: str = "none"
  qat_group: int = 128
  checkpoint_every: int = 500
  keep_checkpoints: int = 3  # The newest checkpoints kept; older ones are deleted as new ones are saved...
  # ...except those at multiples of keep_every (0: none), which stay: older steps `ltm train --from-step N` can go
  # back to after a divergence that outlasts the newest keep_checkpoints. A multiple of checkpoint_every.
  keep_every: int = 0
  async_checkpoint: bool = True
  log_every: int = 10
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class LatentConfig:
  """Latent thought vectors z [B, top_layers, n_per_layer, d_model] read by a cross-attention sub-layer in the top
  blocks, inferred per sequence by `inner_steps` of Adam on the posterior N(mu, exp(logvar)) (Kong et al., 2025).

  The defaults are the cheapest form that measured as well per token (docs/latent-thoughts.md): z read by the top
  block alone, an encoder's proposal refined by 2 inner steps, every row trained on continuation; a train step then
  costs about 1.5x a plain one's FLOPs (`ltm info` prints it). The published form is top_layers=None, encoder=False,
  inner_steps=16, inner_lr=0.3, continuation_fraction=0, at about 7x."""
  enabled: bool = False  # false: the plain decoder (no cross-attention), the baseline of every comparison.
  n_per_layer: int = 8
  # z is read by the top `top_layers` blocks only (None: every block), so z is [B, top_layers, n_per_layer, d_model].
  # The blocks below do not depend on z: a train step runs them once, and the inner loop's forward and backward
  # passes run through the top blocks alone, from the lower blocks' output.
  top_layers: int | None = 1
  rope: bool = False  # RoPE on the cross-attention, z_l's vectors placed evenly over the first rope_span positions.
  rope_span: int = 256
  inner_steps: int = 2
  inner_lr: float = 0.1
  inner_min_lr_ratio: float = 0.1  # The inner learning rate is cosine-decayed to inner_lr * this within the loop.
  inner_b1: float = 0.9
  inner_b2: float = 0.999
  init_mu_std: float = 0.01
  init_logvar: float = -5.0
  # What the decoder's gradient is taken on. final: the NLL given z drawn (fresh noise) from the fitted posterior.
  # iterates: the mean NLL over the inner loop's inner_steps + 1 iterates q_0..q_K, each at z_k = mu_k + sigma_k * eps
  # with the loop's noise, held constant (the released LTM code's effective objective: its inner backward passes
  # also fill the decoder's gradients).
  decoder_objective: str = "final"
  # The fraction of each training batch trained on continuation: z fitted on a prefix of the sequence (a random
  # split in [T/4, 3T/4)), the decoder scored on the rest, so z is read as a memory of text it has not seen. The
  # other sequences are trained as usual (z fitted on, and the decoder scored on, the whole sequence).
  continuation_fraction: float = 1.0
  # Semi-amortised inference: a small encoder (ltm_jax/layers/latent_encoder.py: local n-gram features of the tokens
  # z is fitted on, pooled by one learned query per latent vector) proposes the inner loop's starting mu, so fewer
  # inner steps reach a good posterior. It is trained on the ELBO at its own proposal, whose gradient is the one the
  # inner loop's first step computes anyway. Adds parameters: a checkpoint binds it.
  encoder: bool = True
  encoder_width: int = 128  # A multiple of 32 (its attention pooling has heads of 32 dimensions).
  encoder_context: int = 4  # Tokens each position's n-gram feature reads: itself and the context - 1 before it.
  # Also propose logvar (else the start's logvar is init_logvar). Learned widths tighten the ELBO by orders of
  # magnitude, but early in training, before the decoder reads z, they widen towards the prior and z carries
  # almost nothing the decoder could learn to read (`benchmarks/latent.py markov`, the ltm_learned_logvar row).
  encoder_logvar: bool = False


SAMPLERS = ("dpm++", "ddpm")


@dataclasses.dataclass(frozen=True)
class PriorConfig:
  """The learned prior over latent thoughts (`ltm_jax/prior`), trained as a second stage on the frozen decoder's
  posteriors: a DiT over the latent slots of every layer, epsilon-prediction under the continuous-time linear VP
  schedule log alpha_t = -beta_min t / 2 - (beta_max - beta_min) t^2 / 4, t in [t_min, 1]."""
  width: int = 256
  depth: int = 4
  n_heads: int = 4
  mlp_ratio: int = 4
  beta_min: float = 0.1
  beta_max: float = 20.0
  t_min: float = 1e-3
  steps: int = 3000
  batch_size: int = 128
  lr: float = 5e-4
  warmup_steps: int = 200
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  ema_decay: float = 0.999  # Sampling uses the exponential moving average of the weights.
  checkpoint_every: int = 500
  log_every: int = 50
  seed: int = 0
  sampler: str = "dpm++"  # The default of `latents="dit"`: dpm++ (DPM-Solver++ 2M) or ddpm (ancestral).
  sampler_steps: int = 20


TS_TASKS = ("classification", "regression")
TS_POOLS = ("mean", "last")
TS_BRANCHES = ("spectrum", "none")


@dataclasses.dataclass(frozen=True)
class TimeSeriesConfig:
  """A time-series model instead of the decoder LM (ltm_jax/timeseries): real-valued series [B, T, F] embedded per
  patch of `patch` steps, the block stack of the model section (layer_pattern, d_model, ...) run over the patches,
  pooled over time, fused with a second branch and read by a classification or regression head. With it enabled,
  train.seq_len and the data section's source and tokenizer are unused: series, lengths and classes come from
  `source`."""
  enabled: bool = False
  # aeon:<name>, a dataset the aeon package ships (e.g. aeon:GunPoint; its own train/test split), or a file: .npz
  # (x [N, T] or [N, T, F], y [N], optional mask [N, T]) or .csv/.tsv in the UCR layout (label, then the values).
  source: str = "aeon:GunPoint"
  test_source: str | None = None  # The test split of a file source (None: no test metrics).
  task: str = "classification"
  val_fraction: float = 0.2  # Of the training split held out (stratified by class) for val_* metrics; 0: none.
  normalize: bool = True  # Z-normalise every series (each feature over its valid steps).
  patch: int = 1  # Steps per embedded token.
  pool: str = "mean"  # mean: masked mean of the final hidden states over time; last: the last valid step's.
  # spectrum: log-magnitudes of the series' discrete-time Fourier transform at `spectrum_bins` fixed frequencies
  # (periods geometric from 2 to spectrum_max_period steps), embedded and fused with the pooled time features;
  # none: the time branch alone.
  branch: str = "spectrum"
  spectrum_bins: int = 32
  spectrum_max_period: float = 512.0
  head_hidden: int | None = None  # Width of the fused head's hidden layer (None: model.d_model).


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh (pipeline, data, fsdp, tensor) and the rules that map logical axis names to its axes.

  Sizes: -1 fills the devices the other two leave (at most one -1); their product must be the device count. Rules:
  one field per logical axis, a comma-separated list of mesh axes ("data,fsdp") or none (replicated). Field order is
  rule priority: when two axes of one array claim the same mesh axis, the earlier rule wins and the later axis stays
  replicated (so activations [batch, length, embed] keep fsdp for batch, while parameters shard embed over fsdp).
  Defaults: Megatron-style tensor parallelism (heads, FFN hidden, RWKV channels, vocabulary over `tensor`), FSDP
  over `embed`, the batch over data x fsdp, the scanned layer stack's units over `pipeline` (stages)."""
  pipeline: int = 1  # Stages of the scanned layer stack (model.scan_layers; model.pipeline_micro_batches).
  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  batch: str | None = "data,fsdp"
  length: str | None = None  # Sequence (activations only); none: no sequence parallelism.
  vocab: str | None = "tensor"
  heads: str | None = "tensor"
  kv_heads: str | None = "tensor"
  mlp: str | None = "tensor"
  wkv: str | None = "tensor"  # RWKV-4 channels and RWKV-7 channels (whole heads of rwkv7_head_size).
  embed: str | None = "fsdp"
  embed_out: str | None = None
  head_dim: str | None = None
  norm: str | None = None
  lora: str | None = None
  latent: str | None = None
  memory_in: str | None = None  # The Titans memory MLP's input and output axes (its learned initial weights).
  memory_out: str | None = None
  conv: str | None = None  # The taps of short convolutions.
  layers: str | None = "pipeline"  # The stacked-layer axis of scanned layers: stage s holds its units' weights.
  # A rule whose mesh axes cannot split an op's dimension (their size does not divide it) leaves it whole: a warning
  # once per rule, or with strict an error.
  strict: bool = False

  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in MESH_AXES}

  def rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Flax logical-axis rules ((logical name, mesh axes or None), ...) in priority order."""
    rules = []
    for f in dataclasses.fields(self):
      if f.name in MESH_AXES or f.name == "strict":
        continue
      axes = mesh_axes_of(getattr(self, f.name))
      rules.append((f.name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class Config:
  name: str = "unnamed"
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  latent: LatentConfig = LatentConfig()
  mesh: MeshConfig = MeshConfig()
  prior: PriorConfig = PriorConfig()
  timeseries: TimeSeriesConfig = TimeSeriesConfig()

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "latent": LatentConfig,
            "mesh": MeshConfig, "prior": PriorConfig,
            "timeseries": TimeSeriesConfig}


# ----------------------------------------------------------------------------------------------------------- loading


def load_config(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> Config:
  """Loads `get_config()` from a Python file, applies `key=value` overrides and validates the result."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config file not found: {path}")
  spec = importlib.util.spec_from_file_location(f"ltm_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # A broken config file is the user's input: report it on one line.
    raise ConfigError(f"could not execute config file {path}: {type(e).__name__}: {first_line(e)}") from e
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} does not define get_config()")
  try:
    config = module.get_config()
  except Exception as e:  # As above: the file's own code failed, not ours.
    raise ConfigError(f"get_config() in {path} raised {type(e).__name__}: {first_line(e)}") from e
  if not isinstance(config, Config):
    raise ConfigError(f"get_config() in {path} returned {type(config).__name__}, expected ltm_jax.config.Config")
  return validate(apply_overrides(config, overrides))


def from_dict(d: dict[str, Any]) -> Config:
  """Rebuilds a Config saved with `to_dict` (e.g. a workdir's config.json); unknown keys are errors."""
  d = dict(d)
  sections = {}
  for name, cls in SECTIONS.items():
    values = d.pop(name, {})
    _check_keys(values, cls, prefix=f"{name}.")
    sections[name] = cls(**{k: _coerce(v, _field_types(cls)[k], f"{name}.{k}") for k, v in values.items()})
  _check_keys(d, Config, prefix="", ignore=SECTIONS)
  return validate(Config(**d, **sections))


def apply_overrides(config: Config, overrides: typing.Sequence[str]) -> Config:
  if isinstance(overrides, str):  # Iterating it would take each character for an override.
    raise ConfigError(f"overrides must be a list of key=value strings, got the string {overrides!r}; pass "
                      f"{overrides.split()!r}")
  for item in overrides:
    key, sep, raw = item.partition("=")
    if not sep:
      raise ConfigError(f"override {item!r} is not of the form key=value")
    config = _set(config, key.strip(), raw.strip())
  return config


def all_keys() -> list[str]:
  keys = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
  for name, cls in SECTIONS.items():
    keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
  return keys


def _set(config: Config, key: str, raw: str) -> Config:
  section, _, field = key.rpartition(".")
  target_cls = SECTIONS.get(section) if section else Config
  if target_cls is None or field not in _field_types(target_cls) or (not section and field in SECTIONS):
    raise ConfigError(f"unknown config key {key!r}{_suggest(key, all_keys())}")
  value = _parse(raw, _field_types(target_cls)[field], key)
  if not section:
    return dataclasses.replace(config, **{field: value})
  return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{field: value})})


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _check_keys(values: dict[str, Any], cls, prefix: str, ignore=()) -> None:
  valid = [f.name for f in dataclasses.fields(cls) if f.name not in ignore]
  for k in values:
    if k not in valid:
      raise ConfigError(f"unknown config key {prefix + k!r}{_suggest(prefix + k, all_keys())}")


def _suggest(key: str, candidates: list[str]) -> str:
  close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.5)
  if not close:
    tail = key.rpartition(".")[2]
    close = [c for c in candidates if c.rpartition(".")[2] == tail]
  return f"; did you mean {', '.join(close)}?" if close else ""


def _allowed(tp) -> tuple[type, ...]:
  if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
    return typing.get_args(tp)
  return (tp,)


def _parse(raw: str, tp, key: str):
  """Parses a command-line string as the annotated type: int, float, bool, str, or `X | None` ("none"/"null")."""
  allowed = _allowed(tp)
  if type(None) in allowed and raw.lower() in ("none", "null"):
    return None
  for t in allowed:
    if t is bool:
      if raw.lower() in ("true", "1", "yes"):
        return True
      if raw.lower() in ("false", "0", "no"):
        return False
    elif t is int:
      try:
        return int(raw.replace("_", ""))
      except ValueError:
        pass
    elif t is float:
      try:
        value = float(raw)
      except ValueError:
        continue
      if math.isfinite(value):
        return value
    elif t is str:
      return raw
  names = " or ".join(t.__name__ if t is not type(None) else "none" for t in allowed)
  raise ConfigError(f"config key {key!r} expects {names}, got {raw!r}")


def _coerce(value, tp, key: str):
  """Checks a value from a dict (JSON) against the annotated type; ints are accepted where floats are expected."""
  allowed = _allowed(tp)
  if value is None and type(None) in allowed:
    return None
  for t in allowed:
    if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if t is int and isinstance(value, int) and not isinstance(value, bool):
      return value
    if t in (bool, str) and isinstance(value, t):
      return value
  names = " or ".join(t.__name__ if t is not type(None) else "none" for t in allowed)
  raise ConfigError(f"config key {key!r} expects {names}, got {value!r}")


# -------------------------------------------------------------------------------------------------------- validation


FLOAT32_MAX = 3.4028234663852886e38
MATMUL_PRECISIONS = ("highest", "high", "default")  # jax.default_matmul_precision's names.


def validate(config: Config) -> Config:
  """Checks types and the relations between values; returns the config unchanged or raises ConfigError."""
  for name, cls in SECTIONS.items():
    section = getattr(config, name)
    if not isinstance(section, cls):
      raise ConfigError(f"config section {name!r} must be {cls.__name__}, got {type(section).__name__}")
    for key, tp in _field_types(cls).items():
      value = _coerce(getattr(section, key), tp, f"{name}.{key}")
      # Floats reach the device as float32: a value finite in Python but not there would poison training silently.
      if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
        raise ConfigError(f"{name}.{key}={value!r} is not a finite float32 value (|x| <= {FLOAT32_MAX:.4g})")
  m, d, t = config.model, config.data, config.train

  def need(ok: bool, message: str):
    if not ok:
      raise ConfigError(message)

  for key in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
    need(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
  need(m.d_model % m.n_heads == 0, f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
  need(m.kv_heads > 0 and m.n_heads % m.kv_heads == 0,
       f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}")
  need(not set(ATTENTION_LETTERS) & set(m.layer_pattern) or m.head_dim % 2 == 0,
       f"head dimension d_model/n_heads={m.head_dim} must be even for RoPE")
  need(len(m.layer_pattern) > 0, "model.layer_pattern is empty")
  bad = sorted(set(m.layer_pattern) - set(MIXERS))
  need(not bad, f"model.layer_pattern={m.layer_pattern!r} has unknown letter(s) {''.join(bad)!r}; "
                f"valid: {', '.join(f'{k}={v}' for k, v in MIXERS.items())}")
  need(m.n_layers % len(m.layer_pattern) == 0,
       f"model.n_layers={m.n_layers} is not a multiple of len(model.layer_pattern)={len(m.layer_pattern)}")
  need(m.mlp_dim is None or m.mlp_dim > 0, f"model.mlp_dim must be positive, got {m.mlp_dim}")
  need(m.matmul_precision in MATMUL_PRECISIONS,
       f"model.matmul_precision={m.matmul_precision!r}; choose one of {', '.join(MATMUL_PRECISIONS)}")
  if "W" in m.layer_pattern:
    need(m.rwkv7_head_size > 0 and m.d_model % m.rwkv7_head_size == 0,
         f"model.d_model={m.d_model} is not divisible by model.rwkv7_head_size={m.rwkv7_head_size}")
    for name, dim in m.rwkv7_lora_dims().items():
      need(dim > 0, f"model.rwkv7_{name}_lora must be positive or none, got {dim}")
  need(m.window is None or m.window > 0, f"model.window must be positive or none, got {m.window}")
  need(m.window is None or not set(ATTENTION_LETTERS) & set(m.layer_pattern) or m.window <= config.train.seq_len,
       f"model.window={m.window} is longer than train.seq_len={config.train.seq_len}, so it limits nothing; "
       "use model.window=none for full attention")
  need(m.rope_theta > 0 and m.norm_eps > 0 and m.init_std > 0, "model.rope_theta, norm_eps, init_std must be > 0")
  need(not (m.fp8 and m.dtype == "float16"), "model.fp8 rounds in the compute dtype, where float16 makes the scales "
       "of ordinary magnitudes subnormal or 0 (NaN gradients): use model.dtype=bfloat16 with model.fp8")
  need(m.residual_dtype in ("float32", m.dtype) and m.residual_dtype in ("float32", "bfloat16"),
       f"model.residual_dtype={m.residual_dtype!r} must be float32, or bfloat16 with model.dtype=bfloat16")
  for key, choices in (("ffn", FFNS), ("norm", NORMS), ("dtype", DTYPES), ("remat", REMAT_POLICIES),
                       ("wkv_impl", WKV_IMPLS), ("attention_impl", ATTENTION_IMPLS), ("wkv7_impl", WKV7_IMPLS),
                       ("ffn_impl", FFN_IMPLS), ("norm_mix_impl", NORM_MIX_IMPLS), ("memory_impl", MEMORY_IMPLS),
                       ("mmrec_impl", MMREC_IMPLS), ("mmrec_remat", MMREC_REMAT)):
    need(getattr(m, key) in choices, f"model.{key}={getattr(m, key)!r} is not one of {', '.join(choices)}")
  for key in ("memory_depth", "memory_expansion", "memory_chunk"):
    need(getattr(m, key) >= 1, f"model.{key} must be >= 1, got {getattr(m, key)}")
  need(0 < m.memory_max_lr <= 1, f"model.memory_max_lr must be in (0, 1], got {m.memory_max_lr}")
  if "D" in m.layer_pattern:
    need(m.mmrec_slots >= 1, f"model.mmrec_slots={m.mmrec_slots}: the memory bank needs at least 1 slot; set "
                             "model.mmrec_slots >= 1")
    need(1 <= m.mmrec_segment <= config.train.seq_len,
         f"model.mmrec_segment={m.mmrec_segment} does not fit train.seq_len={config.train.seq_len}: no segment would "
         f"reach the memory bank in training; set 1 <= model.mmrec_segment <= {config.train.seq_len}")
    need(m.d_model % 4 == 0, f"model.d_model={m.d_model} must be divisible by 4 for MM-Rec's decay MLPs (width "
                             "d_model / 4)")

  need(d.tokenizer in TOKENIZERS, f"data.tokenizer={d.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
  need(d.bin_dtype in ("uint16", "uint32"), f"data.bin_dtype={d.bin_dtype!r} is not one of uint16, uint32")
  need(0 < d.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
  need(d.worker_threads >= 0 and d.prefetch >= 0, "data.worker_threads and data.prefetch must be >= 0")
  need(bool(d.source), "data.source is empty")
  need(2 <= d.markov_symbols <= MARKOV_MAX_SYMBOLS,
       f"data.markov_symbols must be in [2, {MARKOV_MAX_SYMBOLS}], got {d.markov_symbols}")
  need(d.markov_concentration > 0, f"data.markov_concentration must be positive, got {d.markov_concentration}")
  need(d.source != "markov" or d.tokenizer == "byte",
       f"data.source=markov writes its symbols as bytes: set data.tokenizer=byte, got {d.tokenizer!r}")
  if d.tokenizer == "byte":
    need(m.vocab_size >= 259, f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's 259 ids")
  if d.tokenizer == "rwkv_world":
    need(m.vocab_size >= 65536, f"model.vocab_size={m.vocab_size} is smaller than the rwkv_world tokenizer's "
                                "65536 ids")

  for key in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_batches", "checkpoint_every",
              "keep_checkpoints", "log_every"):
    need(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
  need(t.keep_every >= 0 and t.keep_every % t.checkpoint_every == 0,
       f"train.keep_every={t.keep_every} must be 0 or a multiple of train.checkpoint_every={t.checkpoint_every}")
  need(t.batch_size % t.grad_accum == 0,
       f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
  need(m.pipeline_micro_batches >= 1, f"model.pipeline_micro_batches must be >= 1, got {m.pipeline_micro_batches}")
  need(m.loss_chunk >= 0, f"model.loss_chunk must be >= 0 (0: no chunking), got {m.loss_chunk}")
  need(t.lr > 0, f"train.lr must be positive, got {t.lr}")
  need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
  need(t.warmup_steps >= 0 and t.weight_decay >= 0 and t.grad_clip >= 0,
       "train.warmup_steps, weight_decay and grad_clip must be >= 0")
  need(0 <= t.b1 < 1 and 0 <= t.b2 < 1 and t.eps > 0, "train.b1 and train.b2 must be in [0, 1), train.eps > 0")
  need(t.spike_factor >= 1 and t.spike_margin >= 0 and t.spike_steps >= 0,
       f"train.spike_factor must be >= 1 (got {t.spike_factor}), train.spike_margin and train.spike_steps >= 0 (got "
       f"{t.spike_margin}, {t.spike_steps})")
  need(t.qat in ("none", "int8", "int4"), f"train.qat={t.qat!r}: choose none, int8 or int4")
  need(t.qat_group >= 2 and t.qat_group % 2 == 0, f"train.qat_group must be even and >= 2, got {t.qat_group}")
  need(t.qat == "none" or not config.timeseries.enabled, "train.qat quantises a language model's weights; set "
       "train.qat=none for a time-series model")
  need(not (config.latent.enabled and config.timeseries.enabled), "latent thought vectors are read by decoder LMs; "
       "a time-series model has none: set latent.enabled=false")
  need(not t.memory_stats or bool(set("MG") & set(m.layer_pattern)),
       f"train.memory_stats needs a Titans memory layer (M or G) in model.layer_pattern={m.layer_pattern!r}")
  has_full_attention = bool(set(ATTENTION_LETTERS) & set(m.layer_pattern)) and m.window is None
  need(not has_full_attention or t.seq_len <= m.max_seq_len,
       f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")

  p = config.prior
  for key in ("width", "depth", "n_heads", "mlp_ratio", "steps", "batch_size", "checkpoint_every", "log_every",
              "sampler_steps"):
    need(getattr(p, key) > 0, f"prior.{key} must be positive, got {getattr(p, key)}")
  need(p.width % p.n_heads == 0, f"prior.width={p.width} is not divisible by prior.n_heads={p.n_heads}")
  need(0 < p.beta_min < p.beta_max, f"prior needs 0 < beta_min < beta_max, got {p.beta_min}, {p.beta_max}")
  need(0 < p.t_min < 1, f"prior.t_min must be in (0, 1), got {p.t_min}")
  need(p.lr > 0 and p.warmup_steps >= 0 and p.weight_decay >= 0 and p.grad_clip >= 0,
       "prior.lr must be > 0; prior.warmup_steps, weight_decay, grad_clip >= 0")
  need(0 <= p.ema_decay < 1, f"prior.ema_decay must be in [0, 1), got {p.ema_decay}")
  need(p.sampler in SAMPLERS, f"prior.sampler={p.sampler!r} is not one of {', '.join(SAMPLERS)}")
  need(0 <= p.seed < 2**32, f"prior.seed must be in [0, 2**32) (grain's shuffle takes no other), got {p.seed}")
  need(0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32) (jax's 32-bit keys repeat larger seeds), got {t.seed}")

  z = config.latent
  need(z.n_per_layer >= 1, f"latent.n_per_layer must be >= 1, got {z.n_per_layer}")
  need(z.top_layers is None or 1 <= z.top_layers <= m.n_layers,
       f"latent.top_layers must be in [1, model.n_layers={m.n_layers}] or None, got {z.top_layers}")
  need(not z.enabled or z.top_layers in (None, m.n_layers) or not m.scan_layers,
       f"latent.top_layers={z.top_layers} leaves blocks without cross-attention, which the layer scan cannot stack "
       "with those that have it: set model.scan_layers=false or latent.top_layers=null")
  need(z.inner_steps >= 0, f"latent.inner_steps must be >= 0, got {z.inner_steps}")
  need(z.inner_lr >= 0, f"latent.inner_lr must be >= 0, got {z.inner_lr}")
  need(0 <= z.inner_min_lr_ratio <= 1, f"latent.inner_min_lr_ratio must be in [0, 1], got {z.inner_min_lr_ratio}")
  need(0 <= z.inner_b1 < 1 and 0 <= z.inner_b2 < 1, "latent.inner_b1 and latent.inner_b2 must be in [0, 1)")
  need(z.init_mu_std >= 0, f"latent.init_mu_std must be >= 0, got {z.init_mu_std}")
  need(not z.rope or m.head_dim % 2 == 0, f"latent.rope needs an even head dimension, got {m.head_dim}")
  need(z.rope_span >= 1, f"latent.rope_span must be >= 1, got {z.rope_span}")
  need(z.decoder_objective in DECODER_OBJECTIVES,
       f"latent.decoder_objective={z.decoder_objective!r} is not one of {', '.join(DECODER_OBJECTIVES)}")
  need(0 <= z.continuation_fraction <= 1,
       f"latent.continuation_fraction must be in [0, 1], got {z.continuation_fraction}")
  need(z.decoder_objective == "final" or z.continuation_fraction == 0,
       "latent.decoder_objective=iterates scores the tokens z is fitted on; it cannot be combined with "
       "latent.continuation_fraction > 0")
  need(z.encoder_width >= 32 and z.encoder_width % 32 == 0,
       f"latent.encoder_width must be a positive multiple of 32, got {z.encoder_width}")
  need(z.encoder_context >= 1, f"latent.encoder_context must be >= 1, got {z.encoder_context}")
  _validate_timeseries(config.timeseries)
  validate_mesh(config)
  return config


def _validate_timeseries(ts: TimeSeriesConfig) -> None:
  def need(ok: bool, message: str):
    if not ok:
      raise ConfigError(message)

  need(bool(ts.source), "timeseries.source is empty")
  for key, choices in (("task", TS_TASKS), ("pool", TS_POOLS), ("branch", TS_BRANCHES)):
    need(getattr(ts, key) in choices, f"timeseries.{key}={getattr(ts, key)!r} is not one of {', '.join(choices)}")
  need(0 <= ts.val_fraction < 1, f"timeseries.val_fraction must be in [0, 1), got {ts.val_fraction}")
  need(ts.patch >= 1 and ts.spectrum_bins >= 1, "timeseries.patch and timeseries.spectrum_bins must be >= 1")
  need(ts.spectrum_max_period > 2, f"timeseries.spectrum_max_period must be > 2 steps, got {ts.spectrum_max_period}")
  need(ts.head_hidden is None or ts.head_hidden > 0, f"timeseries.head_hidden must be positive, got {ts.head_hidden}")
