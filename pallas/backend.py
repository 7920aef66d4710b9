"""The one place where kernels choose how Pallas lowers: Triton on NVIDIA GPUs while the installed jax has that
lowering, the interpreter everywhere else, and which path `impl="auto"` may take on a GPU.

Since jax 0.9 `pallas_call` lowers to Mosaic GPU by default on NVIDIA; our kernels are written for the Triton lowering
(per-program blocks, `num_warps`/`num_stages`), which is selected by passing Triton `CompilerParams`. It runs on
sm_80 (A100) and sm_90 (H100/H200) alike. jax deprecates it from 0.11 (`TRITON_DEPRECATED_SINCE`) and warns on every
kernel it lowers; `call` silences that warning and says once per process, in its place, what runs and what the user
can do (`LoweringNotice`). A jax without the lowering (`jax.experimental.pallas.triton` gone) leaves the ops'
`impl="auto"` on their XLA backends on GPU (`gpu_lowering`, applied by `ltm_jax.ops.backend`), again with one
notice. Mosaic GPU kernels (sm_90 and newer only) are built by their own modules; `gpu_lowering` is where `auto`
would pick one for an op (its `mosaic_gpu` argument).
`jax.experimental.pallas.triton` is imported only when a compiled kernel is built, so the library (and the
interpreted kernels) still import where that module is gone.

The choice follows the platform the computation is compiled for (`lax.platform_dependent`), not the host's default
device: a computation placed on the CPU of a GPU host interprets, and a deviceless compilation for a GPU compiles. A
process that cannot compile for a GPU at all (no GPU backend, no CUDA/ROCm PJRT plugin) interprets without tracing
the compiled branch, which keeps CPU-only programs free of it (its custom VJPs are not differentiable twice).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import pkgutil
import re
import warnings
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


# The first jax release whose Pallas Triton lowering warns that it is deprecated.
TRITON_DEPRECATED_SINCE = (0, 11)
# The first compute capability Mosaic GPU compiles for (Hopper, sm_90).
MOSAIC_GPU_SINCE = (9, 0)
# What jax's deprecation warning for the Triton lowering starts with (`jax._src.pallas.triton`, id jax-pallas-triton).
_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"  # Also the filter's pattern: no special characters.


class LoweringNotice(UserWarning):
  """Which GPU lowering the Pallas kernels use, said once per process (`warnings.simplefilter("ignore",
  LoweringNotice)` silences it)."""


def jax_version(version: str | None = None) -> tuple[int, int]:
  """(major, minor) of `version`, by default the installed jax's ("0.11.2" -> (0, 11))."""
  major, minor = re.match(r"(\d+)\.(\d+)", version or jax.__version__).groups()
  return int(major), int(minor)


@functools.cache
def has_triton_lowering() -> bool:
  """Whether the installed jax has the Pallas Triton lowering (`jax.experimental.pallas.triton` imports)."""
  try:
    importlib.import_module("jax.experimental.pallas.triton")
  except ImportError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class GpuLowering:
  """How an op's kernels run when compiled for a GPU.

  name: "triton" (the Pallas Triton lowering), "mosaic_gpu" (the op's Mosaic GPU kernel) or "xla" (no kernel: the
    op's `impl="auto"` takes its XLA backend).
  notice: the one line to say once per process about it (`notice_once`), or None when there is nothing to say.
  """

  name: str
  notice: str | None


def gpu_lowering(*, version: tuple[int, int] | None = None, triton: bool | None = None,
                 capability: tuple[int, int] | None = None, mosaic_gpu: bool = False) -> GpuLowering:
  """The GPU path of an op's kernels. Defaults are this process's: the installed jax's `version` and whether it has
  the Triton lowering (`triton`); `capability` is the target GPU's (major, minor), None when unknown (a deviceless
  compilation).

  An op with a Mosaic GPU kernel that `auto` may take (`mosaic_gpu`) gets it on sm_90 and newer. Otherwise the
  Triton lowering while jax has it, on sm_80 and sm_90 alike; without it, the op's XLA backends.
  """
  version = jax_version() if version is None else version
  triton = has_triton_lowering() if triton is None else triton
  shown = ".".join(map(str, version))
  if mosaic_gpu and capability is not None and tuple(capability) >= MOSAIC_GPU_SINCE:
    return GpuLowering("mosaic_gpu", None)
  if triton:
    if version < TRITON_DEPRECATED_SINCE:
      return GpuLowering("triton", None)
    return GpuLowering("triton", (
        f"ltm_pallas: the Pallas GPU kernels compile through Pallas' Triton lowering, which jax {shown} deprecates "
        "(its per-kernel DeprecationWarning is silenced); it runs on sm_80 and sm_90. A jax without it makes "
        "impl='auto' take the XLA backends on GPU (slower); to keep the kernels, keep a jax that has "
        "jax.experimental.pallas.triton"))
  return GpuLowering("xla", (
      f"ltm_pallas: jax {shown} has no Pallas Triton lowering, so on GPU impl='auto' runs the ops' XLA backends "
      "(slower, exact); a jax that has jax.experimental.pallas.triton brings the fused kernels back"))


def notice_once(notice: str | None, said: set[str], *, stacklevel: int = 2) -> bool:
  """Warns `notice` as a LoweringNotice unless it is None or in `said` (then records it); True when it warned.
  Callers pass `SAID`, this process's record, so that each notice is said at most once per process."""
  if notice is None or notice in said:
    return False
  said.add(notice)
  warnings.warn(notice, LoweringNotice, stacklevel=stacklevel + 1)
  return True


# The notices this process has said (`notice_once`).
SAID: set[str] = set()


def quiet_triton_deprecation() -> None:
  """Ignores jax's DeprecationWarning for the Pallas Triton lowering, which it raises for every kernel it lowers.

  Called where a compiled kernel is built (trace time), just before jax lowers it: a filter installed once at import
  would not survive test runners that reset the warning filters around each test.
  """
  for action, message, category, *_ in warnings.filters:  # The first filter that applies to the warning decides.
    if issubclass(DeprecationWarning, category) and (message is None or message.match(_TRITON_DEPRECATION)):
      if action == "ignore" and message is not None and message.pattern == _TRITON_DEPRECATION:
        return
      break
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


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
      quiet_triton_deprecation()
      notice_once(gpu_lowering(triton=True).notice, SAID, stacklevel=4)
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
        raise NotImplementedError(
            f"jax {jax.__version__} has no Pallas Triton lowering ({e}), so this kernel cannot compile for a GPU; "
            "impl='auto' runs the op's XLA backend") from e
      return build(True)(*args)
    # Pallas has no CPU lowering: interpret there, compile everywhere else. Only the branch of the platform being
    # compiled for is lowered.
    return lax.platform_dependent(*args, cpu=build(True), default=compiled)

  return by_platform


def mosaic_gpu_call(build: Callable[[bool], Callable[..., Any]], interpret: bool | None) -> Callable[..., Any]:
  """A Mosaic GPU kernel (`build(interpreted)` returns it): with `interpret=None`, compiled where the default backend
  is a GPU and run in Mosaic GPU interpret mode elsewhere; or as `interpret` says.

  Unlike `call`, the choice is the host's default backend, made when tracing, not the platform compiled for: Mosaic
  GPU's interpreter runs on ordered host callbacks, and a `lax.platform_dependent` holding it cannot be lowered for a
  GPU (the unlowered branch's effects still count). So a deviceless compilation for a GPU from a CPU host, or a
  computation placed on a GPU host's CPU, needs `interpret` given. Mosaic GPU compiles for sm_90 and newer only; on
  an older GPU it raises NotImplementedError (`require_mosaic_gpu`).
  """
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  if not interpret:
    require_mosaic_gpu()
  return build(interpret)


def device_capability() -> tuple[int, int] | None:
  """(major, minor) compute capability of the default device when it is a CUDA GPU; None on a CPU (a deviceless
  compilation included) or a GPU without one (ROCm)."""
  if jax.default_backend() != "gpu":
    return None
  parts = str(getattr(jax.devices()[0], "compute_capability", "")).split(".")
  if len(parts) != 2 or not all(p.isdigit() for p in parts):
    return None
  return int(parts[0]), int(parts[1])


def require_mosaic_gpu(capability: tuple[int, int] | None = None) -> None:
  """Raises NotImplementedError where `capability` (by default the default device's, when it is a GPU; None for a
  CPU or a deviceless compilation) is below MOSAIC_GPU_SINCE: Mosaic GPU kernels compile for sm_90 and newer."""
  if capability is None and jax.default_backend() == "gpu":
    capability = tuple(int(x) for x in jax.devices()[0].compute_capability.split("."))
  if capability is not None and tuple(capability) < MOSAIC_GPU_SINCE:
    raise NotImplementedError(
        f"Mosaic GPU kernels need sm_90 or newer; this GPU is sm_{capability[0]}{capability[1]}: use the op's "
        "Triton-lowered or XLA backends")
