"""Next-token sampling: vocabulary padding mask, temperature, top-k and nucleus (top-p) filtering.

The filters run in this order, each on the output of the previous one, in float32:
  1. vocab_size: ids >= vocab_size (padding of the embedding table) are removed.
  2. temperature: logits / temperature; temperature 0 keeps only the first argmax (greedy).
  3. top_k: keeps every token whose logit is >= the k-th largest, so tokens tied with the k-th all stay.
  4. top_p: keeps the smallest set of most probable tokens whose probability sums to >= top_p (the most probable
     token always stays); tokens tied with the least probable kept one stay too.
Removed tokens get -inf. `top_k` and `vocab_size` are static ints; `temperature` and `top_p` may be Python floats
(a 0 temperature or a top_p >= 1 then skips work) or traced scalars, so one compiled step serves many settings. A
traced top_p of 1 runs the filter, which may drop tokens whose probability is below float32 resolution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend

Scalar = float | jax.Array


def filter_logits(
    logits: jax.Array,
    *,
    temperature: Scalar = 1.0,
    top_k: int | None = None,
    top_p: Scalar | None = None,
    vocab_size: int | None = None,
) -> jax.Array:
  """Logits scaled by 1 / temperature, with -inf on every removed token (see the module docstring for the order).

  Args:
    logits: [B, V] float of any dtype (any leading batch dims work).
    temperature: >= 0; 0 keeps only the argmax.
    top_k: static int >= 1, or None.
    top_p: in (0, 1], or None.
    vocab_size: static int in [1, V]; ids >= vocab_size are removed. None keeps all V.

  Returns:
    [B, V] float32. Sampling from softmax of it is the filtered distribution.
  """
  x = jnp.asarray(logits)
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"filter_logits: logits must be a float array [B, V], got {x.dtype}{list(x.shape)}")
  v = x.shape[-1]
  x = x.astype(jnp.float32)
  _check_scalar("temperature", temperature, low=0.0, low_inclusive=True)
  if top_p is not None:
    _check_scalar("top_p", top_p, low=0.0, low_inclusive=False, high=1.0)

  if vocab_size is not None:
    vocab_size = backend.static_int("filter_logits", "vocab_size", vocab_size, low=1)
    if vocab_size > v:
      raise ValueError(f"filter_logits: vocab_size {vocab_size} exceeds the logits' last dim {v}")
    x = jnp.where(jnp.arange(v) < vocab_size, x, -jnp.inf)

  if _is_static(temperature) and temperature == 0:
    return _keep_argmax(x)
  greedy = None if _is_static(temperature) else temperature == 0
  # A traced 0 divides by 1 here; the greedy branch below replaces the result.
  x = x / (jnp.where(greedy, 1.0, temperature) if greedy is not None else temperature)

  if top_k is not None:
    top_k = backend.static_int("filter_logits", "top_k", top_k, low=1)
    if top_k < v:
      kth = jax.lax.top_k(x, top_k)[0][..., -1:]
      x = jnp.where(x >= kth, x, -jnp.inf)

  if top_p is not None and not (_is_static(top_p) and top_p >= 1):
    x = _top_p(x, top_p)

  if greedy is not None:
    x = jnp.where(greedy, _keep_argmax(x), x)
  return x


def sample_logits(
    key: jax.Array,
    logits: jax.Array,
    *,
    temperature: Scalar = 1.0,
    top_k: int | None = None,
    top_p: Scalar | None = None,
    vocab_size: int | None = None,
) -> jax.Array:
  """Draws one token id per row from the filtered distribution (`filter_logits`).

  Args:
    key: a PRNG key; the same key and inputs give the same ids.
    logits: [B, V] float of any dtype.
    temperature, top_k, top_p, vocab_size: as in `filter_logits`. A static temperature of 0 is argmax and uses no
      randomness.

  Returns:
    [B] int32 ids.
  """
  filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, vocab_size=vocab_size)
  if _is_static(temperature) and temperature == 0:
    return jnp.argmax(filtered, axis=-1).astype(jnp.int32)
  # A traced temperature of 0 leaves one finite logit per row, which categorical always picks.
  return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


def _top_p(x: jax.Array, top_p: Scalar) -> jax.Array:
  """Nucleus filter on float32 logits [..., V]."""
  sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(sorted_x, axis=-1)
  # Mass of the strictly more probable tokens: a token stays while that is still short of top_p, which keeps the
  # smallest prefix reaching top_p and always the first token.
  before = jnp.cumsum(probs, axis=-1) - probs
  keep = before < top_p
  keep = keep.at[..., 0].set(True)
  # The least probable kept logit is the threshold; comparing against it keeps ties and avoids unsorting.
  threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(x >= threshold, x, -jnp.inf)


def _keep_argmax(x: jax.Array) -> jax.Array:
  top = jnp.argmax(x, axis=-1)
  return jnp.where(jnp.arange(x.shape[-1]) == top[..., None], x, -jnp.inf)


def _is_static(value: object) -> bool:
  return isinstance(value, (int, float))


def _check_scalar(name: str, value: object, *, low: float, low_inclusive: bool, high: float | None = None) -> None:
  """Range-checks Python numbers; traced values pass unchecked (they cannot be inspected under jit)."""
  if not _is_static(value):
    if jnp.ndim(value) != 0:
      raise ValueError(f"filter_logits: {name} must be a scalar, got shape {jnp.shape(value)}")
    return
  too_low = value < low if low_inclusive else value <= low
  if too_low or (high is not None and value > high):
    bounds = f"{'[' if low_inclusive else '('}{low}, {high if high is not None else 'inf'}]"
    raise ValueError(f"filter_logits: {name} must be in {bounds}, got {value}")
