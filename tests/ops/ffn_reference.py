"""A float64 reference for ltm_jax.ops.ffn, y = act(x @ W_in) @ W_out, and its gradients, written plainly in numpy."""

from __future__ import annotations

import numpy as np


def reference(x, w_in, w_out, dy, activation):
  """(y, dx, dW_in, dW_out) in float64 for x [M, d], W_in [d, G, n], W_out [n, e] and the output gradient dy."""
  x, w_in, w_out, dy = (np.asarray(t, np.float64) for t in (x, w_in, w_out, dy))
  z = np.einsum("md,dgn->mgn", x, w_in)
  dh = dy @ w_out.T
  if activation == "relu2":
    relu = np.maximum(z[:, 0], 0)
    h = relu**2
    dz = (dh * 2 * relu)[:, None]
  else:
    gate, up = z[:, 0], z[:, 1]
    s = 1 / (1 + np.exp(-gate))
    h = gate * s * up
    dz = np.stack([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], axis=1)
  return h @ w_out, np.einsum("mgn,dgn->md", dz, w_in), np.einsum("md,mgn->dgn", x, dz), h.T @ dy
