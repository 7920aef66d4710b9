"""RoPE against a float64 rotation written out per frequency, and its relative-position property."""

from __future__ import annotations

import jax
import numpy as np

from ltm_jax.layers.rope import apply_rope

ATOL = 2e-5  # float32 sin/cos of angles up to ~1e3 radians.


def test_rope_matches_float64_rotation():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
  positions = rng.integers(0, 500, (2, 5))
  theta, half = 10_000.0, 4
  expected = np.empty_like(x, dtype=np.float64)
  for i in range(half):
    angle = positions[:, :, None].astype(np.float64) * theta ** (-i / half)
    a, b = x[..., i].astype(np.float64), x[..., i + half].astype(np.float64)
    expected[..., i] = a * np.cos(angle) - b * np.sin(angle)
    expected[..., i + half] = b * np.cos(angle) + a * np.sin(angle)
  np.testing.assert_allclose(apply_rope(x, positions, theta), expected, atol=ATOL, rtol=0)


def test_rope_dot_products_depend_on_relative_position_only():
  q = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))
  def score(pq, pk):
    return float((apply_rope(q, np.array([[pq]]), 1e4) * apply_rope(k, np.array([[pk]]), 1e4)).sum())
  assert abs(score(7, 3) - score(107, 103)) < 1e-4
  assert abs(score(7, 3) - score(3, 7)) > 1e-3
