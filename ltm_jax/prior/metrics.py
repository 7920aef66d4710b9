"""How close a prior's samples are to the posteriors: the Frechet distance between two sample sets."""

from __future__ import annotations

import numpy as np
import scipy.linalg


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
  """||m_a - m_b||^2 + tr(C_a + C_b - 2 (C_a C_b)^(1/2)) between the sample means and covariances of a [N, ...] and
  b [M, ...] (flattened per sample), in float64: the 2-Wasserstein distance squared between Gaussians of those
  moments. It sees only the first two moments, and with N near the dimension its estimate is biased upwards: compare
  sets of equal size, against the distance between two sets drawn from the same distribution."""
  a = np.asarray(a, np.float64).reshape(len(a), -1)
  b = np.asarray(b, np.float64).reshape(len(b), -1)
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"the sample sets have different dimensions: {a.shape[1]} and {b.shape[1]}")
  cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
  root = scipy.linalg.sqrtm(cov_a @ cov_b)
  # Rounding leaves an imaginary part of the size of the smallest eigenvalues; the distance is its real part.
  trace = np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(root).real
  return float(np.sum(np.square(a.mean(0) - b.mean(0))) + trace)
