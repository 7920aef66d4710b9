"""The DiT denoiser: shapes, adaLN-Zero's identity start, per-example independence and the slot embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.config import PriorConfig
from ltm_jax.prior.dit import DiT, timestep_embedding
from ltm_jax.prior.model import init_params

CFG = PriorConfig(width=32, depth=2, n_heads=4)
SHAPE = (3, 2, 16)  # n_layers, n_per_layer, d_latent


@jax.jit  # One program: drawn leaf by leaf eagerly, each shape would compile its own.
def _perturbed(params, seed=0):
  """Every parameter moved off its initial value, the zero-initialised adaLN and output maps included."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


# The denoiser with its parameters as an argument: one compiled program per batch size, shared by the tests.
_apply = jax.jit(lambda params, x, t: DiT(CFG).apply({"params": params}, x, t))


def _inputs(batch, seed=1):
  x_key, t_key = jax.random.split(jax.random.key(seed))
  return jax.random.normal(x_key, (batch, *SHAPE)), jax.random.uniform(t_key, (batch,), minval=1e-3, maxval=1.0)


def test_untrained_dit_predicts_zero_noise():
  """adaLN-Zero: the output layer and every block's gate start at zero, so eps_theta = 0 exactly at init."""
  params = init_params(CFG, SHAPE, jax.random.key(0))
  x, t = _inputs(4)
  out = _apply(params, x, t)
  assert out.shape == x.shape
  np.testing.assert_array_equal(out, np.zeros(x.shape, np.float32))


def test_each_example_depends_on_its_own_input_and_time_only():
  params = _perturbed(init_params(CFG, SHAPE, jax.random.key(0)))
  apply = lambda x, t: _apply(params, x, t)
  x, t = _inputs(4)
  out = apply(x, t)
  assert float(jnp.abs(out).mean()) > 1e-3
  x2 = x.at[1:].set(-x[1:])
  t2 = t.at[1:].set(0.5)
  np.testing.assert_allclose(apply(x2, t2)[0], out[0], rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(apply(x, t.at[0].set(t[0] * 0.5))[0] - out[0]).max()) > 1e-4  # The time is read.


def test_slots_are_told_apart_by_their_layer_and_slot_embeddings():
  """Swapping two latent vectors between layers changes the prediction beyond the swap: the network knows which
  layer each vector feeds (without the embeddings, attention over slots would be permutation-equivariant)."""
  params = _perturbed(init_params(CFG, SHAPE, jax.random.key(0)))
  apply = lambda x, t: _apply(params, x, t)
  x, t = _inputs(2)
  swap = lambda a: a[:, [1, 0, 2]]
  np.testing.assert_raises(AssertionError, np.testing.assert_allclose, swap(apply(x, t)), apply(swap(x), t),
                           rtol=1e-3, atol=1e-4)
  no_position = jax.tree.map(lambda p: p, params)
  no_position["layer_embedding"] = jnp.zeros_like(params["layer_embedding"])
  no_position["slot_embedding"] = jnp.zeros_like(params["slot_embedding"])
  apply = lambda x, t: _apply(no_position, x, t)
  np.testing.assert_allclose(swap(apply(x, t)), apply(swap(x), t), rtol=1e-4, atol=1e-5)


def test_timestep_embedding_matches_its_formula():
  t = jnp.asarray(np.random.default_rng(2).uniform(1e-3, 1, size=5), jnp.float32)
  emb = np.asarray(timestep_embedding(t, 8), np.float64)
  freqs = np.exp(-np.log(10_000.0) * np.arange(4) / 4)
  angles = 1000.0 * np.asarray(t, np.float64)[:, None] * freqs
  np.testing.assert_allclose(emb, np.concatenate([np.cos(angles), np.sin(angles)], -1), atol=2e-4)
