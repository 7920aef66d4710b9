"""Pure functions with one signature per op and a backend switch (`impl=`); no Flax, no model knowledge."""

from ltm_jax.ops.attention import attention
from ltm_jax.ops.attention import impl_for as attention_impl_for
from ltm_jax.ops.neural_memory import MemoryState, neural_memory
from ltm_jax.ops.sampling import filter_logits, sample_logits
from ltm_jax.ops.wkv4 import Wkv4State, wkv4
from ltm_jax.ops.wkv4 import empty_state as wkv4_empty_state
from ltm_jax.ops.wkv7 import wkv7
from ltm_jax.ops.wkv7 import empty_state as wkv7_empty_state
