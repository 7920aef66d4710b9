"""The notebook-facing API: a model with its parameters and tokenizer, loaded from a workdir or built from a config.

    import ltm_jax
    lm = ltm_jax.build(ltm_jax.load_config("configs/tiny.py"))   # or ltm_jax.load("runs/tiny")
    print(lm.generate("The list type", max_new_tokens=100))
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax import config as config_lib
from ltm_jax.config import Config
from ltm_jax.errors import CheckpointError, LtmError
from ltm_jax.inference import generate_tokens
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train.optimizer import make_optimizer
from ltm_jax.train.step import create_train_state


class LanguageModel:
  """Config + parameters + tokenizer, with `forward`, `step` and `generate`.

  A latent model (config.latent.enabled) reads latent thought vectors z [B, n_layers, n_per_layer, d_model]:
  `fit_latents` infers them from tokens with the inner loop, `prior_latents` draws them from N(0, I), and `forward`,
  `step` and `generate` take them explicitly, so decoding and the full forward pass can be compared under one z."""

  def __init__(self, config: Config, params, trained_steps: int = 0):
    self.config = config
    self.params = params
    self.trained_steps = trained_steps  # Optimizer steps behind these parameters (0 for a fresh model).
    self.model = model_lib.LM(config.model, config.latent)
    self.tokenizer = data_lib.get_tokenizer(config.data.tokenizer)
    self._apply = jax.jit(self.model.apply)

  @property
  def has_latents(self) -> bool:
    return self.config.latent.enabled

  def latent_shape(self, batch: int) -> tuple[int, int, int, int]:
    self._need_latents()
    return model_lib.latent_shape(self.config.model, self.config.latent, batch)

  def _need_latents(self) -> None:
    if not self.has_latents:
      raise LtmError("this model has no latent thought vectors (latent.enabled=false)")

  def prior_latents(self, batch: int, seed: int = 0) -> jax.Array:
    """z ~ p(z) = N(0, I): [B, n_layers, n_per_layer, d_model] float32."""
    return jax.random.normal(jax.random.key(seed), self.latent_shape(batch), jnp.float32)

  def fit_latents(self, tokens, *, steps: int | None = None, seed: int = 0) -> latent_lib.FitResult:
    """Fits q(z|x) to each row of tokens [B, T] (T >= 2: every token after the first is a target) with
    `steps` inner steps (default latent.inner_steps). The result's `posterior.mu` is the usual z to condition on;
    `nll` and `kl` trace each sequence's summed NLL and KL before every step and after the last."""
    self._need_latents()
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
      raise ValueError(f"fit_latents needs tokens [B, T] with T >= 2, got shape {tokens.shape}")
    steps = self.config.latent.inner_steps if steps is None else steps
    if steps < 0:
      raise ValueError(f"steps must be >= 0, got {steps}")
    fitted, _ = _fit(self.model, self.params, tokens, jax.random.key(seed), steps)
    return fitted

  def _latents_for(self, tokens: jax.Array, latents) -> jax.Array | None:
    """The latents to run `tokens` under: None for plain models; for latent models, those given (a required
    argument) checked against the batch."""
    if not self.has_latents:
      if latents is not None:
        raise ValueError("latents were given to a model without latent thought vectors (latent.enabled=false)")
      return None
    expected = self.latent_shape(tokens.shape[0])
    if latents is None:
      raise ValueError(f"this model conditions on latent thought vectors: pass latents of shape {expected} "
                       "(from fit_latents(...).posterior.mu or prior_latents)")
    latents = jnp.asarray(latents, jnp.float32)
    if latents.shape != expected:
      raise ValueError(f"latents must have shape {expected}, got {latents.shape}")
    return latents

  @property
  def num_params(self) -> int:
    return model_lib.count_params(self.params)

  def encode(self, text: str) -> np.ndarray:
    self._check_text_vocabulary()
    return self.tokenizer.encode(text)

  def decode(self, tokens) -> str:
    self._check_text_vocabulary()
    return self.tokenizer.decode(np.asarray(tokens))

  def _check_text_vocabulary(self) -> None:
    if self.config.model.vocab_size > self.tokenizer.vocab_size:  # Trained on pre-tokenized ids (.bin).
      raise LtmError(f"the model's vocabulary ({self.config.model.vocab_size} ids) is larger than the "
                     f"{self.tokenizer.name} tokenizer's ({self.tokenizer.vocab_size}); use token ids "
                     "(forward, step, generate_tokens) instead of text")

  def forward(self, tokens, latents=None) -> jax.Array:
    """tokens [B, T] (or [T]) int -> float32 logits [B, T, vocab_size] (or [T, vocab_size]).

    Latent models need `latents` [B, n_layers, n_per_layer, d_model] (or without B for a single sequence)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    single = tokens.ndim == 1
    if single:
      tokens = tokens[None]
      latents = None if latents is None else jnp.asarray(latents)[None]
    logits, _ = self._apply({"params": self.params}, tokens, latents=self._latents_for(tokens, latents))
    return logits[0] if single else logits

  def init_state(self, batch: int):
    """The per-layer state before any token (empty caches, zero recurrent states)."""
    return model_lib.init_state(self.config.model, batch)

  def step(self, state, tokens, latents=None, positions=None):
    """Advances `state` by a chunk of tokens [B, T] -> (logits [B, T, vocab_size], new state).

    Latent models need `latents` (the same z for every chunk of a sequence) and, with latent.rope, the chunk's
    absolute `positions` [B, T].

    Full-attention layers hold at most model.max_seq_len keys; going past that raises instead of silently turning
    them into sliding-window layers."""
    tokens = jnp.asarray(tokens, jnp.int32)
    m = self.config.model
    for layer_state, kind in zip(state, m.mixers):
      if kind == "attention" and m.window is None:
        end = int(jnp.max(layer_state.mixer.next_position)) + tokens.shape[1]
        if end > m.max_seq_len:
          raise ValueError(f"step would reach position {end}, beyond model.max_seq_len={m.max_seq_len}, the "
                           "attention cache capacity")
        break
    return self._apply({"params": self.params}, tokens, state, self._latents_for(tokens, latents), positions)

  def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 200, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop_at_eos: bool = True, latents: str | None = None) -> str | list[str]:
    """Samples a continuation of each prompt (text in, text out; the prompt itself is not repeated).

    Latent models condition on `latents`: "posterior" (z inferred from the prompt by the inner loop; the default for
    prompts of 2+ tokens) or "prior" (z ~ N(0, I): unconditional; the default for shorter prompts)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    key = jax.random.key(seed)
    outputs = []
    for i, text in enumerate(prompts):  # Ragged batches arrive with the fast-generation issue; one prompt at a time.
      ids = self.encode(text)
      if len(ids) == 0:
        ids = np.array([self.tokenizer.bos_id], np.int32)
      tokens = self.generate_tokens(ids[None], max_new_tokens, key=jax.random.fold_in(key, i),
                                    temperature=temperature, top_k=top_k, top_p=top_p, stop_at_eos=stop_at_eos,
                                    latents=latents)
      outputs.append(self.decode(_cut_at(tokens[0], self.tokenizer.eos_id if stop_at_eos else None)))
    return outputs[0] if isinstance(prompt, str) else outputs

  def generate_tokens(self, prompt, max_new_tokens: int, *, key, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, stop_at_eos: bool = True, latents=None) -> np.ndarray:
    """prompt [B, T] int -> [B, max_new_tokens] int32 (rows continue with eos after an eos when stop_at_eos).

    `latents` (latent models only): an array z [B, n_layers, n_per_layer, d_model], "posterior" (the posterior mean
    fitted to each prompt) or "prior" (a draw from N(0, I)); None picks "posterior" for prompts of 2+ tokens."""
    prompt = jnp.asarray(prompt, jnp.int32)
    latents = self._resolve_latents(prompt, latents, key)
    m = self.config.model
    if "attention" in m.mixers and m.window is None and prompt.shape[1] + max_new_tokens > m.max_seq_len:
      raise ValueError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"model.max_seq_len={m.max_seq_len}, the attention cache capacity")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return np.asarray(generate_tokens(self.model, self.params, prompt, key, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      stop_token=self.tokenizer.eos_id if stop_at_eos else None,
                                      latents=latents))

  def _resolve_latents(self, prompt: jax.Array, latents, key: jax.Array) -> jax.Array | None:
    if not self.has_latents or not isinstance(latents, str) and latents is not None:
      return self._latents_for(prompt, latents)
    if latents is None:
      latents = "posterior" if prompt.shape[1] >= 2 else "prior"
    key = jax.random.fold_in(key, 1)  # Apart from the sampling keys.
    if latents == "prior":
      return jax.random.normal(key, self.latent_shape(prompt.shape[0]), jnp.float32)
    if latents == "posterior":
      if prompt.shape[1] < 2:
        raise ValueError("latents='posterior' needs a prompt of at least 2 tokens to infer from; use 'prior'")
      fitted, _ = _fit(self.model, self.params, prompt, key, self.config.latent.inner_steps)
      return fitted.posterior.mu
    raise ValueError(f"latents must be 'posterior', 'prior', an array or None; got {latents!r}")


@functools.partial(jax.jit, static_argnames=("model", "steps"))
def _fit(model, params, tokens, key, steps):
  """The inner loop on every next-token target of tokens [B, T]."""
  return latent_lib.infer(model, params, tokens[:, :-1], tokens[:, 1:], key, steps=steps)


def _cut_at(tokens: np.ndarray, stop: int | None) -> np.ndarray:
  if stop is None:
    return tokens
  hits = np.flatnonzero(tokens == stop)
  return tokens[:hits[0]] if hits.size else tokens


def build(config: Config, seed: int = 0) -> LanguageModel:
  """A freshly initialised model for `config` (parameters from `seed`)."""
  return LanguageModel(config, model_lib.init_params(config.model, jax.random.key(seed), config.latent))


def load(workdir: str | pathlib.Path, step: int | None = None, overrides: Sequence[str] = ()) -> LanguageModel:
  """The model saved in `workdir` at `step` (default: the latest checkpoint).

  `overrides` change how the model runs, e.g. ["model.wkv_impl=scan", "model.dtype=bfloat16"]; keys that would
  change the parameters are refused."""
  ckpt_lib.read_config_json(workdir)  # A clear error for a folder that is not a workdir.
  checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
  available = checkpointer.all_steps()
  if not available:
    raise CheckpointError(f"{workdir} has no checkpoints")
  step = max(available) if step is None else step
  if step not in available:
    raise CheckpointError(f"{workdir} has no checkpoint at step {step}; available: {sorted(available)}")
  saved = checkpointer.saved_config(step)
  config = config_lib.validate(config_lib.apply_overrides(saved, overrides))
  ckpt_lib.check_compatible(saved, config, str(workdir))
  template = jax.eval_shape(lambda: create_train_state(
      model_lib.init_params(config.model, jax.random.key(0), config.latent), make_optimizer(config.train), 0))
  state, _ = checkpointer.restore(step, template)
  checkpointer.close()
  return LanguageModel(config, state.params, step)
