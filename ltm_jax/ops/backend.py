"""Backend selection shared by every op: `impl="auto"` resolves by platform through a per-op table, for the platform
the computation is compiled for (`lax.platform_dependent`), not the host's default device."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence

import jax
from jax import lax

from ltm_pallas import backend as kernel_backend

# `auto` tables name platforms as jax.default_backend() does; lax.platform_dependent names them by lowering platform.
_LOWERING_NAMES = {"gpu": "cuda"}


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the default device (what jitted ops run on)."""
  return jax.default_backend()


def kernel_free(auto: Mapping[str, str], without_kernels: Mapping[str, str],
                lowering: kernel_backend.GpuLowering | None = None) -> Mapping[str, str]:
  """The `auto` table this process uses: `auto` where the Pallas kernels can compile for a GPU, else (`lowering` is
  "xla": a jax without the Triton lowering) `auto` with `without_kernels`'s entries (platform -> a backend that runs
  no Pallas kernel) in place, said once per process. `lowering` defaults to `ltm_pallas.backend.gpu_lowering()`."""
  if not without_kernels:
    return auto
  lowering = kernel_backend.gpu_lowering() if lowering is None else lowering
  if lowering.name != "xla":
    return auto
  kernel_backend.notice_once(lowering.notice, kernel_backend.SAID, stacklevel=4)
  return {**auto, **without_kernels}


def select(op: str, impl: str, backends: Mapping[str, Callable], auto: Mapping[str, str], *,
           length: int | None = None, without_kernels: Mapping[str, str] | None = None) -> Callable:
  """The backend function for `impl` (`backends` maps names to functions of the same signature, reference first).

  "auto" dispatches at lowering time through `auto` (platform -> backend name): each platform the computation is
  compiled for gets its entry, others the reference. A computation placed on the CPU of a GPU host therefore runs
  the CPU entry, and a deviceless GPU compilation the GPU one. A process that cannot compile for a GPU resolves
  statically by its platform (nothing else is traced). `length=1` (one decoding step) always gets the reference (see
  `resolve`). `without_kernels` (platform -> backend) replaces `auto`'s entries where this jax cannot compile the
  Pallas kernels for a GPU (`kernel_free`).
  """
  if impl == "auto" and kernel_backend.may_compile_for_gpu():
    auto = kernel_free(auto, without_kernels or {})
  available = tuple(backends)
  name = resolve(op, impl, available, auto, length=length)
  if impl != "auto" or length == 1 or not kernel_backend.may_compile_for_gpu():
    return backends[name]  # Without any GPU target, the host's platform is the only one it can compile for.
  reference = backends[available[0]]
  branches = {_LOWERING_NAMES.get(p, p): backends[n] for p, n in auto.items() if backends[n] is not reference}
  if not branches:
    return reference

  def by_platform(*args, **static):
    # Keyword arguments are static settings (a chunk length, say): bound to every branch, never traced.
    bind = lambda fn: functools.partial(fn, **static) if static else fn
    return lax.platform_dependent(*args, default=bind(reference), **{p: bind(fn) for p, fn in branches.items()})

  return by_platform


def resolve(op: str, impl: str, available: Sequence[str], auto: Mapping[str, str], *,
            length: int | None = None, without_kernels: Mapping[str, str] | None = None) -> str:
  """Returns the concrete backend name for `impl`, or raises ValueError naming the valid choices.

  `auto` maps a platform to the backend measured fastest there (the benchmark that measured it is named beside each
  table); a platform missing from the table falls back to the first (reference) backend. A recurrence given
  `length=1` (one decoding step) always gets the reference under "auto": one step is a few elementwise ops that XLA
  fuses, where a kernel would pad it to a whole chunk and pay a launch. `without_kernels` as in `select`.
  """
  if impl == "auto" and platform() == "gpu":
    auto = kernel_free(auto, without_kernels or {})
  if impl == "auto":
    return available[0] if length == 1 else auto.get(platform(), available[0])
  if impl not in available:
    raise ValueError(f"{op}: unknown impl {impl!r}; choose from auto, {', '.join(available)}")
  return impl


def static_int(op: str, name: str, value: object, *, low: int) -> int:
  """`value` as a Python int >= low (shapes depend on it, so it must not be traced), or a ValueError naming it."""
  if isinstance(value, bool):
    raise ValueError(f"{op}: {name} must be a static int, got {value!r}")
  try:
    value = operator.index(value)
  except TypeError:
    raise ValueError(f"{op}: {name} must be a static int, got {value!r}") from None
  if value < low:
    raise ValueError(f"{op}: {name} must be >= {low}, got {value}")
  return value
