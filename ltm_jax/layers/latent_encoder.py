"""An amortised start for latent inference: a small network that reads a sequence's tokens and proposes q(z|x).

The inner loop (ltm_jax/latent.py) starts from this proposal instead of from the prior, so fewer refinement steps
reach a good posterior (semi-amortised inference, Kim et al. 2018). Shape of the network: each token's embedding
joined with the `context` tokens before it (local n-gram features, as wide as `width`), a residual MLP, then one
learned query per latent vector attending over the visible tokens (attention pooling, as a Perceiver reads), a
residual MLP per latent vector, and a zero-initialised head for mu (and, with `learn_logvar`, one for logvar; else
logvar is init_logvar). At initialisation every output is (0, init_logvar): the prior-like start of the plain loop,
before the loop's symmetry-breaking noise.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from ltm_jax.layers.common import dense, init, norm

HEAD_DIM = 32


class LatentEncoder(nn.Module):
  """tokens [B, T] int, visible [B, T] bool -> (mu, logvar), each [B, n_latents, d_out] float32.

  Only tokens marked visible are read (a prefix to fit z on, or a row's valid tokens); a row with none gets the
  initial output (0, init_logvar)."""
  vocab_size: int
  n_latents: int
  d_out: int
  width: int
  context: int
  init_logvar: float
  learn_logvar: bool = False
  std: float = 0.02

  @nn.compact
  def __call__(self, tokens: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    w, heads = self.width, max(1, self.width // HEAD_DIM)
    embed = nn.Embed(self.vocab_size, w, dtype=jnp.float32, param_dtype=jnp.float32,
                     embedding_init=init(self.std, ("vocab", "embed")), name="embed")
    e = embed(tokens) * visible[..., None]  # Unread tokens contribute nothing, as context either.
    shifted = [jnp.pad(e, ((0, 0), (c, 0), (0, 0)))[:, :e.shape[1]] for c in range(self.context)]
    h = dense(w, ("mlp", "embed"), self.std, jnp.float32, "ngram")(jnp.concatenate(shifted, -1))
    h = h + self._mlp(h, "token_mlp")
    x = norm("layernorm", 1e-5, jnp.float32, "pool_norm")(h)
    k = dense((heads, HEAD_DIM), ("embed", "heads", "head_dim"), self.std, jnp.float32, "k")(x)
    v = dense((heads, HEAD_DIM), ("embed", "heads", "head_dim"), self.std, jnp.float32, "v")(x)
    queries = self.param("queries", init(1.0, ("latent", "heads", "head_dim")), (self.n_latents, heads, HEAD_DIM),
                         jnp.float32)
    logits = jnp.einsum("nhd,bthd->bhnt", queries, k) / jnp.sqrt(HEAD_DIM)
    logits = jnp.where(visible[:, None, None, :], logits, -jnp.inf)
    seen = visible.any(-1)
    weights = jax.nn.softmax(jnp.where(seen[:, None, None, None], logits, 0.0), axis=-1)
    pooled = jnp.einsum("bhnt,bthd->bnhd", weights, v)
    p = dense(w, ("heads", "head_dim", "embed"), self.std, jnp.float32, "pool_out", in_axis=(-2, -1))(pooled)
    p = p + self._mlp(p, "latent_mlp")
    p = norm("layernorm", 1e-5, jnp.float32, "out_norm")(p)
    mu = self._head(p, 0.0, "mu")
    logvar = self._head(p, self.init_logvar, "logvar") if self.learn_logvar else jnp.full_like(mu, self.init_logvar)
    keep = seen[:, None, None]
    return jnp.where(keep, mu, 0.0), jnp.where(keep, logvar, self.init_logvar)

  def _head(self, x: jax.Array, start: float, name: str) -> jax.Array:
    """A dense head whose output starts at `start` for every input (zero kernel, constant bias)."""
    return nn.Dense(self.d_out, dtype=jnp.float32, kernel_init=nn.with_logical_partitioning(
        nn.initializers.zeros, ("embed", "embed_out")), bias_init=nn.with_logical_partitioning(
            nn.initializers.constant(start), ("embed_out",)), name=name)(x)

  def _mlp(self, x: jax.Array, name: str) -> jax.Array:
    y = norm("layernorm", 1e-5, jnp.float32, f"{name}_norm")(x)
    y = dense(2 * self.width, ("embed", "mlp"), self.std, jnp.float32, f"{name}_in")(y)
    return dense(self.width, ("mlp", "embed"), self.std, jnp.float32, f"{name}_out")(jax.nn.gelu(y))
