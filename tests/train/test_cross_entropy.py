"""The chunked cross-entropy of the LM head (ltm_jax/ops/cross_entropy.py) against float64 references."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.ops import cross_entropy

from conftest import micro_config

VOCAB, PADDED = 250, 384  # The head's columns from 250 on are padding.


def _inputs(seed=0, batch=2, length=12, width=16):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch, length, width)).astype(np.float32)
  kernel = rng.standard_normal((width, PADDED)).astype(np.float32) * 0.5
  targets = rng.integers(0, VOCAB, (batch, length)).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, (batch, length)).astype(np.float32)  # Per-token cotangents: a masked loss's shape.
  return x, kernel, targets, weights


def _float64_loss_and_grads(x, kernel, targets, weights):
  """sum(weights * NLL) over the first VOCAB columns only, and its gradients, written out in float64."""
  x, kernel = x.astype(np.float64), kernel.astype(np.float64)
  logits = np.einsum("btd,dv->btv", x, kernel)[..., :VOCAB]
  shifted = logits - logits.max(-1, keepdims=True)
  probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
  nll = -np.log(np.take_along_axis(probs, targets[..., None], -1))[..., 0]
  dlogits = probs.copy()
  np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
  dlogits = np.concatenate([dlogits * weights[..., None], np.zeros(logits.shape[:2] + (PADDED - VOCAB,))], -1)
  return nll, np.einsum("btv,dv->btd", dlogits, kernel), np.einsum("btd,btv->dv", x, dlogits)


@pytest.mark.parametrize("chunk", [0, 4, 5])  # Whole, dividing T, a padded last chunk.
def test_chunked_nll_and_gradients_match_float64(chunk):
  """Values 2e-6 relative, gradients 1e-5 of their largest entry (float32 logits of magnitude ~5); the padded columns
  get exactly zero gradient."""
  x, kernel, targets, weights = _inputs()
  ref_nll, ref_dx, ref_dk = _float64_loss_and_grads(x, kernel, targets, weights)

  def loss(x, kernel):
    nll = cross_entropy.token_nll(x, kernel, targets, VOCAB, chunk)
    return (nll * weights).sum(), nll

  (_, nll), (dx, dk) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, kernel)
  np.testing.assert_allclose(nll, ref_nll, rtol=2e-6)
  np.testing.assert_allclose(dx, ref_dx, atol=1e-5 * np.abs(ref_dx).max())
  np.testing.assert_allclose(dk, ref_dk, atol=1e-5 * np.abs(ref_dk).max())
  assert np.all(np.asarray(dk)[:, VOCAB:] == 0.0)


def _dots(jaxpr):
  """The operand dtypes of every dot_general in a jaxpr, nested jaxprs (the loop, the remat, the custom VJP) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _dots(sub)
  return found


@pytest.mark.parametrize("chunk", [0, 5])
def test_bfloat16_head_multiplies_its_gradient_in_bfloat16(chunk):
  """With bfloat16 x and kernel the loss's backward products take the logits' gradient rounded to bfloat16 (as every
  other layer's backward), none multiplies in float32; values as the float64 loss of the rounded inputs (float32
  logits: 1e-5), gradients within 2^-7 of their largest entry (measured 1.8e-3 to 5.0e-3, the largest the kernel's
  gradient summed over chunks in bfloat16; with float32 products 1.6e-3 to 4.2e-3)."""
  x, kernel, targets, weights = _inputs(3)
  x, kernel = jnp.asarray(x, jnp.bfloat16), jnp.asarray(kernel, jnp.bfloat16)
  rounded = [np.asarray(t, np.float32) for t in (x, kernel)]
  ref_nll, ref_dx, ref_dk = _float64_loss_and_grads(*rounded, targets, weights)

  def loss(x, kernel):
    nll = cross_entropy.token_nll(x, kernel, targets, VOCAB, chunk)
    return (nll * weights).sum(), nll

  grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  dots = _dots(jax.make_jaxpr(grad)(x, kernel).jaxpr)
  assert dots and all(dtypes == ("bfloat16", "bfloat16") for dtypes in dots), dots
  (_, nll), (dx, dk) = jax.jit(grad)(x, kernel)
  assert dx.dtype == dk.dtype == jnp.bfloat16
  np.testing.assert_allclose(nll, ref_nll, rtol=1e-5)
  for got, want in ((dx, ref_dx), (dk, ref_dk)):
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2.0**-7 * np.abs(want).max())
  assert np.all(np.asarray(dk, np.float32)[:, VOCAB:] == 0.0)


def test_lm_loss_equals_the_sliced_logits_loss():
  """The LM's folded loss (chunks of 5 positions, tied and untied heads) against optax on its own sliced logits."""
  rng = np.random.default_rng(1)
  inputs, targets = (rng.integers(0, 300, (2, 16)).astype(np.int32) for _ in range(2))
  untied = micro_config(vocab_size=300, loss_chunk=5, n_layers=1, layer_pattern="A").model
  untied_params = jax.jit(model_lib.init_params, static_argnums=0)(untied, jax.random.key(2))
  for tied in (False, True):
    model = model_lib.LM(dataclasses.replace(untied, tie_embeddings=tied))
    params = {k: v for k, v in untied_params.items() if not (tied and k == "head")}

    @jax.jit
    def both(params):
      logits, _ = model.apply({"params": params}, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets), latent_lib.token_nll(
          model, params, inputs, targets)

    expected, nll = both(params)
    np.testing.assert_allclose(nll, expected, rtol=1e-6)


def test_chunks_bound_the_loss_memory():
  """The compiled loss + gradient of [2, 512] tokens over 4096 columns: the plain form's scratch holds the [2, 512,
  4096] float32 logits (16 MiB) and their gradient; with chunks of 64 positions, a few [2, 64, 4096] blocks (2 MiB
  each: logits, their exponentials and gradient). Compiled for the CPU on every host: the bounds are XLA's CPU
  buffer assignment (a GPU compilation adds cuBLAS workspaces and fuses differently, so its scratch is another
  number)."""
  rng = np.random.default_rng(3)
  cpu = jax.devices("cpu")[0]
  x = jax.device_put(jnp.asarray(rng.standard_normal((2, 512, 64)), jnp.float32), cpu)
  kernel = jax.device_put(jnp.asarray(rng.standard_normal((64, 4096)) * 0.1, jnp.float32), cpu)
  targets = jax.device_put(jnp.asarray(rng.integers(0, 4000, (2, 512)), jnp.int32), cpu)

  def temp_bytes(chunk):
    grad = jax.jit(jax.grad(lambda x, k: cross_entropy.token_nll(x, k, targets, 4000, chunk).mean(), (0, 1)))
    return grad.lower(x, kernel).compile().memory_analysis().temp_size_in_bytes

  plain, chunked = temp_bytes(0), temp_bytes(64)
  logits_bytes = 2 * 512 * 4096 * 4
  assert plain >= logits_bytes, plain
  assert chunked < 4 * logits_bytes * 64 // 512, (chunked, plain)
