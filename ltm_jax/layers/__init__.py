"""Flax Linen modules. Every mixer and FFN maps (x [B, T, d_model], state) -> (y, new_state); no backend choices.
The RWKV-7 time-mix also takes and returns v_first, the first RWKV-7 layer's values (its value residual)."""

from ltm_jax.layers.attention import Attention, KVCache
from ltm_jax.layers.cross_attention import CrossAttention, SplitLatents
from ltm_jax.layers.ffn import SwiGLU
from ltm_jax.layers.rwkv4 import ChannelMix, ChannelMixState, TimeMix, TimeMixState
from ltm_jax.layers.rwkv7 import ChannelMix7, TimeMix7, TimeMix7State
from ltm_jax.layers.titans import MemoryAsGate, MemoryAsLayer, NeuralMemory, NeuralMemoryState, TitansState
from ltm_jax.layers.mmrec import MMRec, MMRecState
