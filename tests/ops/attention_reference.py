"""The float64 attention reference shared by the attention tests: masks built pair by pair in Python ints, softmax
written out plainly, k and v repeated to every query head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def random_qkv(rng, b, t, s, hq, hkv, d, dtype=jnp.float32):
  q = rng.standard_normal((b, t, hq, d))
  k = rng.standard_normal((b, s, hkv, d))
  v = rng.standard_normal((b, s, hkv, d))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def reference_mask(b, t, s, *, causal, window=None, q_pos=None, kv_pos=None, q_seg=None, kv_seg=None):
  """[B, T, S] bool, one (query, key) pair at a time, in Python ints."""
  if q_pos is None:
    q_pos = np.tile(np.arange(t) + s - t, (b, 1))
    kv_pos = np.tile(np.arange(s), (b, 1))
  mask = np.zeros((b, t, s), bool)
  for bi in range(b):
    for i in range(t):
      for j in range(s):
        qp, kp = int(q_pos[bi, i]), int(kv_pos[bi, j])
        visible = True
        if causal:
          visible &= kp <= qp
        if window is not None:
          visible &= qp - kp < window
        if q_seg is not None:
          visible &= int(q_seg[bi, i]) == int(kv_seg[bi, j])
        mask[bi, i, j] = visible
  return mask


def reference(q, k, v, mask, scale):
  """Plain float64 attention: k and v repeated to every query head, rows without visible keys give zeros."""
  group = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, group, axis=2)
  v = jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q, k) * scale
  m = jnp.asarray(mask)[:, None]
  any_visible = m.any(-1, keepdims=True)
  logits = jnp.where(m, logits, -jnp.inf)
  peak = jax.lax.stop_gradient(jnp.where(any_visible, logits.max(-1, keepdims=True), 0.0))
  e = jnp.exp(logits - peak)
  probs = e / jnp.where(any_visible, e.sum(-1, keepdims=True), 1.0)
  return jnp.einsum("bhts,bshd->bthd", probs, v)


def value_and_grads(fn, q, k, v, cotangent):
  """fn(q, k, v) and the gradients of sum(fn(q, k, v) * cotangent), in one jitted call (eager would compile every
  small op separately)."""

  @jax.jit
  def run(q, k, v, cotangent):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(cotangent)

  return run(q, k, v, cotangent)


def reference_value_and_grads(q, k, v, mask, scale, cotangent):
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    cot = jnp.asarray(np.asarray(cotangent, np.float64))
    out, grads = value_and_grads(lambda *a: reference(*a, mask, scale), *args, cot)
    return np.asarray(out), [np.asarray(g) for g in grads]
