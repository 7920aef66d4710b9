#!/usr/bin/env python3
"""The norm + token-shift mixes op's backward (ltm_jax.ops.norm_mix) timed at the RWKV-7 configs' shapes: XLA's
derivative against the Pallas kernel at several launch settings, each one's gradients compared with XLA's.

    python benchmarks/norm_mix.py                  # GPU: small_rwkv7's and base_125m_rwkv7's time and channel mixes
    python benchmarks/norm_mix.py --shapes tiny    # any machine: toy shapes (the kernel interpreted off a GPU)

Rows: one per shape and form; "xla" is the op's XLA backend, "pallas" the kernel at its default settings,
"pallas:<key>=<value>,..." the kernel at other launch settings (ltm_pallas.norm_mix.backward: max_steps,
chunk_columns, num_warps). The forward is the same XLA code in every form, so the backward's time is what differs.

Columns: ms forward, ms forward + backward (medians), the backward's bytes at the kernel's minimum (the stream, the
residual's gradient, xn's gradient if read, the mixes' gradients, and dx: the step budget's price for it) over that
time as GB/s, and the largest difference of any gradient from XLA's relative to its largest magnitude (bfloat16
roundings apart: ~1e-2 is agreement). Writes benchmarks/results/norm-mix-<device>.json (norm-mix-quick-<device>.json
with --shapes tiny).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import common
from ltm_jax.ops import norm_mix as op

# name -> (B, T, C, mixes, whether xn's gradient is read): the configs' time mix (r, k, v mixes; its LoRAs read xn)
# and channel mix (one mix; only the last row of xn is carried).
SHAPES = {
    "gpu": {
        "small_rwkv7 time mix": (32, 1024, 512, 3, True),
        "small_rwkv7 channel mix": (32, 1024, 512, 1, False),
        "base_125m_rwkv7 time mix": (64, 2048, 768, 3, True),
        "base_125m_rwkv7 channel mix": (64, 2048, 768, 1, False),
    },
    "tiny": {"toy time mix": (2, 64, 128, 3, True), "toy channel mix": (2, 64, 128, 1, False)},
}
# The kernel's launch settings timed besides its default: more programs in flight (fewer steps each, fewer warps),
# wider column chunks.
SETTINGS = ("max_steps=2", "max_steps=1,num_warps=4", "num_warps=4", "chunk_columns=256", "max_steps=2,num_warps=4")


def _inputs(b, t, c, mixes, with_dxn):
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  x = jax.random.normal(keys[0], (b, t, c), jnp.bfloat16) * 2 + 0.5
  last = jax.random.normal(keys[1], (b, c), jnp.bfloat16)
  scale, bias = 1 + 0.1 * jax.random.normal(keys[2], (2, c))
  shifts = jax.random.uniform(keys[3], (mixes, c))
  dxn = jax.random.normal(keys[4], (b, t, c), jnp.bfloat16) if with_dxn else jnp.zeros((b, c), jnp.bfloat16)
  dms = tuple(jax.random.normal(k, (b, t, c), jnp.bfloat16) for k in jax.random.split(keys[5], mixes))
  return (x, last, scale, bias, shifts), (jax.random.normal(keys[6], (b, t, c), jnp.bfloat16), dxn, dms)


def _forward(form: str, with_dxn: bool):
  """The op (layernorm, bfloat16 xn) with the form's backward: "xla", "pallas" or "pallas:<settings>"."""
  static = dict(kind="layernorm", eps=1e-5, dtype=jnp.bfloat16, xn_rows="all" if with_dxn else "last")
  if form == "xla":
    return functools.partial(op.xla, **static)
  settings = {k: int(v) for k, v in (kv.split("=") for kv in form.partition(":")[2].split(",") if kv)}
  return op.with_backward(functools.partial(op.pallas_backward, **settings), **static)


def _gap(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", choices=tuple(SHAPES), default="gpu")
  parser.add_argument("--settings", nargs="*", default=list(SETTINGS), metavar="KEY=VALUE,...",
                      help="the kernel's launch settings to time besides its default")
  args = parser.parse_args(argv)
  forms = ["xla", "pallas"] + [f"pallas:{s}" for s in args.settings]
  rows = []
  for name, (b, t, c, mixes, with_dxn) in SHAPES[args.shapes].items():
    primals, cotangents = _inputs(b, t, c, mixes, with_dxn)
    element_bytes = 2 * (2 + with_dxn + mixes + 1)  # x, dres, [dxn], dm_j read; dx written; bfloat16.
    grads = {}
    for form in forms:
      row = {"shape": name, "form": form, "B": b, "T": t, "C": c, "mixes": mixes}
      try:
        forward = _forward(form, with_dxn)
        timing, _ = common.time_forward_backward(forward, primals, cotangents)
        _, pull = jax.vjp(forward, *primals)
        grads[form] = pull(cotangents)
      except Exception as e:  # noqa: BLE001  (one setting that does not compile must not cost the others' rows)
        row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        rows.append(row)
        print(row, flush=True)
        continue
      backward_ms = timing["fwd_bwd_ms"] - timing["fwd_ms"]
      row.update(fwd_ms=timing["fwd_ms"], fwd_bwd_ms=timing["fwd_bwd_ms"], bwd_ms=backward_ms,
                 bwd_min_gbps=element_bytes * b * t * c / backward_ms / 1e6 if backward_ms > 0 else None,
                 max_rel_diff_vs_xla=max(_gap(g, r) for g, r in zip(grads[form], grads["xla"])))
      rows.append(row)
      print({k: v for k, v in row.items() if k not in ("B", "T", "C")}, flush=True)
  common.print_table(rows, ["shape", "form", "fwd_ms", "fwd_bwd_ms", "bwd_ms", "bwd_min_gbps", "max_rel_diff_vs_xla"]
                     + (["error"] if any("error" in row for row in rows) else []))
  path = common.write_results("norm-mix-quick" if args.shapes == "tiny" else "norm-mix", rows, shapes=args.shapes,
                              forms=forms)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
