"""Titans neural memory against the other mixers: language modelling at equal parameters and tokens, and a recall
probe beyond the attention window.

  python benchmarks/titans.py                      # both sections (well over an hour on 2 CPU cores)
  python benchmarks/titans.py --section probe      # one section
  python benchmarks/titans.py --steps 30 --probe-steps 30 --name titans-quick   # the whole script in minutes

corpus  configs/tiny.py's decoder (d_model 128, 4 layers, byte-level, batch 32 x 128) with each mixer pattern,
        trained by `ltm_jax.train` on the same embedded-corpus batches for `--steps` steps (runs/titans/<name>,
        resumed if present), scored by the run's last evaluation (val bits/byte over the same 16 validation
        batches); train seconds are the logged step times (evaluations and compilation excluded).
        configs/tiny_titans.py trims the SwiGLU width of its `MA` pattern to match the others' size.
probe   associative recall: each 97-byte row starts with `--pairs` pairs "k=vv " (distinct letters, 2-letter values),
        then random letters, and ends with one of the keys again and "=" followed by its value. A 2-layer d_model 64
        model (attention windows of 16 bytes: a plain windowed decoder sees 31 bytes back, so the pairs are out of
        its reach) is trained for `--probe-steps` Adam steps on the cross-entropy of the two value bytes only, then
        scored on 2,048 fresh rows: the share of value bytes predicted exactly (chance: 1/26).

Other jobs may share the machine, so read train seconds as ratios. Writes benchmarks/results/<name>-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.train import train
from ltm_jax.train.metrics import read_metrics

TINY, TINY_TITANS = "configs/tiny.py", "configs/tiny_titans.py"
CORPUS = {  # name -> (config, overrides)
    "attention": (TINY, ["model.layer_pattern=A"]),
    "attention_window32": (TINY, ["model.layer_pattern=A", "model.window=32"]),
    "rwkv4": (TINY, ["model.layer_pattern=R"]),
    "rwkv7": (TINY, ["model.layer_pattern=W", "model.rwkv7_head_size=32"]),
    "titans_mal": (TINY_TITANS, []),
    "mmrec": ("configs/tiny_mmrec.py", []),
}
PROBE = {  # name -> model overrides of the probe's decoder
    "attention_window16": dict(layer_pattern="A"),
    "rwkv7": dict(layer_pattern="W", rwkv7_head_size=16),
    "titans_mal": dict(layer_pattern="MA"),
    "titans_mag": dict(layer_pattern="GA"),
    # Exact online gradient descent with a larger rate: per token up to (1 - eta) x 1 instead of (1 - eta) x 0.5 / 8.
    "titans_mal_chunk1": dict(layer_pattern="MA", memory_chunk=1, memory_max_lr=1.0),
}
PROBE_LEN, PROBE_WINDOW = 96, 16
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)


def corpus_row(name: str, steps: int, root: pathlib.Path) -> dict:
  path, overrides = CORPUS[name]
  cfg = config_lib.load_config(path, overrides + [f"train.steps={steps}", f"train.eval_every={steps}",
                                                  f"train.checkpoint_every={steps}"])
  train(cfg, root / name, progress=False)  # A finished run only returns.
  rows = read_metrics(root / name)
  # Seconds in train steps (the logged per-step time over each logging interval), so a resumed run counts the same.
  steps = [row for row in rows if "step_seconds" in row]
  seconds = sum(row["step_seconds"] * (row["step"] - previous["step"]) for previous, row in zip([{"step": 0}] + steps,
                                                                                             steps))
  params = jax.eval_shape(lambda: model_lib.init_params(cfg.model, jax.random.key(0)))
  return dict(section="corpus", model=name, pattern=cfg.model.layer_pattern, window=cfg.model.window,
              params=int(sum(x.size for x in jax.tree.leaves(params))), steps=rows[-1]["step"],
              tokens=rows[-1]["step"] * cfg.train.batch_size * cfg.train.seq_len, train_seconds=round(seconds),
              val_bpb=[row for row in rows if "val_bpb" in row][-1]["val_bpb"])


def recall_rows(rng: np.random.Generator, batch: int, pairs: int) -> tuple[np.ndarray, int]:
  """(tokens [B, PROBE_LEN + 1] bytes, the index of the first value byte to predict). Layout: "k=vv " x pairs,
  random letters, then "k=vv" for one of the pairs (the last two bytes are the answer)."""
  rows = rng.choice(LETTERS, size=(batch, PROBE_LEN + 1))
  for b in range(batch):
    keys = rng.choice(LETTERS, pairs, replace=False)
    values = rng.choice(LETTERS, (pairs, 2))
    for i in range(pairs):
      rows[b, 5 * i:5 * i + 5] = [keys[i], ord("="), values[i, 0], values[i, 1], ord(" ")]
    asked = rng.integers(pairs)
    rows[b, -4:] = [keys[asked], ord("="), values[asked, 0], values[asked, 1]]
  return rows.astype(np.int32), PROBE_LEN - 1  # Rows hold PROBE_LEN + 1 bytes; the value is the last two.


def probe_row(name: str, steps: int, pairs: int, seed: int = 0) -> dict:
  cfg = config_lib.validate(dataclasses.replace(config_lib.Config(), model=config_lib.ModelConfig(
      d_model=64, n_layers=2, n_heads=4, window=PROBE_WINDOW, max_seq_len=PROBE_LEN, mlp_dim=128,
      **{"memory_chunk": 8, **PROBE[name]}), train=config_lib.TrainConfig(seq_len=PROBE_LEN)))
  model = model_lib.LM(cfg.model)
  params = model_lib.init_params(cfg.model, jax.random.key(seed))
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, 50, steps), weight_decay=0.01)
  opt_state = optimizer.init(params)
  rng = np.random.default_rng(seed)

  def answer_logits(params, tokens, first):
    logits, _ = model.apply({"params": params}, tokens[:, :-1])
    return logits[:, first - 1:first + 1], tokens[:, first:first + 2]  # The two value bytes, each from before it.

  @jax.jit
  def step(params, opt_state, tokens):
    def loss(params):
      logits, targets = answer_logits(params, tokens, first)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  start = time.time()
  for _ in range(steps):
    tokens, first = recall_rows(rng, 32, pairs)
    params, opt_state, loss = step(params, opt_state, tokens)
  seconds = time.time() - start
  score = jax.jit(lambda p, t: jnp.mean(jnp.argmax(answer_logits(p, t, first)[0], -1) == t[:, first:first + 2]))
  accuracy = float(np.mean([score(params, recall_rows(np.random.default_rng(10_000 + i), 256, pairs)[0])
                            for i in range(8)]))
  return dict(section="probe", model=name, pattern=cfg.model.layer_pattern, window=PROBE_WINDOW, pairs=pairs,
              steps=steps,
              final_loss=float(loss), train_seconds=round(seconds), recall_accuracy=accuracy)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--section", choices=("corpus", "probe", "all"), default="all")
  parser.add_argument("--steps", type=int, default=450)
  parser.add_argument("--probe-steps", type=int, default=1500)
  parser.add_argument("--pairs", type=int, default=1, help="key-value pairs at the start of each probe row")
  parser.add_argument("--only", nargs="*", help="model names to run (default: all of the section)")
  parser.add_argument("--name", default="titans")
  parser.add_argument("--runs", default="runs/titans")
  args = parser.parse_args()
  rows = []
  if args.section in ("corpus", "all"):
    for name in CORPUS:
      if not args.only or name in args.only:
        rows.append(corpus_row(name, args.steps, pathlib.Path(args.runs)))
        print(json.dumps(rows[-1]), flush=True)
  if args.section in ("probe", "all"):
    for name in PROBE:
      if not args.only or name in args.only:
        rows.append(probe_row(name, args.probe_steps, args.pairs))
        print(json.dumps(rows[-1]), flush=True)
  tables = {"corpus": ("model", "pattern", "window", "params", "tokens", "train_seconds", "val_bpb"),
            "probe": ("model", "pattern", "pairs", "steps", "train_seconds", "final_loss", "recall_accuracy")}
  for section, columns in tables.items():
    if any(row["section"] == section for row in rows):
      common.print_table([row for row in rows if row["section"] == section], columns)
  print(common.write_results(args.name, rows, **{k: v for k, v in vars(args).items() if k != "name"}))


if __name__ == "__main__":
  main()
