"""The one place where kernels choose how Pallas lowers: Triton on NVIDIA GPUs, the interpreter everywhere else.

Since jax 0.9 `pallas_call` lowers to Mosaic GPU by default on NVIDIA; our kernels are written for the Triton lowering
(per-program blocks, `num_warps`/`num_stages`), which is selected by passing Triton `CompilerParams`. The Triton backend
is deprecated from jax 0.11 but still present in 0.11.x/0.12; when it goes, this module is where a Mosaic GPU
(`jax.experimental.pallas.mosaic_gpu.CompilerParams`) or jax-triton path replaces it, and no kernel changes its call.
On CPU (the test suite) the same kernels run with `interpret=True`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


def interpret_default() -> bool:
  """Interpret unless the default device is a GPU: Pallas has no CPU lowering."""
  return jax.default_backend() != "gpu"


def call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    in_specs: Any,
    out_specs: Any,
    num_warps: int = 4,
    num_stages: int = 1,
    interpret: bool | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
  """`pl.pallas_call` lowered through Triton on GPU (or interpreted on CPU when `interpret` is None).

  `num_warps`/`num_stages` are the Triton launch parameters; they are ignored by the interpreter.
  """
  if interpret is None:
    interpret = interpret_default()
  params = None if interpret else pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
      interpret=interpret, compiler_params=params, name=name, **kwargs)
