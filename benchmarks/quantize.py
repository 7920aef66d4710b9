"""Quantisation-aware training against post-training quantisation: validation bits/byte of a small byte-level LM.

  python benchmarks/quantize.py           # RWKV-4 + attention, d_model 64, 2 layers: about 10 minutes on 2 cores
  python benchmarks/quantize.py --quick   # tiny sizes: proves the script end to end

A float model is trained for `steps` steps on the embedded corpus (AdamW, warmup then cosine, as `ltm train` does),
then trained on for `tune` more steps three ways from the same state and the same batches:
  float     on as before (the control: what the extra steps alone give);
  qat int8  the loss sees `fake_quantize_params(params, axes, "int8")`: weights rounded to int8 per output channel,
            gradients straight through the rounding to the float weights;
  qat int4  the same with int4 in groups of `group`.
Each row is then evaluated on the same validation windows with float weights and with its weights quantised after
training (`quantize_params` + `dequantize_params`): PTQ of the float control, and the quantised QAT model. bits/byte
= mean next-token cross-entropy / ln 2 (the byte tokenizer: one token per byte).

Writes benchmarks/results/quantize-<device>.json (quantize-quick-<device>.json with --quick).
"""

from __future__ import annotations

import argparse
import math
import time

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ltm_jax import data as data_lib
from ltm_jax import model as model_lib
from ltm_jax.config import Config, DataConfig, ModelConfig, TrainConfig
from ltm_jax.inference.quantize import dequantize_params, fake_quantize_params, quantize_params
from ltm_jax.train.optimizer import make_optimizer

PLANS = {
    "cpu": dict(model=dict(d_model=64, n_layers=2, n_heads=2, layer_pattern="RA", max_seq_len=256), steps=500,
                tune=150, batch=16, seq_len=128, lr=4e-3, eval_batches=16, group=32),
    "quick": dict(model=dict(d_model=32, n_layers=2, n_heads=2, layer_pattern="RA", max_seq_len=64), steps=30,
                  tune=10, batch=8, seq_len=32, lr=4e-3, eval_batches=2, group=16),
}
VARIANTS = (("float", None), ("qat int8", "int8"), ("qat int4", "int4"))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  plan = PLANS["quick" if args.quick else "cpu"]
  began = time.perf_counter()
  total = plan["steps"] + plan["tune"]
  cfg = Config(name="quantize", model=ModelConfig(**plan["model"]), data=DataConfig(source="embedded"),
               train=TrainConfig(steps=total, batch_size=plan["batch"], seq_len=plan["seq_len"], lr=plan["lr"],
                                 warmup_steps=max(1, total // 10)))
  m, t = cfg.model, cfg.train
  model = model_lib.LM(m, cfg.latent)
  axes = model_lib.param_axes(m, cfg.latent)
  splits = data_lib.load_splits(cfg.data, m.vocab_size, t.seq_len)
  loader = iter(data_lib.TrainLoader(splits.train, t.batch_size, t.seq_len, seed=0, worker_threads=1, prefetch=2))
  val = data_lib.eval_batches(splits.val, t.batch_size, t.seq_len, plan["eval_batches"])
  optimizer = make_optimizer(t)

  def nll(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])[0]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"]))

  def make_step(kind):
    view = (lambda p: p) if kind is None else (lambda p: fake_quantize_params(p, axes, kind, plan["group"]))

    @jax.jit
    def step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(lambda p: nll(view(p), batch))(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    return step

  evaluate = jax.jit(nll)

  def bits_per_byte(params) -> float:
    return float(np.mean([float(evaluate(params, b)) for b in val])) / math.log(2)

  params = jax.jit(model_lib.init_params, static_argnums=(0, 2))(m, jax.random.key(0), cfg.latent)
  opt_state = optimizer.init(params)
  float_step = make_step(None)
  batches = [next(loader) for _ in range(total)]
  for i in range(plan["steps"]):
    params, opt_state, loss = float_step(params, opt_state, batches[i])
  print(f"float: {plan['steps']} steps, last loss {float(loss):.3f} ({time.perf_counter() - began:.0f} s)")

  rows = []
  for name, kind in VARIANTS:
    p, s = params, opt_state
    step = make_step(kind)
    for i in range(plan["steps"], total):
      p, s, loss = step(p, s, batches[i])
    row = {"variant": name, "steps": total, "float_bpb": bits_per_byte(p)}
    for q in ("int8", "int4"):
      row[f"{q}_bpb"] = bits_per_byte(dequantize_params(quantize_params(p, axes, q, plan["group"])))
    rows.append(row)
    print(f"{name}: done ({time.perf_counter() - began:.0f} s)")
  common.print_table(rows, ("variant", "steps", "float_bpb", "int8_bpb", "int4_bpb"))
  path = common.write_results(
      "quantize" + ("-quick" if args.quick else ""), rows, plan=plan, seconds=time.perf_counter() - began,
      note=(f"float trained {plan['steps']} steps, then each variant {plan['tune']} more from the same state on the "
            f"same batches; *_bpb = validation bits/byte with float weights, and with weights quantised after "
            f"training (int8 per output channel; int4 in groups of {plan['group']})"))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
