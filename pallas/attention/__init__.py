"""Flash attention in Pallas (Triton lowering on GPU, interpreted elsewhere): forward and backward kernels.

Knows nothing of models; `ltm_jax.ops.attention` reaches it as impl="pallas".

  config.py   static settings, block sizes, which blocks each program visits, the tile mask
  kernels.py  forward, dq and dk/dv kernels and their pallas_calls on padded arrays
  flash.py    flash_attention(): validation, padding, custom_vjp
"""

from __future__ import annotations

from ltm_pallas.attention.config import BlockSizes
from ltm_pallas.attention.flash import flash_attention, raw_outputs

__all__ = ["BlockSizes", "flash_attention", "raw_outputs"]
