"""The one place where kernels choose how Pallas lowers: Triton on NVIDIA GPUs, the interpreter everywhere else.

Since jax 0.9 `pallas_call` lowers to Mosaic GPU by default on NVIDIA; our kernels are written for the Triton lowering
(per-program blocks, `num_warps`/`num_stages`), which is selected by passing Triton `CompilerParams`. The Triton backend
is deprecated from jax 0.11 but still present in 0.11.x/0.12; when it goes, this module is where a Mosaic GPU
(`jax.experimental.pallas.mosaic_gpu.CompilerParams`) or jax-triton path replaces it, and no kernel changes its call.
`jax.experimental.pallas.triton` is imported only when a compiled kernel is built, so the library (and the
interpreted kernels) still import where that module is gone.

The choice follows the platform the computation is compiled for (`lax.platform_dependent`), not the host's default
device: a computation placed on the CPU of a GPU host interprets, and a deviceless compilation for a GPU compiles. A
process that cannot compile for a GPU at all (no GPU backend, no CUDA/ROCm PJRT plugin) interprets without tracing
the compiled branch, which keeps CPU-only programs free of it (its custom VJPs are not differentiable twice).
"""

from __future__ import annotations

import functools
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl


@functools.cache
def may_compile_for_gpu() -> bool:
  """Whether this process can compile for a GPU: it has a GPU backend, or a CUDA/ROCm PJRT plugin is installed (a
  deviceless compilation for a GPU target)."""
  if jax.default_backend() == "gpu":
    return True
  if importlib.util.find_spec("jax_plugins") is None:
    return False
  import jax_plugins  # pylint: disable=g-import-not-at-top
  return any("cuda" in m.name or "rocm" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


@functools.cache
def _first_order_guard(message: str) -> Callable[[Any], Any]:
  @jax.custom_jvp
  def identity(xs):
    return xs

  @identity.defjvp
  def _differentiated(primals, tangents):
    del primals, tangents
    raise NotImplementedError(message)

  return identity


def first_order_only(message: str, *xs: Any) -> Any:
  """`xs` unchanged; differentiating them raises NotImplementedError(`message`).

  A custom VJP whose rules are Pallas kernels passes its inputs through this at the top of its forward and backward
  rules. A first derivative evaluates those rules on plain values and never differentiates them; a second derivative
  differentiates the rules themselves (the residuals and the backward pass are functions of the inputs), which the
  kernels' `pallas_call`s do not support and would fail on with an opaque error deep inside JAX. Arguments without a
  tangent (integers, constants) pass silently.
  """
  return _first_order_guard(message)(xs)


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
    compiled_kernel: Callable[..., None] | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
  """`pl.pallas_call` lowered through Triton on GPU and interpreted on CPU (`interpret=None`), or as `interpret` says.

  `num_warps`/`num_stages` are the Triton launch parameters; they are ignored by the interpreter. `compiled_kernel`,
  when given, replaces `kernel` where the kernel is compiled: a form of the same computation written for the
  compiler (loops unrolled, loads issued ahead of their use) whose interpreted trace would only be larger and slower.
  """
  def build(interpreted: bool) -> Callable[..., Any]:
    params = None
    body = kernel
    if not interpreted:
      from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
      params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
      body = compiled_kernel or kernel
    return pl.pallas_call(body, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          interpret=interpreted, compiler_params=params, name=name, **kwargs)

  if interpret is not None:
    return build(interpret)
  if not may_compile_for_gpu():
    return build(True)

  def by_platform(*args):
    try:
      compiled = build(False)
    except ImportError as e:  # A jax without the Triton lowering: nothing to compile with, interpreting still works.
      if jax.default_backend() == "gpu":
        raise NotImplementedError(f"this jax has no Pallas Triton lowering ({e}); use the xla/scan backends") from e
      return build(True)(*args)
    # Pallas has no CPU lowering: interpret there, compile everywhere else. Only the branch of the platform being
    # compiled for is lowered.
    return lax.platform_dependent(*args, cpu=build(True), default=compiled)

  return by_platform
