"""Flax Linen modules. Every mixer and FFN maps (x [B, T, d_model], state) -> (y, new_state); no backend choices."""

from ltm_jax.layers.attention import Attention, KVCache
from ltm_jax.layers.ffn import SwiGLU
from ltm_jax.layers.rwkv4 import ChannelMix, ChannelMixState, TimeMix, TimeMixState
