"""Runs the Mosaic GPU matmul with a fused epilogue (`ltm_pallas.matmul_mgpu`) in Mosaic GPU interpret mode on the
CPU and saves its inputs and outputs for tests/ops/test_matmul_mgpu.py to check against float64 references.

Needs jax >= 0.11 (Mosaic GPU interpret mode): run by .venv-aot's Python, `python matmul_mgpu_worker.py OUT.npz`.
`python matmul_mgpu_worker.py --compiled OUT.npz` on a Hopper GPU runs the same cases compiled on it instead; the test
file checks such a file in place of its own run with MATMUL_MGPU_RESULTS=OUT.npz.
Cases (name -> M, K, N; a [M, K], b [K, G, N] and the extras bfloat16, drawn from N(0, 1) with b scaled by 1/sqrt(K)):
  relu2_forward:   G = 1, M 256 K 384 N 256: outputs z = bf16(a @ b) and relu(z)^2, both [M, 1, N] bfloat16
                   (2 x 2 tiles of [128, 128], 6 pipeline steps through 4 slots)
  relu2_backward:  G = 1, M 256 K 256 N 256, extras (pre [M, 1, N]): a @ b * 2 relu(pre), [M, 1, N] float32 (2 x 2
                   tiles, 4 steps through 3 slots: the float32 output tile leaves room for 3)
  swiglu_forward:  G = 2, M 256 K 384 N 128: gate_up = (bf16(a @ b_0), bf16(a @ b_1)) [M, 2, N] and silu(g) u of the
                   rounded g, u [M, 1, N], both bfloat16 (2 x 2 tiles of [128, 64], 6 steps through 4 slots)
  swiglu_backward: G = 1, M 256 K 320 N 128, extras (gate_up [M, 2, N]): dh = a @ b, [M, 2, N] bfloat16 of
                   (dh u silu'(g), dh silu(g)) (BN = 64 here, the extras' and outputs' tiles leaving 2 pipeline slots
                   at BN = 128: 2 x 2 tiles, 5 steps through 4 slots)
Every case runs in both forms of the kernel (`matmul_mgpu.FORMS`): "pipelined" under its name, "warp_specialized"
under its name + "_ws" (the same tiles, each split over two consumer warpgroups of [64, BN]).
The epilogues are ltm_jax.ops.ffn's (`forward_epilogue`, `backward_epilogue`). Op cases, through
ops.ffn's pallas_mgpu backend (the kernel forward with the relu^2 or SwiGLU epilogue, XLA's output matmul, then the
kernel backward and XLA's weight and input gradients), all bfloat16, saving y, dx, dW_in and dW_out:
  op_relu2:   x [1, 256, 128], W_in [128, 1, 256], W_out [256, 128]
  op_swiglu:  x [1, 128, 192], W_in [192, 2, 128], W_out [128, 192]
With `--model` (`python matmul_mgpu_worker.py --model OUT.npz`) it runs only a two-block model's loss and gradients
with model.ffn_impl=xla, =pallas_mgpu and in float32 (`run_model`), for the long test of test_matmul_mgpu.py.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.ops import ffn as ffn_op
from ltm_pallas import matmul_mgpu


# The epilogues ltm_jax.ops.ffn gives the kernel: what the feed-forward op runs is what is checked here.
relu2_forward, swiglu_forward = (ffn_op.forward_epilogue(a, jnp.bfloat16) for a in ("relu2", "swiglu"))
relu2_backward, swiglu_backward = (ffn_op.backward_epilogue(a) for a in ("relu2", "swiglu"))


# name -> (epilogue, the extras' group counts, out_dtypes).
EPILOGUES = {
    "relu2_forward": (relu2_forward, (), (("bfloat16", 1), ("bfloat16", 1))),
    "relu2_backward": (relu2_backward, (1,), (("float32", 1),)),
    "swiglu_forward": (swiglu_forward, (), (("bfloat16", 2), ("bfloat16", 1))),
    "swiglu_backward": (swiglu_backward, (2,), (("bfloat16", 2),)),
}
CASES = {  # name -> (M, K, N, G)
    "relu2_forward": (256, 384, 256, 1),
    "relu2_backward": (256, 256, 256, 1),
    "swiglu_forward": (256, 384, 128, 2),
    "swiglu_backward": (256, 320, 128, 1),
}


FORM_SUFFIX = {"pipelined": "", "warp_specialized": "_ws"}  # form -> the suffix of its cases' names.


def run(name: str, seed: int, interpret: bool, form: str = "pipelined"):
  """(inputs, outputs) of case `name` as float32 numpy arrays: a, b, the extras; the outputs."""
  epilogue, extra_counts, out_dtypes = EPILOGUES[name]
  m, k, n, groups = CASES[name]
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  b = jnp.asarray(rng.normal(size=(k, groups, n)) / np.sqrt(k), jnp.bfloat16)
  extras = [jnp.asarray(rng.normal(size=(m, e, n)), jnp.bfloat16) for e in extra_counts]
  fn = jax.jit(lambda a, b, *x: matmul_mgpu.matmul_epilogue(a, b, x, epilogue=epilogue, out_dtypes=out_dtypes,
                                                            interpret=interpret, form=form))
  outs = fn(a, b, *extras)
  assert [str(o.dtype) for o in outs] == [d for d, _ in out_dtypes], name
  return [np.asarray(x, np.float32) for x in (a, b, *extras)], [np.asarray(o, np.float32) for o in outs]


OP_CASES = {  # name -> (activation, tokens T, d, n): x [1, T, d], W_in [d, G, n], W_out [n, d], dy [1, T, d].
    "op_relu2": ("relu2", 256, 128, 256),
    "op_swiglu": ("swiglu", 128, 192, 128),
}


def run_op(name: str, seed: int, interpret: bool, form: str = "pipelined"):
  """(inputs, outputs) of the op case `name` through ops.ffn(impl="pallas_mgpu"): inputs x, W_in, W_out, dy; outputs
  y and the gradients of x, W_in and W_out."""
  activation, length, d, n = OP_CASES[name]
  rng = np.random.default_rng(seed)
  groups = ffn_op.ACTIVATIONS[activation]
  x = jnp.asarray(rng.normal(size=(1, length, d)), jnp.bfloat16)
  w_in = jnp.asarray(rng.normal(size=(d, groups, n)) / np.sqrt(d), jnp.bfloat16)
  w_out = jnp.asarray(rng.normal(size=(n, d)) / np.sqrt(n), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(size=(1, length, d)), jnp.bfloat16)
  fused = functools.partial(ffn_op.pallas_mgpu, activation=activation, interpret=interpret, form=form)
  assert ffn_op.pallas_mgpu is not ffn_op.xla and matmul_mgpu.supported(length, d, n, groups, form)

  def forward_backward(x, w_in, w_out, dy):
    y, pull = jax.vjp(lambda *p: fused(p[0][0], *p[1:])[None], x, w_in, w_out)
    return (y, *pull(dy))

  y, dx, dw_in, dw_out = jax.jit(forward_backward)(x, w_in, w_out, dy)
  outs = (y[0], dx[0], dw_in, dw_out)
  assert all(o.dtype == jnp.bfloat16 for o in outs), name
  return [np.asarray(t, np.float32) for t in (x[0], w_in, w_out, dy[0])], [np.asarray(o, np.float32) for o in outs]


# A two-block model of configs/small_rwkv7.py's kind (bfloat16 compute and residual stream): an RWKV-7 block with its
# relu^2 channel mix and an attention block with SwiGLU, d_model 128, hidden 256, 2 x 128 tokens.
MODEL_OVERRIDES = ("model.d_model=128", "model.n_layers=2", "model.layer_pattern=WA", "model.n_heads=2",
                   "model.window=64", "model.mlp_dim=256", "model.max_seq_len=128", "train.seq_len=128")


def run_model():
  """(loss, gradients) of the model on random tokens with model.ffn_impl=xla, with =pallas_mgpu, and in float32
  throughout (the XLA form): model/loss_<run> and model/grad_<run>/<parameter path>, float32. The kernels follow
  `backend.mosaic_gpu_call`'s default: interpreted here, compiled on a GPU host."""
  from ltm_jax import model as model_lib  # pylint: disable=g-import-not-at-top
  from ltm_jax.config import load_config  # pylint: disable=g-import-not-at-top
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 129), 0, 256)
  results, params = {}, None
  for impl in ("xla", "pallas_mgpu", "float32"):
    extra = ["model.dtype=float32", "model.residual_dtype=float32"] if impl == "float32" else [f"model.ffn_impl={impl}"]
    cfg = load_config("configs/small_rwkv7.py", [*MODEL_OVERRIDES, *extra])
    lm = model_lib.LM(cfg.model, cfg.latent)
    if params is None:  # Noise on every parameter: RWKV-7's zero-initialised projections would zero the FFN's gradients.
      params = lm.init(jax.random.PRNGKey(1), tokens[:, :-1])
      leaves, tree = jax.tree.flatten(params)
      keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
      params = jax.tree.unflatten(tree, [p + 0.05 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)])

    def loss(p, lm=lm):
      logits = lm.apply(p, tokens[:, :-1])[0].astype(jnp.float32)  # (logits, state)
      picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    results[f"model/loss_{impl}"] = np.asarray(value, np.float32)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      results[f"model/grad_{impl}/{jax.tree_util.keystr(path)}"] = np.asarray(g, np.float32)
  return results


def main(path: str, compiled: bool = False) -> None:
  saved = {"device": np.array(str(jax.devices()[0].device_kind))}
  started = time.time()
  for form, suffix in FORM_SUFFIX.items():
    for seed, name in enumerate([*CASES, *OP_CASES]):
      inputs, outs = (run_op if name in OP_CASES else run)(name, seed, interpret=not compiled, form=form)
      saved.update({f"{name}{suffix}/in{i}": x for i, x in enumerate(inputs)})
      saved.update({f"{name}{suffix}/out{i}": x for i, x in enumerate(outs)})
      print(name + suffix, f"{time.time() - started:.1f} s", file=sys.stderr)
  np.savez(path, **saved)
  print("ok")


if __name__ == "__main__":
  if "--model" in sys.argv[1:-1]:
    np.savez(sys.argv[-1], **run_model())
    print("ok")
  else:
    main(sys.argv[-1], compiled="--compiled" in sys.argv[1:-1])
