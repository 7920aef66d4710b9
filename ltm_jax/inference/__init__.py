"""Decoding: prefill a prompt through the model's state API, then sample token by token on device."""

from ltm_jax.inference.generate import generate_tokens
