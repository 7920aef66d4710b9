"""Token cross-entropy of a linear LM head whose [B, T, V] float32 logits are never held at once.

`reference_nll` is the plain form: x @ kernel -> logits [B, T, V] float32 -> softmax cross-entropy (with 16-bit x and
kernel, the logits' gradient is rounded to their dtype before the backward's two products). `token_nll`
computes the same values over chunks of `chunk` positions under `lax.map` with each chunk rematerialised: the
forward keeps one [B, chunk, V] block of logits alive, and the backward recomputes each chunk's logits from x and
the kernel (one extra head matmul) instead of storing all of them, so the loss's memory grows with the chunk, not
with the sequence.

The head may be padded to V >= vocab_size columns (fast matmul shapes); the padded columns are masked out of the
softmax rather than sliced off, so the logits keep the kernel's column layout (a vocabulary split evenly over
devices stays split evenly) and the padded columns get exactly zero gradient. Targets must lie in [0, vocab_size)
(every data path checks its ids): one in a padded column would read that column's logit. optax's integer-label
cross-entropy does the per-chunk work: its `where` masks the columns, and its label gather partitions over a sharded
vocabulary without gathering the logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


@jax.custom_vjp
def _logits_16bit(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., D] @ kernel [D, V] -> float32 logits [..., V], both operands in one 16-bit dtype. The backward rounds
  the logits' gradient to that dtype and multiplies it there (float32 accumulation), as every other layer's backward
  multiplies its 16-bit cotangents; JAX's own transpose would take the float32 cotangent into float32 products, which
  at model.matmul_precision=highest run without tensor cores."""
  return jnp.dot(x, kernel, preferred_element_type=jnp.float32)


def _logits_16bit_fwd(x, kernel):
  return _logits_16bit(x, kernel), (x, kernel)


def _logits_16bit_bwd(residuals, g):
  x, kernel = residuals
  g = g.astype(x.dtype)
  dx = jnp.dot(g, kernel.T, preferred_element_type=jnp.float32).astype(x.dtype)
  dkernel = jnp.einsum("...d,...v->dv", x, g, preferred_element_type=jnp.float32).astype(kernel.dtype)
  return dx, dkernel


_logits_16bit.defvjp(_logits_16bit_fwd, _logits_16bit_bwd)


def _nll(x: jax.Array, kernel: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
  if x.dtype == kernel.dtype and jnp.dtype(x.dtype).itemsize == 2:
    logits = _logits_16bit(x, kernel)  # [..., V]
  else:
    logits = jnp.dot(x, kernel, preferred_element_type=jnp.float32)
  valid = jnp.arange(kernel.shape[-1]) < vocab_size
  valid = jnp.broadcast_to(valid, logits.shape)  # optax expands a `where` of lower rank along the wrong axis.
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets, where=valid)


def reference_nll(x: jax.Array, kernel: jax.Array, targets: jax.Array, vocab_size: int) -> jax.Array:
  """x [B, T, D] (compute dtype), kernel [D, V], targets [B, T] int in [0, vocab_size) -> NLL [B, T] float32, with
  all [B, T, V] float32 logits materialised; columns from vocab_size on are excluded from the softmax."""
  return _nll(x, kernel, targets, vocab_size)


def token_nll(x: jax.Array, kernel: jax.Array, targets: jax.Array, vocab_size: int, chunk: int) -> jax.Array:
  """`reference_nll` computed `chunk` positions at a time (0, or chunk >= T: all at once).

  T need not divide by `chunk`: the last chunk is padded (zero vectors with target 0, whose results are dropped)."""
  batch, length, width = x.shape
  if chunk <= 0 or chunk >= length:
    return reference_nll(x, kernel, targets, vocab_size)
  chunks = -(-length // chunk)
  pad = chunks * chunk - length
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
  # Chunks along the sequence, never the batch: the batch axis keeps its sharding and the loop runs over an axis that
  # no device splits.
  xs = x.reshape(batch, chunks, chunk, width).swapaxes(0, 1)  # [chunks, B, chunk, D]
  ts = targets.reshape(batch, chunks, chunk).swapaxes(0, 1)  # [chunks, B, chunk]
  per_chunk = jax.checkpoint(lambda xt: _nll(xt[0], kernel, xt[1], vocab_size))
  nll = jax.lax.map(per_chunk, (xs, ts))  # [chunks, B, chunk]
  return nll.swapaxes(0, 1).reshape(batch, chunks * chunk)[:, :length]
