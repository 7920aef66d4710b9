"""The names of `ltm_jax.quantize` (weight-only int8/int4 quantisation of parameter trees), which serving and
training's quantisation-aware view share, under the inference package."""

from ltm_jax.quantize import *  # pylint: disable=wildcard-import,unused-wildcard-import
