"""Pallas GPU kernels (no model knowledge). Filled by the kernel issues."""
