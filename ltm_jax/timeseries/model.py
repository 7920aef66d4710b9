"""The dual-branch time-series model: series [B, T, F] -> outputs [B, n_outputs] (class logits or regression
values), through

  time branch      patches of `patch` steps -> linear embedding -> the decoder's block stack (any layer pattern of
                   attention, RWKV-4 and RWKV-7, `ltm_jax.model.run_blocks`) -> final norm -> pooled over time
  spectrum branch  log-magnitudes of the discrete-time Fourier transform at fixed frequencies -> small MLP
  head             both concatenated -> dense -> GELU -> dense

Why a spectrum beside the recurrence: an RWKV layer forgets at fixed per-channel rates, so a slow periodicity or the
overall frequency content of a long series is hard for it to carry to the end, while the magnitude spectrum states it
directly and ignores where in the series a pattern sits. The frequencies are fixed (periods geometric from 2 steps
to timeseries.spectrum_max_period) rather than an FFT's k / T grid, so the features do not depend on how long the
padded batch is: with the phase measured from each series' first valid step, left padding changes nothing, and the
transform is a running sum that a state can carry from chunk to chunk.

Every call takes and returns an `EncoderState`, so a series can be fed in chunks (down to one patch at a time) and the
outputs after the last chunk equal one call on the whole series. `mask` [B, T] marks left padding (False), which
changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.config import ModelConfig, TimeSeriesConfig
from ltm_jax.layers.common import norm

SPECTRUM_FLOOR = 1e-4  # Added to magnitudes before the log: silence maps to log(1e-4), not -inf.


class EncoderState(NamedTuple):
  """What a series leaves behind after some steps. blocks: the block stack's state (`ltm_jax.model.init_state`
  layout; None before the first chunk of a whole-series call); pool_sum [B, d_model] and last [B, d_model]: the sum
  over valid patches and the last valid patch of the final hidden states; patches [B] and steps [B]: valid patches
  and valid steps so far; spec_re, spec_im [B, K, F]: the running Fourier sums. All float32."""
  blocks: Any
  pool_sum: jax.Array
  last: jax.Array
  patches: jax.Array
  steps: jax.Array
  spec_re: jax.Array
  spec_im: jax.Array


def init_state(cfg: ModelConfig, ts: TimeSeriesConfig, batch: int, features: int) -> EncoderState:
  """The state before any step, with the block states made (for chunked calls)."""
  zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
  return EncoderState(model_lib.init_state(cfg, batch), zeros(batch, cfg.d_model), zeros(batch, cfg.d_model),
                      zeros(batch), zeros(batch), zeros(batch, ts.spectrum_bins, features),
                      zeros(batch, ts.spectrum_bins, features))


def frequencies(ts: TimeSeriesConfig) -> np.ndarray:
  """[K] cycles per step: periods geometric from spectrum_max_period down to 2 steps (Nyquist)."""
  return 1.0 / np.geomspace(ts.spectrum_max_period, 2.0, ts.spectrum_bins)


def patch(series, mask, size: int):
  """series [B, T, F], mask [B, T] -> (patches [B, ceil(T / size), size * F], valid [B, ceil(T / size)]). Patches
  are counted back from the last step (the front is left-padded to a whole patch), so extra left padding never
  moves a real step into another patch; a patch is valid when any of its steps is."""
  batch, length, features = series.shape
  pad = -length % size
  series = jnp.pad(series, ((0, 0), (pad, 0), (0, 0)))
  mask = jnp.pad(mask, ((0, 0), (pad, 0)))
  count = (length + pad) // size
  return (series.reshape(batch, count, size * features), mask.reshape(batch, count, size).any(axis=-1))


class TimeSeriesModel(nn.Module):
  """(series [B, T, F], mask [B, T] bool or None, state or None) -> (outputs [B, n_outputs] float32, EncoderState).

  The block stack is `cfg`'s (its parameters sit at the top level as in `ltm_jax.model.LM`: `block_{i}`, or
  `blocks` when scanned); `ts` sets the patching, pooling, second branch and head."""
  cfg: ModelConfig
  ts: TimeSeriesConfig
  n_outputs: int

  @nn.compact
  def __call__(self, series, mask=None, state: EncoderState | None = None):
    with jax.default_matmul_precision(self.cfg.matmul_precision):
      return self._forward(series, mask, state)

  def _forward(self, series, mask, state):
    cfg, ts = self.cfg, self.ts
    batch, length, features = series.shape
    if state is not None and length % ts.patch:
      raise ValueError(f"a chunk fed with a state must hold whole patches: {length} steps, patch {ts.patch}")
    if state is None:
      state = init_state(cfg, ts, batch, features)._replace(blocks=None)
    padded = mask is not None
    mask = jnp.ones((batch, length), bool) if mask is None else mask.astype(bool)
    series = jnp.where(mask[..., None], series.astype(jnp.float32), 0.0)

    tokens, valid = patch(series, mask, ts.patch)
    x = nn.Dense(cfg.d_model, dtype=jnp.float32, param_dtype=jnp.float32,
                 kernel_init=nn.initializers.normal(1 / math.sqrt(ts.patch * features)), name="embed")(tokens)
    if cfg.ln0:  # In float32, as the decoder's: it feeds the residual stream.
      x = norm(cfg.norm, cfg.norm_eps, jnp.float32, "embed_norm")(x)
    x, blocks = model_lib.run_blocks(cfg, x, state.blocks, valid=valid if padded else None)
    h = norm(cfg.norm, cfg.norm_eps, cfg.dtype, "final_norm")(x).astype(jnp.float32)

    weight = valid.astype(jnp.float32)
    pool_sum = state.pool_sum + jnp.einsum("btd,bt->bd", h, weight)
    patches = state.patches + weight.sum(axis=1)
    # Padding is on the left only: a row's last patch of the chunk is valid whenever any of its patches is.
    last = jnp.where(valid[:, -1:], h[:, -1], state.last)
    pooled = pool_sum / jnp.maximum(patches, 1.0)[:, None] if ts.pool == "mean" else last

    spec_re, spec_im, steps = _fourier_sums(series, mask, state, frequencies(ts))
    new_state = EncoderState(blocks, pool_sum, last, patches, steps, spec_re, spec_im)
    fused = [pooled]
    if ts.branch == "spectrum":
      fused.append(_SpectrumBranch(cfg.d_model, name="spectrum")(spec_re, spec_im, steps))
    hidden = ts.head_hidden or cfg.d_model
    y = nn.Dense(hidden, dtype=jnp.float32, param_dtype=jnp.float32, name="head_hidden")(
        jnp.concatenate(fused, axis=-1))
    y = nn.Dense(self.n_outputs, dtype=jnp.float32, param_dtype=jnp.float32, name="head")(nn.gelu(y))
    return y, new_state


def _fourier_sums(series, mask, state: EncoderState, freqs: np.ndarray):
  """Running sums sum_t x_t e^{-2 pi i f t} [B, K, F] over valid steps, t counted from each row's first valid step,
  continued from `state`; also the new count of valid steps [B]."""
  t = state.steps[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.float32) - 1  # [B, T]
  # The phase in cycles, reduced to [0, 1) before the cosine: t * f grows to thousands over long series.
  cycles = jnp.mod(t[..., None] * jnp.asarray(freqs, jnp.float32), 1.0)  # [B, T, K]
  angle = (2 * np.pi) * cycles
  weight = mask.astype(jnp.float32)[..., None]
  re = state.spec_re + jnp.einsum("btk,btf->bkf", jnp.cos(angle) * weight, series)
  im = state.spec_im - jnp.einsum("btk,btf->bkf", jnp.sin(angle) * weight, series)
  return re, im, state.steps + mask.sum(axis=1)


class _SpectrumBranch(nn.Module):
  """Fourier sums [B, K, F] over `steps` [B] valid steps -> [B, width]: log of the mean magnitude per (frequency,
  feature), layer-normalised, then dense -> GELU."""
  width: int

  @nn.compact
  def __call__(self, re, im, steps):
    magnitude = jnp.sqrt(re**2 + im**2) / jnp.maximum(steps, 1.0)[:, None, None]
    features = jnp.log(magnitude + SPECTRUM_FLOOR).reshape(re.shape[0], -1)
    features = nn.LayerNorm(dtype=jnp.float32, param_dtype=jnp.float32, name="norm")(features)
    return nn.gelu(nn.Dense(self.width, dtype=jnp.float32, param_dtype=jnp.float32, name="dense")(features))


def init_params(cfg: ModelConfig, ts: TimeSeriesConfig, n_outputs: int, features: int, key: jax.Array):
  """Float32 parameters (unboxed) of TimeSeriesModel(cfg, ts, n_outputs) for series of `features` features. As for
  the decoder, a scanned stack starts from the per-layer initialisation stacked."""
  if cfg.scan_layers:
    per_layer = init_params(dataclasses.replace(cfg, scan_layers=False), ts, n_outputs, features, key)
    return model_lib.scan_params(cfg, per_layer)
  series = jnp.zeros((1, ts.patch, features), jnp.float32)
  # Jitted: run op by op, initialisation compiles each of its hundreds of small ops on its own.
  init = jax.jit(lambda key: nn.meta.unbox(TimeSeriesModel(cfg, ts, n_outputs).init(key, series)["params"]))
  return init(key)


def matmul_params(params) -> int:
  """Weights multiplied by every patch (2-D or stacked 3-D kernels of the embedding and the block stack)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  count = 0
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    stacked = model_lib.is_stacked(path)
    if leaf.ndim - stacked >= 2 and ("block_" in name or "'embed'" in name):
      count += int(np.prod(leaf.shape))
  return count
