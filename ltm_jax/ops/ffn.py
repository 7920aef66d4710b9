"""A feed-forward block's two matmuls and the activation between them, y = act(x @ W_in) @ W_out:

  relu2:   h = relu(z)^2,          z = x @ W_in[:, 0]        (RWKV-7's channel mix)
  swiglu:  h = silu(g) * u,  (g, u) = x @ W_in[:, 0], x @ W_in[:, 1]   (SwiGLU: W_in stacks gate and up)

Backends (the first is the reference):
  xla:          the formula as JAX operations in the compute dtype; XLA differentiates it. Its GEMMs cannot take the
                activation as an epilogue (XLA fuses no elementwise "diamond", an operand used twice, into its Triton
                GEMMs): the forward writes z and reads it back to write h, the backward writes dh and reads it
                back with z to write dz.
  pallas_mgpu:  the matmul into the hidden layer writes z (kept for the backward) and h from its accumulator in one
                pass, and the matmul of the output gradient back into the hidden layer writes dz from its
                accumulator and z (`ltm_pallas.matmul_mgpu`, Mosaic GPU: Hopper and newer, NotImplementedError on
                an older GPU; interpreted off a GPU).
                The output matmul and the weight gradients stay XLA's. Other dtypes than bfloat16, and shapes the
                kernel's tiles do not divide, run the xla form; over a mesh the rows (batch) are split and the
                weights gathered whole on every shard (no tensor parallelism inside the op; each shard's weight
                gradients are rounded to bfloat16 before they are summed).

Both compute z, h and dz from bfloat16-rounded values where the inputs are bfloat16; the fused form rounds h and dz
once from float32 where XLA rounds each elementwise step, so the two agree to bfloat16 rounding, not bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ltm_jax.ops import backend, sharding
from ltm_pallas import matmul_mgpu as kernel

AVAILABLE = ("xla", "pallas_mgpu")
ACTIVATIONS = {"relu2": 1, "swiglu": 2}  # activation -> groups of W_in's columns (G).
# Every platform takes xla: on an H200 the fused kernels made small_rwkv7's and base_125m's train steps slower
# (40.3 against 36.7 ms, 265.0 against 258.3; benchmarks/results/train-*-nvidia-h200.json, docs/kernels.md).
AUTO: dict[str, str] = {}


def _sigmoid(g):
  return 1.0 / (1.0 + jnp.exp(-g))  # In a kernel's epilogue: jax.nn's forms are custom_jvp calls it cannot lower.


def forward_epilogue(activation: str, dtype):
  """The hidden matmul's epilogue: float32 accumulators -> (z rounded to `dtype`, h from the rounded z)."""
  def epilogue(accs):
    z = tuple(a.astype(dtype) for a in accs)
    zf = tuple(t.astype(jnp.float32) for t in z)
    if activation == "relu2":
      h = jnp.square(jnp.maximum(zf[0], 0.0))
    else:
      h = zf[0] * _sigmoid(zf[0]) * zf[1]
    return z, (h,)
  return epilogue


def backward_epilogue(activation: str):
  """The output gradient's matmul epilogue: dh (float32 accumulator) and z -> dz, a tuple of G tiles."""
  def epilogue(accs, z):
    dh = accs[0]
    z = tuple(t.astype(jnp.float32) for t in z)
    if activation == "relu2":
      return ((dh * 2 * jnp.maximum(z[0], 0.0),),)
    gate, up = z
    s = _sigmoid(gate)
    return ((dh * up * s * (1 + gate * (1 - s)), dh * gate * s),)
  return epilogue


def xla(x, w_in, w_out, *, activation: str):
  """The reference: x [..., d] @ W_in [d, G, n] in the compute dtype, the activation in it, then @ W_out [n, d_out].
  On [B, T, d] as the layers' own products were: XLA partitions it over a mesh with the weights sharded as the
  parameters are (no reshape merges a weight's sharded axis with another)."""
  z = jnp.einsum("...d,dgn->...gn", x, w_in)
  if activation == "relu2":
    h = jnp.square(jax.nn.relu(z[..., 0, :]))
  else:
    h = jax.nn.silu(z[..., 0, :]) * z[..., 1, :]
  return h @ w_out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, w_in, w_out, activation, interpret, form):
  return _fused_forward(x, w_in, w_out, activation, interpret, form)[0]


def _fused_forward(x, w_in, w_out, activation, interpret, form):
  groups = w_in.shape[1]
  z, h = kernel.matmul_epilogue(x, w_in, (), epilogue=forward_epilogue(activation, x.dtype),
                                out_dtypes=((x.dtype, groups), (x.dtype, 1)), interpret=interpret, form=form)
  h = h[:, 0]
  return h @ w_out, (x, w_in, w_out, z, h)


def _fused_backward(activation, interpret, form, residuals, dy):
  x, w_in, w_out, z, h = residuals
  groups = w_in.shape[1]
  (dz,) = kernel.matmul_epilogue(dy.astype(x.dtype), w_out.T[:, None, :], (z,), epilogue=backward_epilogue(activation),
                                 out_dtypes=((x.dtype, groups),), interpret=interpret, form=form)
  dz = dz.reshape(dz.shape[0], -1)
  dx = dz @ w_in.reshape(w_in.shape[0], -1).T
  dw_in = (x.T @ dz).reshape(w_in.shape)
  dw_out = h.T @ dy.astype(h.dtype)
  return dx, dw_in.astype(w_in.dtype), dw_out.astype(w_out.dtype)


_fused.defvjp(_fused_forward, _fused_backward)


def pallas_mgpu(x, w_in, w_out, *, activation: str, interpret=None, form: str = "pipelined"):
  """The fused kernels for bfloat16 where their tiles divide [M, d] x [d, G, n] and [M, d_out] x [d_out, n]; else
  the xla form. form: the kernels' form (`ltm_pallas.matmul_mgpu.FORMS`)."""
  if form not in kernel.FORMS:
    raise ValueError(f"ffn: the kernels' form must be one of {kernel.FORMS}; got {form!r}")
  m, d = x.shape
  groups, n = w_in.shape[1:]
  bf16 = all(t.dtype == kernel.OPERANDS for t in (x, w_in, w_out))
  if not (bf16 and kernel.supported(m, d, n, groups, form) and kernel.supported(m, w_out.shape[1], n, 1, form)):
    return xla(x, w_in, w_out, activation=activation)
  return _fused(x, w_in, w_out, activation, interpret, form)


_BACKENDS = {"xla": xla, "pallas_mgpu": pallas_mgpu}


def ffn(x, w_in, w_out, *, activation: str, impl: str = "auto"):
  """y = act(x @ W_in) @ W_out (see the module docstring).

  Args:
    x: [B, T, d] in the compute dtype.
    w_in: [d, G, n] in the compute dtype: G = 1 for "relu2" (the key), 2 for "swiglu" (gate, up).
    w_out: [n, d_out] in the compute dtype.
    activation: "relu2" or "swiglu".
    impl: "auto" (AUTO) or one of AVAILABLE.

  Returns:
    y: [B, T, d_out] in the compute dtype.
  """
  if activation not in ACTIVATIONS:
    raise ValueError(f"ffn: activation must be one of {tuple(ACTIVATIONS)}; got {activation!r}")
  groups = ACTIVATIONS[activation]
  if (x.ndim, w_in.ndim, w_out.ndim) != (3, 3, 2) or w_in.shape[::2] != (x.shape[-1], w_out.shape[0]) or (
      w_in.shape[1] != groups):
    raise ValueError(f"ffn: {activation} wants x [B, T, d], w_in [d, {groups}, n], w_out [n, d_out]; got "
                     f"{x.shape}, {w_in.shape}, {w_out.shape}")
  run = backend.select("ffn", impl, _BACKENDS, AUTO)
  if run is xla:  # XLA partitions the reference over any mesh, weights sharded as the parameters are.
    return xla(x, w_in, w_out, activation=activation)

  def rows(x, w_in, w_out):
    y = run(x.reshape(-1, x.shape[-1]), w_in, w_out, activation=activation)
    return y.reshape(*x.shape[:2], -1)

  # The kernels: rows split over the mesh's batch axes, the weights whole on every shard.
  return sharding.per_shard(rows, (x, w_in, w_out), in_axes=(("batch", None, None), (None,) * 3, (None, None)),
                            out_axes=("batch", None, None), sizes={"batch": x.shape[0]})
