"""The mesh's axes and the checks that a config's mesh section fits its model: sizes, rule syntax, a pipeline that
splits the layer stack and the batch, and mesh axes that divide the dimensions they shard. Config validation runs
these, so this module imports nothing of the config, the model or the rest of this package: the checks read a config
through the protocols below, which name the fields and properties they use (`ltm_jax.config.Config` has them all)."""

from __future__ import annotations

import math
from typing import Protocol

from ltm_jax.errors import ConfigError
from ltm_jax.layers.pattern import ATTENTION_LETTERS


class MeshSection(Protocol):
  """What the checks read of a config's mesh section: its sizes, its logical-axis rules (each rule's mesh axes are
  also read as the attribute of the rule's name) and the stacked-layer axis. Members are read-only, as the frozen
  config's fields are."""

  @property
  def layers(self) -> str | None: ...

  def sizes(self) -> dict[str, int]: ...

  def rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]: ...


class ModelSection(Protocol):
  """What the checks read of a config's model section: the dimensions a mesh axis may split."""

  @property
  def layer_pattern(self) -> str: ...

  @property
  def n_layers(self) -> int: ...

  @property
  def d_model(self) -> int: ...

  @property
  def n_heads(self) -> int: ...

  @property
  def kv_heads(self) -> int: ...

  @property
  def rwkv7_head_size(self) -> int: ...

  @property
  def padded_vocab_size(self) -> int: ...

  @property
  def mixers(self) -> tuple[str, ...]: ...

  @property
  def scan_layers(self) -> bool: ...

  @property
  def scanned_units(self) -> int: ...

  @property
  def pipeline_micro_batches(self) -> int: ...

  def ffn_kind(self, mixer: str) -> str: ...

  def ffn_dim(self, kind: str) -> int: ...


class TrainSection(Protocol):

  @property
  def batch_size(self) -> int: ...

  @property
  def grad_accum(self) -> int: ...

  @property
  def seq_len(self) -> int: ...


class LatentSection(Protocol):

  @property
  def enabled(self) -> bool: ...


class MeshedConfig(Protocol):
  """The sections of a config that the mesh checks read."""

  @property
  def mesh(self) -> MeshSection: ...

  @property
  def model(self) -> ModelSection: ...

  @property
  def train(self) -> TrainSection: ...

  @property
  def latent(self) -> LatentSection: ...


# The pipeline axis leads: jax.make_mesh keeps the last axes within a host, and stages exchange only activations.
MESH_AXES = ("pipeline", "data", "fsdp", "tensor")


def mesh_axes_of(rule: str | None) -> tuple[str, ...]:
  """"data,fsdp" -> ("data", "fsdp"); none or "" -> ()."""
  return () if rule is None else tuple(a.strip() for a in rule.split(",") if a.strip())


def validate_mesh(config: MeshedConfig) -> None:
  """The mesh section on its own: sizes, rule syntax, and the divisibility checks whose sizes are already known."""
  mesh = config.mesh
  sizes = mesh.sizes()
  for axis, size in sizes.items():
    if size != -1 and size < 1:
      raise ConfigError(f"mesh.{axis} must be >= 1 or -1 (fill the remaining devices), got {size}")
  if sum(size == -1 for size in sizes.values()) > 1:
    raise ConfigError(f"at most one mesh size may be -1, got {', '.join(f'mesh.{a}={s}' for a, s in sizes.items())}")
  for name, _ in mesh.rules():
    axes = mesh_axes_of(getattr(mesh, name))
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
      raise ConfigError(f"mesh.{name}={getattr(mesh, name)!r} names unknown mesh axis {unknown[0]!r}; "
                        f"valid: {', '.join(MESH_AXES)} or none")
    if len(set(axes)) != len(axes):
      raise ConfigError(f"mesh.{name}={getattr(mesh, name)!r} names a mesh axis twice")
  check_mesh_fits(config, sizes)


def model_dims(config: MeshedConfig, stages: int = 1) -> dict[str, list[tuple[str, int]]]:
  """Logical axis -> [(what, size), ...]: the model and batch dimensions each logical axis shards, for the checks;
  with `stages` > 1 the batch a stage runs is a pipeline micro-batch."""
  m, t = config.model, config.train
  batch = (f"train.batch_size/train.grad_accum={t.batch_size // t.grad_accum} (the micro-batch)",
           t.batch_size // t.grad_accum)
  if stages > 1:
    rows = t.batch_size // t.grad_accum // m.pipeline_micro_batches
    batch = (f"train.batch_size/train.grad_accum/model.pipeline_micro_batches={rows} (the pipeline micro-batch)",
             rows)
  dims: dict[str, list[tuple[str, int]]] = {
      "batch": [batch],
      "length": [(f"train.seq_len={t.seq_len}", t.seq_len)],
      "embed": [(f"model.d_model={m.d_model}", m.d_model)],
      "vocab": [(f"the padded vocabulary {m.padded_vocab_size}", m.padded_vocab_size)],
      "heads": [], "kv_heads": [], "mlp": [], "wkv": []}
  if set(ATTENTION_LETTERS + "D") & set(m.layer_pattern) or config.latent.enabled:
    dims["heads"].append((f"model.n_heads={m.n_heads}", m.n_heads))
  if set(ATTENTION_LETTERS) & set(m.layer_pattern):
    dims["kv_heads"].append((f"the key/value heads {m.kv_heads}", m.kv_heads))
  if "R" in m.layer_pattern:
    dims["wkv"].append((f"model.d_model={m.d_model} (RWKV-4 channels)", m.d_model))
  if "W" in m.layer_pattern and m.rwkv7_head_size > 0 and m.d_model % m.rwkv7_head_size == 0:
    heads = m.d_model // m.rwkv7_head_size
    dims["wkv"].append((f"the RWKV-7 heads d_model/rwkv7_head_size={heads}", heads))
  for kind in sorted({m.ffn_kind(mixer) for mixer in m.mixers}):
    dims["mlp"].append((f"the {kind} FFN width {m.ffn_dim(kind)}", m.ffn_dim(kind)))
  return dims


def check_mesh_fits(config: MeshedConfig, sizes: dict[str, int]) -> None:
  """Raises ConfigError when a mesh axis size does not divide the dimension it shards (heads, FFN width, channels,
  vocabulary, d_model, micro-batch). Sizes of -1 (not yet resolved against the device count) are skipped."""
  mesh = config.mesh
  stages = sizes.get("pipeline", 1)
  if stages > 1:
    check_pipeline(config, stages)
  for name, what in model_dims(config, stages).items():
    axes = mesh_axes_of(getattr(mesh, name))
    if not axes or any(sizes[a] == -1 for a in axes):
      continue
    shards = math.prod(sizes[a] for a in axes)
    for label, size in what:
      if size % shards:
        mesh_desc = "*".join(f"{a}={sizes[a]}" for a in axes)
        raise ConfigError(f"{label} is not divisible by the mesh size {mesh_desc} it is split over "
                          f"(mesh.{name}={getattr(mesh, name)})")


def check_pipeline(config: MeshedConfig, stages: int) -> None:
  """Raises ConfigError when `stages` pipeline stages cannot split the scanned layer stack evenly, or the
  pipeline micro-batches cannot split the batch a forward pass sees (train.batch_size / train.grad_accum)."""
  m, t = config.model, config.train
  if not m.scan_layers:
    raise ConfigError(f"mesh.pipeline={stages} splits the scanned layer stack into stages: set model.scan_layers=true")
  if m.scanned_units % stages:
    raise ConfigError(f"model.n_layers={m.n_layers} (layer_pattern={m.layer_pattern!r}) scans {m.scanned_units} "
                      f"units, which mesh.pipeline={stages} stages do not divide")
  if config.mesh.layers != "pipeline":
    raise ConfigError(f"mesh.pipeline={stages} needs mesh.layers=pipeline (each stage holds its own layers' "
                      f"weights), got mesh.layers={config.mesh.layers}")
  micro = t.batch_size // t.grad_accum
  if micro % m.pipeline_micro_batches:
    raise ConfigError(f"train.batch_size/train.grad_accum={micro} is not divisible by "
                      f"model.pipeline_micro_batches={m.pipeline_micro_batches}")
