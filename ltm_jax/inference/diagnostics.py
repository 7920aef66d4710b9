"""The names of `ltm_jax.diagnostics` (the Titans memory layers' statistics from a forward pass), which inference
and training's validation rows share, under the inference package."""

from ltm_jax.diagnostics import *  # pylint: disable=wildcard-import,unused-wildcard-import
