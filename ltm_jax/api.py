"""The notebook-facing API: a model with its parameters and tokenizer, loaded from a workdir or built from a config.

    import ltm_jax
    lm = ltm_jax.build(ltm_jax.load_config("configs/tiny.py"))   # or ltm_jax.load("runs/tiny")
    print(lm.generate("The list type", max_new_tokens=100))
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import data as data_lib
from ltm_jax import model as model_lib
from ltm_jax import config as config_lib
from ltm_jax.config import Config
from ltm_jax.errors import CheckpointError, LtmError
from ltm_jax.inference import generate_tokens
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train.optimizer import make_optimizer
from ltm_jax.train.step import create_train_state


class LanguageModel:
  """Config + parameters + tokenizer, with `forward`, `step` and `generate`."""

  def __init__(self, config: Config, params, trained_steps: int = 0):
    self.config = config
    self.params = params
    self.trained_steps = trained_steps  # Optimizer steps behind these parameters (0 for a fresh model).
    self.model = model_lib.LM(config.model)
    self.tokenizer = data_lib.get_tokenizer(config.data.tokenizer)
    self._apply = jax.jit(self.model.apply)

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

  def forward(self, tokens) -> jax.Array:
    """tokens [B, T] (or [T]) int -> float32 logits [B, T, vocab_size] (or [T, vocab_size])."""
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, _ = self._apply({"params": self.params}, tokens[None] if tokens.ndim == 1 else tokens)
    return logits[0] if tokens.ndim == 1 else logits

  def init_state(self, batch: int):
    """The per-layer state before any token (empty caches, zero recurrent states)."""
    return model_lib.init_state(self.config.model, batch)

  def step(self, state, tokens):
    """Advances `state` by a chunk of tokens [B, T] -> (logits [B, T, vocab_size], new state).

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
    return self._apply({"params": self.params}, tokens, state)

  def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 200, *, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop_at_eos: bool = True) -> str | list[str]:
    """Samples a continuation of each prompt (text in, text out; the prompt itself is not repeated)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    key = jax.random.key(seed)
    outputs = []
    for i, text in enumerate(prompts):  # Ragged batches arrive with the fast-generation issue; one prompt at a time.
      ids = self.encode(text)
      if len(ids) == 0:
        ids = np.array([self.tokenizer.bos_id], np.int32)
      tokens = self.generate_tokens(ids[None], max_new_tokens, key=jax.random.fold_in(key, i),
                                    temperature=temperature, top_k=top_k, top_p=top_p, stop_at_eos=stop_at_eos)
      outputs.append(self.decode(_cut_at(tokens[0], self.tokenizer.eos_id if stop_at_eos else None)))
    return outputs[0] if isinstance(prompt, str) else outputs

  def generate_tokens(self, prompt, max_new_tokens: int, *, key, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, stop_at_eos: bool = True) -> np.ndarray:
    """prompt [B, T] int -> [B, max_new_tokens] int32 (rows continue with eos after an eos when stop_at_eos)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    m = self.config.model
    if "attention" in m.mixers and m.window is None and prompt.shape[1] + max_new_tokens > m.max_seq_len:
      raise ValueError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"model.max_seq_len={m.max_seq_len}, the attention cache capacity")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return np.asarray(generate_tokens(self.model, self.params, prompt, key, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      stop_token=self.tokenizer.eos_id if stop_at_eos else None))


def _cut_at(tokens: np.ndarray, stop: int | None) -> np.ndarray:
  if stop is None:
    return tokens
  hits = np.flatnonzero(tokens == stop)
  return tokens[:hits[0]] if hits.size else tokens


def build(config: Config, seed: int = 0) -> LanguageModel:
  """A freshly initialised model for `config` (parameters from `seed`)."""
  return LanguageModel(config, model_lib.init_params(config.model, jax.random.key(seed)))


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
      model_lib.init_params(config.model, jax.random.key(0)), make_optimizer(config.train), 0))
  state, _ = checkpointer.restore(step, template)
  checkpointer.close()
  return LanguageModel(config, state.params, step)
