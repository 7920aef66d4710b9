"""cuDNN flash attention through `jax.nn.dot_product_attention(..., implementation="cudnn")`.

`jax.nn.dot_product_attention` builds its masks from array indices only: it has no per-token positions, no segment ids
(its cuDNN packed-layout arguments are not exposed), and its causal mask is aligned at the top-left corner (query i
sees keys j <= i). So this backend takes plain causal or sliding-window self-attention with T == S, or non-causal
attention of any T and S. Everything else goes to the xla backend. Only the argument mapping
(`dot_product_attention_kwargs`) and the support check depend on our mask definition, and both are pure functions, so
they are tested on CPU by running the same mapping through `implementation="xla"`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ltm_pallas.backend import first_order_only

_DTYPES = (jnp.float16, jnp.bfloat16)


def unsupported_reason(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    dtype: Any,
    *,
    causal: bool,
    has_positions: bool,
    has_segment_ids: bool,
    max_head_dim: int = 256,
) -> str | None:
  """Why cuDNN cannot run this call (a sentence), or None if it can. Depends on arguments only, not the device.

  Windows never disqualify a call: they come with causal=True, which needs T == S here anyway.

  Args:
    q_shape: [B, T, Hq, D].
    kv_shape: [B, S, Hkv, D].
    dtype: the common dtype of q, k and v.
    causal: as in `ltm_jax.ops.attention.attention`.
    has_positions: whether q_positions/kv_positions were given.
    has_segment_ids: whether segment_ids were given.
    max_head_dim: the largest head dimension the GPU's cuDNN kernels take (256 from Hopper on, else 128).
  """
  t, d = q_shape[1], q_shape[3]
  s = kv_shape[1]
  if has_positions:
    return "custom q_positions/kv_positions are not expressible in jax.nn.dot_product_attention"
  if has_segment_ids:
    return "segment_ids are not expressible in jax.nn.dot_product_attention"
  if jnp.dtype(dtype) not in [jnp.dtype(x) for x in _DTYPES]:
    return f"cuDNN flash attention takes float16 or bfloat16, got {jnp.dtype(dtype)}"
  if d % 8 or d > max_head_dim:
    return f"cuDNN flash attention takes a head dim that is a multiple of 8 and <= {max_head_dim}, got {d}"
  if causal and t != s:
    # Our causal default aligns the ends of the query and key ranges; cuDNN's mask aligns the starts.
    return f"causal attention with T != S ({t} vs {s}) needs end-aligned positions, which cuDNN does not take"
  return None


def device_unsupported_reason() -> tuple[str | None, int]:
  """(why the default device cannot run cuDNN attention or None, the largest head dim it takes)."""
  if jax.default_backend() != "gpu":
    return f"cuDNN attention needs a GPU, the default backend is {jax.default_backend()}", 0
  # CUDA devices report "major.minor"; other GPUs (ROCm) lack it or report an architecture name.
  capability = str(getattr(jax.devices()[0], "compute_capability", ""))
  head = capability.split(".")[0]
  if not head.isdigit():
    return "cuDNN attention needs an NVIDIA GPU", 0
  major = int(head)
  if major < 8:
    return f"cuDNN flash attention needs compute capability >= 8.0, got {capability}", 0
  return None, 256 if major >= 9 else 128


def dot_product_attention_kwargs(*, causal: bool, window: int | None, s: int) -> dict[str, Any]:
  """Our mask arguments as `jax.nn.dot_product_attention` keyword arguments (for T == S when causal).

  The one place where the window definitions meet. Ours: key j is visible from query i iff i - W < j <= i.
  `local_window_size=(left, right)` keeps keys with i - left <= j <= i + right, and its cuDNN path, which requires
  right == 0 or a causal mask, turns it into cuDNN's `sliding_window_length = left + 1`, meaning keys in
  (i - left - 1, i]. Both equal ours for left = W - 1, right = 0.
  """
  kwargs: dict[str, Any] = {"is_causal": causal}
  # A window covering every key is no window; dropping it lets cuDNN use its plain causal kernel.
  if window is not None and window < s:
    kwargs["local_window_size"] = (window - 1, 0)
  return kwargs


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    window: int | None,
    scale: float,
    implementation: str = "cudnn",
) -> jax.Array:
  """Attention through `jax.nn.dot_product_attention`; the caller has checked `unsupported_reason`.

  Args:
    q: [B, T, Hq, D].
    k: [B, S, Hkv, D].
    v: [B, S, Hkv, D].
    causal, window, scale: as in `ltm_jax.ops.attention.attention`.
    implementation: "cudnn"; "xla" runs the same mapped arguments through JAX's own reference (for tests).

  Returns:
    [B, T, Hq, D] in q's dtype.
  """
  kwargs = dot_product_attention_kwargs(causal=causal, window=window, s=k.shape[1])
  call = functools.partial(jax.nn.dot_product_attention, scale=scale, implementation=implementation, **kwargs)
  return first_order(call, _SECOND_ORDER)(q, k, v)


_SECOND_ORDER = ("attention: impl='cudnn' (cuDNN flash attention) has no second derivative; impl='xla' is "
                 "differentiable to any order")


def first_order(call, message: str):
  """`call` (arrays) -> o, differentiable once: its derivative is `call`'s own (a fused backward kernel), and a
  second derivative raises NotImplementedError(`message`), which names the op and the backends that have one (the
  kernels have no derivative rules of their own, and JAX's error would name neither). Integer arguments (segment
  ids) pass through without a tangent."""

  @jax.custom_vjp
  def run(*arrays):
    return call(*arrays)

  def run_fwd(*arrays):
    return jax.vjp(call, *first_order_only(message, *arrays))

  def run_bwd(pullback, do):
    pullback, do = first_order_only(message, pullback, do)
    return pullback(do)

  run.defvjp(run_fwd, run_bwd)
  return run
