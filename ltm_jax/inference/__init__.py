"""Inference: prefill ragged prompts and decode on device (`generate`), int8 weight-only quantisation
(`quantize`), generated tokens as text cut at stop strings (`text`, shared with the server)."""

from ltm_jax.inference.generate import Decoding, decode, left_pad, prefill, prompt_mask, run_model
from ltm_jax.inference.quantize import Int8Weight, dequantize_params, param_bytes, quantize_params
