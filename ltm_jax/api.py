"""The notebook-facing API: a model with its parameters and tokenizer, loaded from a workdir or built from a config.

    import ltm_jax
    lm = ltm_jax.build(ltm_jax.load_config("configs/tiny.py"))   # or ltm_jax.load("runs/tiny")
    print(lm.generate("The list type", max_new_tokens=100))
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax import data as data_lib
from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax import config as config_lib
from ltm_jax.config import Config
from ltm_jax.errors import CheckpointError, ConfigError, LtmError
from ltm_jax.inference import diagnostics
from ltm_jax.inference import generate as generation
from ltm_jax.inference import inputs
from ltm_jax.inference import quantize as quantize_lib
from ltm_jax.inference import text as text_lib
from ltm_jax.layers import KVCache
from ltm_jax.state import abstract_train_state
from ltm_jax.train import checkpoint as ckpt_lib
from ltm_jax.train.optimizer import make_optimizer


class LanguageModel:
  """Config + parameters + tokenizer, with `forward`, `init_state`/`step`, `generate` and `stream_tokens`.

  A latent model (config.latent.enabled) reads latent thought vectors z [B, latent layers, n_per_layer, d_model]:
  `fit_latents` infers them from tokens with the inner loop, `prior_latents` draws them from N(0, I), and `forward`,
  `step` and the generation methods take them explicitly, so decoding and the full forward pass can be compared under
  one z. `quantize("int8")` gives the same model with int8 matmul weights, dequantised inside every jitted call."""

  def __init__(self, config: Config, params, trained_steps: int = 0, workdir: str | pathlib.Path | None = None):
    self.config = config
    self.params = params
    self.trained_steps = trained_steps  # Optimizer steps behind these parameters (0 for a fresh model).
    self.workdir = None if workdir is None else pathlib.Path(workdir)  # Where it was loaded from (its prior's home).
    self._prior = None
    self.model = model_lib.LM(config.model, config.latent)
    self.tokenizer = data_lib.get_tokenizer(config.data.tokenizer)
    self._apply = jax.jit(functools.partial(generation.run_model, self.model))

  @property
  def has_latents(self) -> bool:
    return self.config.latent.enabled

  @property
  def quantized(self) -> bool:
    return quantize_lib.has_quantized_weights(self.params)

  @property
  def float_params(self):
    """The parameters with quantised weights dequantised to float32 (their rounding kept; the others as they are):
    what a function that reads plain parameters, such as the evaluation, takes to measure the quantised model."""
    return jax.jit(quantize_lib.dequantize_params)(self.params) if self.quantized else self.params

  @property
  def param_bytes(self) -> int:
    """Bytes the parameters occupy (int8 weights count one byte per value, plus their float32 scales)."""
    return quantize_lib.param_bytes(self.params)

  def quantize(self, kind: str = "int8", group_size: int | None = None,
               keep_int8: Sequence[str] = ()) -> LanguageModel:
    """This model with every matmul weight stored as int8 with a float32 scale per output channel, or as int4 with
    a float32 scale per `group_size` inputs (default 128) and output channel (symmetric); norms, per-channel vectors
    and the input embedding stay float32. With int4, `keep_int8` names weights stored as int8 instead (("head",):
    the LM head; see `quantize_params`). `group_size` and `keep_int8` apply to int4 only: given with int8, they are
    refused (a ValueError), as is an int4 group that does not divide some weight's fan-in."""
    if self.quantized:
      raise LtmError("this model is already quantized")
    if group_size is not None and kind != "int4":
      raise ValueError(f"group_size sets int4's inputs per scale; it does not apply to {kind}")
    axes = model_lib.param_axes(self.config.model, self.config.latent)
    group_size = quantize_lib.DEFAULT_GROUP_SIZE if group_size is None else group_size
    params = quantize_lib.quantize_params(self.params, axes, kind, group_size, keep_int8)
    quantized = LanguageModel(self.config, params, self.trained_steps, self.workdir)
    quantized._prior = self._prior
    return quantized

  def latent_shape(self, batch: int) -> tuple[int, int, int, int]:
    self._need_latents()
    inputs.check_int("batch", batch, low=1)
    return model_lib.latent_shape(self.config.model, self.config.latent, batch)

  def _need_latents(self) -> None:
    if not self.has_latents:
      raise LtmError("this model has no latent thought vectors (latent.enabled=false)")

  def prior_latents(self, batch: int, seed: int = 0) -> jax.Array:
    """z ~ p(z) = N(0, I): [B, latent layers, n_per_layer, d_model] float32, the z that `generate(...,
    latents="prior", seed=seed)` draws for B prompts."""
    return jax.random.normal(_latent_key(inputs.key(seed)), self.latent_shape(batch), jnp.float32)

  @property
  def prior(self):
    """The learned prior over z (`ltm_jax.prior.LatentPrior`) trained in this model's workdir, loaded on first use;
    assign one to use a prior from elsewhere."""
    self._need_latents()
    if self._prior is None:
      if self.workdir is None:
        raise LtmError("this model was not loaded from a workdir, so it has no learned prior: load it with "
                       "ltm_jax.load(workdir) or assign lm.prior")
      from ltm_jax.prior.model import load_prior
      self._prior = load_prior(self.workdir, self.config)
    return self._prior

  @prior.setter
  def prior(self, prior) -> None:
    self._need_latents()
    expected = self.latent_shape(1)[1:]
    if tuple(prior.latent_shape) != expected:
      raise LtmError(f"the prior was trained for latents of shape {list(prior.latent_shape)}, but this model's are "
                     f"{list(expected)}")
    self._prior = prior

  def dit_latents(self, batch: int, seed: int = 0, *, sampler: str | None = None,
                  steps: int | None = None) -> jax.Array:
    """z from the learned prior (`prior`): [B, latent layers, n_per_layer, d_model] float32, drawn by `sampler`
    ("dpm++" or "ddpm"; default prior.sampler) in `steps` denoiser evaluations (default prior.sampler_steps); with
    the defaults, the z that `generate(..., latents="dit", seed=seed)` draws for B prompts."""
    inputs.check_int("batch", batch, low=1)
    return self.prior.sample(batch, _latent_key(inputs.key(seed)), sampler, steps)

  def fit_latents(self, tokens, *, steps: int | None = None, seed: int = 0) -> latent_lib.FitResult:
    """Fits q(z|x) to each row of tokens [B, T] (T >= 2: every token after the first is a target) with
    `steps` inner steps (default latent.inner_steps). The result's `posterior.mu` is the usual z to condition on;
    `nll` and `kl` trace each sequence's summed NLL and KL before every step and after the last."""
    self._need_latents()
    tokens = jnp.asarray(inputs.token_ids(tokens, self.config.model.vocab_size, "fit_latents", single=False, min_length=2))
    lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
    fitted, _ = _fit(self.model, self.params, tokens, lengths, inputs.key(seed), self._inner_steps(steps))
    return fitted

  def _inner_steps(self, steps: int | None) -> int:
    steps = self.config.latent.inner_steps if steps is None else steps
    if steps < 0:
      raise ValueError(f"steps must be >= 0, got {steps}")
    return steps

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

  def forward(self, tokens, latents=None, *, seed: int = 0) -> jax.Array:
    """tokens [B, T] (or [T]) int -> float32 logits [B, T, vocab_size] (or [T, vocab_size]).

    Latent models need `latents`: z [B, latent layers, n_per_layer, d_model] (without B for a single sequence),
    "posterior" (the posterior mean fitted to these tokens, using `seed`), "prior" (a draw from N(0, I)) or "dit"
    (a draw from the learned prior, `dit_latents`)."""
    tokens = inputs.token_ids(tokens, self.config.model.vocab_size, "forward")
    single = tokens.ndim == 1
    tokens = jnp.asarray(tokens[None] if single else tokens)
    if single:
      latents = latents if latents is None or isinstance(latents, str) else jnp.asarray(latents)[None]
    if isinstance(latents, str):
      lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
      latents = self._resolve_latents(tokens, lengths, latents, inputs.key(seed))
    logits, _ = self._apply(self.params, tokens, None, self._latents_for(tokens, latents))
    return logits[0] if single else logits

  def memory_stats(self, tokens, latents=None, *, seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The Titans memory layers' statistics over tokens [B, T] (`diagnostics.memory_statistics`): per layer, the
    surprise and the gates per token and head, and the norms of the memory's weights and momentum at the end.
    `latents` as for `forward`."""
    tokens = jnp.asarray(inputs.token_ids(tokens, self.config.model.vocab_size, "memory_stats", single=False))
    if isinstance(latents, str):
      lengths = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
      latents = self._resolve_latents(tokens, lengths, latents, inputs.key(seed))
    try:
      return diagnostics.memory_statistics(self.config.model, self.config.latent, self.params, tokens,
                                           self._latents_for(tokens, latents))
    except ValueError as e:
      raise LtmError(str(e)) from None

  def init_state(self, batch: int, capacity: int | None = None):
    """The per-layer state before any token (empty caches, zero recurrent states). Full-attention caches hold
    `capacity` positions (default model.max_seq_len); sliding-window caches hold exactly the window."""
    inputs.check_int("batch", batch, low=1)
    return model_lib.init_state(self.config.model, batch, capacity)

  def step(self, state, tokens, latents=None, positions=None):
    """Advances `state` by a chunk of tokens [B, T] (any T, one token when decoding) -> (logits [B, T, vocab_size],
    new state). Chunked calls equal one call on the whole sequence.

    Latent models need `latents` as an array (the same z for every chunk of a sequence: infer it once with
    `fit_latents`) and, with latent.rope, the chunk's absolute `positions` [B, T].

    A full-attention cache holds `capacity` positions; going past them raises instead of silently turning the layer
    into a sliding window."""
    tokens = inputs.token_ids(tokens, self.config.model.vocab_size, "step", single=False)
    batch = inputs.state_batch(self.config.model, state)
    if batch is not None and batch != tokens.shape[0]:
      raise ValueError(f"step got tokens for batch size {tokens.shape[0]} with a state made for batch size {batch} "
                       f"(init_state({tokens.shape[0]}) makes one for these tokens)")
    tokens = jnp.asarray(tokens)
    if self.config.model.window is None:
      caches = [leaf for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, KVCache))
                if isinstance(leaf, KVCache)]
      if caches:
        capacity = caches[0].k.shape[-3]
        end = int(jnp.max(caches[0].next_position)) + tokens.shape[1]
        if end > capacity:
          raise ValueError(f"step would reach position {end}, beyond the attention cache's capacity of {capacity} "
                           "positions (init_state(batch, capacity=...) makes a larger one)")
    if isinstance(latents, str):
      raise ValueError("step needs latents as an array (one z for every chunk of a sequence): use "
                       "fit_latents(tokens).posterior.mu or prior_latents(batch)")
    return self._apply(self.params, tokens, state, self._latents_for(tokens, latents), positions)

  def generate(self, prompt, max_new_tokens: int = 200, *, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0, stop_at_eos: bool = True,
               stop: str | Sequence[str] | None = None, latents=None) -> str | list[str]:
    """Samples a continuation of each prompt (text out; the prompt itself is not repeated). `prompt`: a string or
    token ids [T] (a list of ints or a 1-D integer array) -> a string; a list of strings, a list of token-id
    sequences or a [B, T] array -> a list of strings, decoded as one batch however different their lengths. An
    empty text starts from the beginning-of-text token.

    `stop`: a string or a list of strings; each row's text ends before the first of them (not included), as the
    server's stop strings do (`inference.text.StopText`). With stop strings the batch is decoded 16 tokens per
    on-device loop, so that it ends soon after every row has stopped; the tokens drawn are the same either way.

    Latent models condition on `latents`: "posterior" (z inferred from each prompt by the inner loop; the default
    when every prompt has 2+ tokens), "prior" (z ~ N(0, I): unconditional), "dit" (z from the learned prior:
    unconditional) or an array z [B, latent layers, n_per_layer, d_model], e.g. `fit_latents(other_text).posterior.mu`
    to continue a prompt under another text's thoughts."""
    rows, single = self._prompt_rows(prompt, "generate")
    stops = text_lib.stop_strings(stop)
    chunks = self.stream_tokens(rows, max_new_tokens, key=inputs.key(seed), chunk=16 if stops else max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, stop_at_eos=stop_at_eos,
                                latents=latents)
    outputs = ["" for _ in rows]
    for pieces in self._row_texts(chunks, len(rows), stop_at_eos, stops):
      outputs = [text + piece for text, piece in zip(outputs, pieces)]
    return outputs[0] if single else outputs

  def stream(self, prompt, max_new_tokens: int = 200, *, chunk: int = 16, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop_at_eos: bool = True,
             stop: str | Sequence[str] | None = None, latents=None) -> Iterator[str]:
    """`generate` for one prompt (a string or token ids [T]), yielding the continuation as text pieces as soon as
    each on-device loop of `chunk` tokens finishes; the pieces join to exactly what `generate` returns for the same
    seed. Characters split across chunks, and the last characters that could begin a stop string, are held back
    until settled. The prompt and every option are checked by this call, before the first piece is asked for."""
    rows, single = self._prompt_rows(prompt, "stream")
    if not single:
      raise ValueError(f"stream takes one prompt (a string or token ids [T]), got {len(rows)} prompts; generate "
                       "takes several")
    stops = text_lib.stop_strings(stop)
    chunks = self.stream_tokens(rows, max_new_tokens, key=inputs.key(seed), chunk=chunk, temperature=temperature,
                                top_k=top_k, top_p=top_p, stop_at_eos=stop_at_eos, latents=latents)
    return (pieces[0] for pieces in self._row_texts(chunks, 1, stop_at_eos, stops) if pieces[0])

  def _row_texts(self, chunks: Iterator[np.ndarray], batch: int, stop_at_eos: bool,
                 stop: tuple[str, ...]) -> Iterator[list[str]]:
    """The text of `chunks` ([B, n] new tokens each), every row's new text after each chunk (`text.StopText`); a
    row ends at its first end-of-text token (with stop_at_eos) or stop string. The last list holds every row's
    rest; no chunk is asked for once every row has ended."""
    eos = self.tokenizer.eos_id if stop_at_eos else None
    texts = [text_lib.StopText(self.tokenizer, stop) for _ in range(batch)]
    ended = [False] * batch
    for tokens in chunks:
      for row, text in enumerate(texts):
        if not ended[row]:
          kept = _cut_at(tokens[row], eos)
          ended[row] = text.add(kept) or len(kept) < tokens.shape[1]
      if all(ended):
        break
      yield [text.take(final=False) for text in texts]
    for text in texts:
      text.close()
    yield [text.take(final=True) for text in texts]

  def _prompt_rows(self, prompt, what: str) -> tuple[list[np.ndarray], bool]:
    """`prompt` as token-id rows -> (rows, whether it was one prompt): text is encoded (an empty text is the
    beginning-of-text token), token ids are checked (`inputs.prompt_rows`)."""
    if isinstance(prompt, str):
      return [self._prompt_ids(prompt)], True
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
      return [self._prompt_ids(p) for p in prompt], False
    return inputs.prompt_rows(prompt, self.config.model.vocab_size, what)

  def _prompt_ids(self, text: str) -> np.ndarray:
    ids = self.encode(text)
    return ids if len(ids) else np.array([self.tokenizer.bos_id], np.int32)

  def generate_tokens(self, prompt, max_new_tokens: int, *, key, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, stop_at_eos: bool = True, stop_tokens: Sequence[int] = (),
                      latents=None) -> np.ndarray:
    """prompt [B, T] int, or a list of B prompts of any lengths -> [B, max_new_tokens] int32, decoded in one
    on-device loop. A row ends at its first stop token (eos when stop_at_eos, and any of `stop_tokens`) and repeats
    it after; the loop ends once every row has ended.

    `latents` (latent models only): an array z [B, latent layers, n_per_layer, d_model], "posterior" (the posterior mean
    fitted to each prompt), "prior" (a draw from N(0, I)) or "dit" (a draw from the learned prior); None picks "posterior" when every prompt has 2+
    tokens."""
    chunks = list(self.stream_tokens(prompt, max_new_tokens, key=key, chunk=max_new_tokens, temperature=temperature,
                                     top_k=top_k, top_p=top_p, stop_at_eos=stop_at_eos, stop_tokens=stop_tokens,
                                     latents=latents))
    return np.concatenate(chunks, axis=1)

  def stream_tokens(self, prompt, max_new_tokens: int, *, key, chunk: int = 16, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None, stop_at_eos: bool = True,
                    stop_tokens: Sequence[int] = (), latents=None) -> Iterator[np.ndarray]:
    """As `generate_tokens`, yielding [B, n] int32 arrays of up to `chunk` new tokens as soon as each on-device loop
    of `chunk` steps finishes (all chunks together are exactly what `generate_tokens` returns). Stops early once
    every row has ended; the last chunk then carries the rows' stop tokens repeated to its full length. The prompt
    and every option are checked by this call, before the first chunk is asked for."""
    inputs.check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    inputs.check_int("chunk", chunk, low=1)
    m = self.config.model
    tokens, lengths = inputs.as_prompts(prompt, self.tokenizer.pad_id, m.vocab_size)
    if "attention" in m.mixers and m.window is None and tokens.shape[1] + max_new_tokens > m.max_seq_len:
      raise ValueError(f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"model.max_seq_len={m.max_seq_len}, the longest context its full-attention layers take")
    extra_stops = np.array(list(stop_tokens))
    inputs.check_ids(extra_stops, m.vocab_size, "stop token id")
    stops = tuple(sorted({*extra_stops.tolist(), *([self.tokenizer.eos_id] if stop_at_eos else [])}))
    latents = self._latent_plan(tokens, lengths, latents)
    return self._decode_chunks(jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens, key, chunk, stops, latents,
                               dict(temperature=temperature, top_k=top_k, top_p=top_p))

  def _decode_chunks(self, tokens: jax.Array, lengths: jax.Array, max_new_tokens: int, key: jax.Array, chunk: int,
                     stops: tuple[int, ...], latents, sampling: dict) -> Iterator[np.ndarray]:
    """The on-device part of `stream_tokens`, on arguments it has checked."""
    m = self.config.model
    sample_key, latent_key = jax.random.split(key)  # latent_key is `_latent_key(key)`.
    latents = self._draw_latents(tokens, lengths, latents, latent_key)
    # Full-attention caches sized to this call (rounded to share compilations), not to model.max_seq_len.
    model = model_lib.LM(m, self.config.latent, cache_capacity=_round_up(tokens.shape[1] + max_new_tokens, 64))
    decoding = generation.prefill(model, self.params, tokens, lengths, latents)
    produced = 0
    while produced < max_new_tokens and (produced == 0 or not bool(jnp.all(decoding.done))):
      steps = min(chunk, max_new_tokens - produced)
      new, decoding = generation.decode(model, self.params, decoding, sample_key, steps=steps, stop_tokens=stops,
                                        latents=latents, **sampling)
      produced += steps
      yield np.asarray(new)
    if produced < max_new_tokens:  # Every row ended early: pad with their stop tokens, as one loop would.
      yield np.repeat(np.asarray(decoding.last_token)[:, None], max_new_tokens - produced, axis=1)

  def _resolve_latents(self, tokens: jax.Array, lengths: jax.Array, latents, key: jax.Array) -> jax.Array | None:
    """The z for left-padded prompts tokens [B, T] of `lengths` [B]: given, "prior" or "posterior"."""
    return self._draw_latents(tokens, lengths, self._latent_plan(tokens, lengths, latents), key)

  def _latent_plan(self, tokens, lengths, latents) -> jax.Array | str | None:
    """`latents` checked for left-padded prompts tokens [B, T] of `lengths` [B], without device work: the z to use
    (None for plain models), or "prior" / "posterior" for a z still to draw or fit."""
    if not self.has_latents or not isinstance(latents, str) and latents is not None:
      return self._latents_for(tokens, latents)
    shortest = int(np.min(lengths))
    if latents is None:
      latents = "posterior" if shortest >= 2 else "prior"
    if latents not in ("prior", "posterior", "dit"):
      raise ValueError(f"latents must be 'posterior', 'prior', 'dit', an array or None; got {latents!r}")
    if latents == "dit":
      _ = self.prior  # Loaded (or refused) before any device work.
    if latents == "posterior" and shortest < 2:
      raise ValueError("latents='posterior' needs prompts of at least 2 tokens to infer from; use 'prior'")
    return latents

  def _draw_latents(self, tokens: jax.Array, lengths: jax.Array, plan, key: jax.Array) -> jax.Array | None:
    """The z of a `_latent_plan`: drawn from the prior, fitted to the prompts, or the plan itself."""
    if not isinstance(plan, str):
      return plan
    if plan == "prior":
      return jax.random.normal(key, self.latent_shape(tokens.shape[0]), jnp.float32)
    if plan == "dit":
      return self.prior.sample(tokens.shape[0], key)
    fitted, _ = _fit(self.model, self.params, tokens, lengths, key, self._inner_steps(None))
    return fitted.posterior.mu


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("model", "steps"))
def _fit(model, params, tokens, lengths, key, steps):
  """The inner loop on every next-token target of left-padded prompts tokens [B, T] of `lengths` [B]."""
  valid, _ = generation.prompt_mask(lengths, tokens.shape[1])
  params = quantize_lib.dequantize_params(params, jnp.dtype(model.cfg.dtype))
  return latent_lib.infer(model, params, tokens[:, :-1], tokens[:, 1:], key, steps=steps, valid=valid[:, :-1])


def _cut_at(tokens: np.ndarray, stop: int | None) -> np.ndarray:
  if stop is None:
    return tokens
  hits = np.flatnonzero(tokens == stop)
  return tokens[:hits[0]] if hits.size else tokens


def build(config: Config, seed: int = 0) -> LanguageModel:
  """A freshly initialised model for `config` (parameters from `seed`); ConfigError for a config `validate` refuses."""
  config = config_lib.validate(config)
  return LanguageModel(config, model_lib.init_params(config.model, jax.random.key(seed), config.latent))


def _latent_key(key: jax.Array) -> jax.Array:
  """The half of a generation key that draws z; the other half samples tokens."""
  return jax.random.split(key)[1]


def load(workdir: str | pathlib.Path, step: int | None = None, overrides: Sequence[str] = (),
         quantize: str | None = None) -> LanguageModel:
  """The model saved in `workdir` at `step` (default: the newest checkpoint that can be read; each newer one that
  cannot is named in a warning line on stderr, and `trained_steps` says which step was used).

  `overrides` change how the model runs, e.g. ["model.wkv_impl=scan", "model.dtype=bfloat16"]; keys that would
  change the parameters are refused. `quantize="int8"` (or "int4", in groups of 128) stores the matmul weights
  quantised (`LanguageModel.quantize`)."""
  if quantize not in (None,) + quantize_lib.KINDS:
    raise ValueError(f"unknown quantization {quantize!r}; choose from {', '.join(quantize_lib.KINDS)}")
  if ckpt_lib.read_config_json(workdir).timeseries.enabled:  # Read first: a clear error for a non-workdir too.
    raise LtmError(f"{workdir} holds a time-series model (timeseries.enabled); load reads decoder LMs: its val_* "
                   "and final test_* metrics are in the workdir's metrics.jsonl")
  prior_keys = [o for o in overrides if isinstance(o, str) and o.strip().startswith("prior.")]
  if prior_keys:  # The learned prior runs with the settings it was trained with, not the decoder's config.
    raise ConfigError(f"{', '.join(prior_keys)}: prior.* keys are set when training the prior (`ltm train-prior`); "
                      "choose how latents='dit' samples with dit_latents(sampler=, steps=) or `ltm generate "
                      "--sampler/--sampler-steps`")
  checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
  available = checkpointer.all_steps()
  if step is not None and step not in available:
    raise CheckpointError(f"{workdir} has no checkpoint at step {step}; available: {available}")

  def read(at: int) -> tuple[Config, object]:
    saved = checkpointer.saved_config(at)
    config = config_lib.validate(config_lib.apply_overrides(saved, overrides))
    ckpt_lib.check_compatible(saved, config, str(workdir))
    return config, checkpointer.restore(at, abstract_train_state(config, make_optimizer(config.train)))[0]

  try:
    if step is not None:  # Exactly this step: a damaged one is an error, not a reason to pick another.
      config, state = read(step)
    else:
      step, (config, state), _ = checkpointer.newest_readable(read)
  finally:
    checkpointer.close()
  lm = LanguageModel(config, state.params, step, workdir)
  return lm if quantize is None else lm.quantize(quantize)
