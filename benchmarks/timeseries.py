"""The time-series model's forward pass at the optimized-RWKV guide's shape, for every WKV backend, beside a
PyTorch reference of the same RWKV-4 encoder.

  python benchmarks/timeseries.py            # 8 series x 3750 steps x 1 input, 6 layers of width 256 (minutes on CPU)
  python benchmarks/timeseries.py --quick    # 2 x 256, 2 layers of width 32: proves it runs

Two models of that shape: RWKV-4 time-mix layers (`layer_pattern="R"`, channel-mix FFN 4x) and RWKV-7 (`"W"`, heads
of 64, channel-mix FFN 4x), both with the spectrum branch and a 2-class head, float32, one jitted forward per
backend (model.wkv_impl for R: scan, associative, pallas; model.wkv7_impl for W: scan, chunked, pallas). On a CPU the
Pallas kernels only run in interpret mode, which is far too slow at 3750 steps: they are skipped there (listed
with the reason) and run on a GPU.

Columns: forward ms (median), series/s and steps/s (series x 3750 per second), XLA's compiled memory (temporaries,
and everything live: arguments + outputs + temporaries), and the largest difference from the reference backend
(scan) of the same pattern, on the outputs (logits) and on the mean-pooled time features [B, 256], relative to the
largest reference value. The PyTorch peer (CPU, float32, torch's own threads) runs the R model with the same
weights: its time-mix loop is a TorchScript function over the steps, the official RWKV-4 CPU form; its difference
is taken against the JAX scan backend. Writes benchmarks/results/timeseries-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses

import common  # First: puts the checkout on sys.path.
import jax
import jax.numpy as jnp
import numpy as np

from ltm_jax.config import ModelConfig, TimeSeriesConfig
from ltm_jax.timeseries import model as ts_model

SHAPES = {"guide": dict(batch=8, length=3750, layers=6, width=256),
          "quick": dict(batch=2, length=256, layers=2, width=32)}
BACKENDS = {"R": ("wkv_impl", ("scan", "associative", "pallas")),
            "W": ("wkv7_impl", ("scan", "chunked", "pallas"))}
OUTPUTS = 2
COLUMNS = ("pattern", "impl", "fwd_ms", "series_per_s", "steps_per_s", "temp_mib", "total_mib", "max_diff_out",
           "max_diff_pooled", "speedup_vs_torch", "compile_s")


def configs(shape: dict, pattern: str) -> tuple[ModelConfig, TimeSeriesConfig]:
  model = ModelConfig(d_model=shape["width"], n_layers=shape["layers"], n_heads=max(1, shape["width"] // 64),
                      layer_pattern=pattern, rwkv7_head_size=min(64, shape["width"]), ln0=True)
  return model, TimeSeriesConfig(enabled=True, spectrum_bins=32, spectrum_max_period=4096.0)


def _trained_like(params, key):
  """Freshly initialised RWKV-7 output projections are zero; small noise on every weight makes each layer count."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(tree, [p + 0.02 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])


def forward_fn(model_cfg, ts):
  model = ts_model.TimeSeriesModel(model_cfg, ts, OUTPUTS)

  def forward(params, series):
    outputs, state = model.apply({"params": params}, series)
    return outputs, state.pool_sum / state.patches[:, None]
  return forward


def bench_jax(model_cfg, ts, params, series):
  compiled, compile_s = common.compile_fn(forward_fn(model_cfg, ts), params, series)
  memory = compiled.memory_analysis()
  timing = common.time_fn(compiled, params, series, warmup=1, min_runs=3, max_runs=5, budget_s=0.0)
  outputs, pooled = compiled(params, series)
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
           + memory.temp_size_in_bytes)
  return {"fwd_ms": timing["median_ms"], "fwd": timing, "compile_s": compile_s,
          "temp_mib": memory.temp_size_in_bytes / 2**20, "total_mib": total / 2**20}, (outputs, pooled)


# ---------------------------------------------------------------------------------------------- PyTorch reference


def torch_rwkv4_forward(params, series, model_cfg, ts):
  """The R model in PyTorch (float32, no autograd) from the JAX parameters: series [B, T, F] numpy -> (outputs,
  pooled) numpy. Written from the layer definitions (ltm_jax/layers/rwkv4.py, the Flax norms and the spectrum
  branch), sharing no code with them."""
  import torch

  t = lambda a: torch.from_numpy(np.array(a, np.float32))  # A copy: torch wants writable memory.
  eps = model_cfg.norm_eps

  def rms(x, p):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * t(p["scale"])

  def shifted(x):
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)

  def mix(x, prev, m):
    m = t(m)
    return x * m + prev * (1 - m)

  x = t(series) @ t(params["embed"]["kernel"]) + t(params["embed"]["bias"])
  x = rms(x, params["embed_norm"])
  for i in range(model_cfg.n_layers):
    p = params[f"block_{i}"]
    h = rms(x, p["mixer_norm"])
    tm, prev = p["mixer"], shifted(h)
    k = mix(h, prev, tm["mix_k"]) @ t(tm["key"]["kernel"])
    v = mix(h, prev, tm["mix_v"]) @ t(tm["value"]["kernel"])
    r = mix(h, prev, tm["mix_r"]) @ t(tm["receptance"]["kernel"])
    wkv = _torch_wkv4()(-torch.exp(t(tm["time_decay"])), t(tm["time_first"]), k.contiguous(), v.contiguous())
    x = x + (torch.sigmoid(r) * wkv) @ t(tm["output"]["kernel"])
    h = rms(x, p["ffn_norm"])
    cm, prev = p["ffn"], shifted(h)
    hidden = torch.relu(mix(h, prev, cm["mix_k"]) @ t(cm["key"]["kernel"])).square()
    gate = torch.sigmoid(mix(h, prev, cm["mix_r"]) @ t(cm["receptance"]["kernel"]))
    x = x + gate * (hidden @ t(cm["value"]["kernel"]))
  pooled = rms(x, params["final_norm"]).mean(dim=1)

  length = series.shape[1]
  freqs = torch.from_numpy(ts_model.frequencies(ts)).double()
  steps = torch.arange(length, dtype=torch.float64)
  angle = 2 * np.pi * steps[:, None] * freqs[None, :]  # [T, K], in float64: no phase reduction needed.
  xs = torch.from_numpy(np.asarray(series, np.float64))
  re = torch.einsum("tk,btf->bkf", torch.cos(angle), xs)
  im = -torch.einsum("tk,btf->bkf", torch.sin(angle), xs)
  magnitude = (torch.sqrt(re**2 + im**2) / length).float()
  feats = torch.log(magnitude + ts_model.SPECTRUM_FLOOR).reshape(series.shape[0], -1)
  sp = params["spectrum"]
  feats = torch.nn.functional.layer_norm(feats, feats.shape[-1:], t(sp["norm"]["scale"]), t(sp["norm"]["bias"]),
                                         eps=1e-6)
  spectrum = torch.nn.functional.gelu(feats @ t(sp["dense"]["kernel"]) + t(sp["dense"]["bias"]), approximate="tanh")
  fused = torch.cat([pooled, spectrum], dim=-1)
  hidden = torch.nn.functional.gelu(fused @ t(params["head_hidden"]["kernel"]) + t(params["head_hidden"]["bias"]),
                                    approximate="tanh")
  outputs = hidden @ t(params["head"]["kernel"]) + t(params["head"]["bias"])
  return outputs.numpy(), pooled.numpy()


_WKV4 = None


def _torch_wkv4():
  """WKV-4 over [B, T, C] with the running-max form of the official CPU/CUDA code, compiled by TorchScript."""
  global _WKV4
  if _WKV4 is None:
    import torch

    @torch.jit.script
    def wkv4(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
      batch, length, channels = k.shape
      num = torch.zeros(batch, channels)
      den = torch.zeros(batch, channels)
      big = torch.full((batch, channels), -1e38)
      out = torch.empty_like(v)
      for i in range(length):
        kt, vt = k[:, i], v[:, i]
        q = torch.maximum(big, u + kt)
        e1, e2 = torch.exp(big - q), torch.exp(u + kt - q)
        out[:, i] = (e1 * num + e2 * vt) / (e1 * den + e2)
        q = torch.maximum(big + w, kt)
        e1, e2 = torch.exp(big + w - q), torch.exp(kt - q)
        num, den, big = e1 * num + e2 * vt, e1 * den + e2, q
      return out
    _WKV4 = wkv4
  return _WKV4


def bench_torch(params, series, model_cfg, ts):
  import time

  import torch
  host = jax.tree.map(np.asarray, params)
  series = np.asarray(series)
  with torch.no_grad():
    torch_rwkv4_forward(host, series[:, :8], model_cfg, ts)  # Warm-up: TorchScript compiles on first calls.
    times, out = [], None
    for _ in range(3):
      start = time.perf_counter()
      out = torch_rwkv4_forward(host, series, model_cfg, ts)
      times.append((time.perf_counter() - start) * 1e3)
  return {"fwd_ms": float(np.median(times)), "fwd": {"runs_ms": times}, "torch": torch.__version__,
          "torch_threads": torch.get_num_threads()}, out


def _max_diff(got, reference):
  got, reference = (np.asarray(a, np.float64) for a in (got, reference))
  return float(np.abs(got - reference).max() / np.abs(reference).max())


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a small shape: seconds, every backend")
  args = parser.parse_args()
  shape = SHAPES["quick" if args.quick else "guide"]
  on_cpu = jax.default_backend() == "cpu"
  series = jax.random.normal(jax.random.key(0), (shape["batch"], shape["length"], 1))
  steps = shape["batch"] * shape["length"]
  rows = []
  for pattern in BACKENDS:
    field, impls = BACKENDS[pattern]
    model_cfg, ts = configs(shape, pattern)
    params = jax.jit(lambda key: _trained_like(
        ts_model.init_params(model_cfg, ts, OUTPUTS, 1, key), jax.random.key(1)))(jax.random.key(0))
    reference = None
    for impl in impls:
      row = {"pattern": pattern, "impl": impl, "shape": shape}
      if impl == "pallas" and on_cpu and not args.quick:
        row["skipped"] = "Pallas runs only in interpret mode on CPU: far too slow at this shape"
        rows.append(row)
        print(f"{pattern} {impl}: skipped ({row['skipped']})")
        continue
      timing, outs = bench_jax(dataclasses.replace(model_cfg, **{field: impl}), ts, params, series)
      reference = outs if reference is None else reference
      row.update(timing, series_per_s=shape["batch"] / timing["fwd_ms"] * 1e3,
                 steps_per_s=steps / timing["fwd_ms"] * 1e3, max_diff_out=_max_diff(outs[0], reference[0]),
                 max_diff_pooled=_max_diff(outs[1], reference[1]))
      rows.append(row)
      print(f"{pattern} {impl}: {timing['fwd_ms']:.0f} ms", flush=True)
    if pattern == "R":
      timing, outs = bench_torch(params, series, model_cfg, ts)
      row = {"pattern": pattern, "impl": "torch (peer)", "shape": shape, **timing,
             "series_per_s": shape["batch"] / timing["fwd_ms"] * 1e3, "steps_per_s": steps / timing["fwd_ms"] * 1e3,
             "max_diff_out": _max_diff(outs[0], reference[0]), "max_diff_pooled": _max_diff(outs[1], reference[1])}
      rows.append(row)
      for other in rows:
        if other["pattern"] == "R" and "fwd_ms" in other:
          other["speedup_vs_torch"] = row["fwd_ms"] / other["fwd_ms"]
      print(f"R torch: {timing['fwd_ms']:.0f} ms", flush=True)
  common.print_table(rows, COLUMNS)
  name = "timeseries-quick" if args.quick else "timeseries"
  path = common.write_results(name, rows, **shape, outputs=OUTPUTS, dtype="float32",
                              spectrum_bins=32, note="pallas skipped on CPU (interpret mode only)" if on_cpu else "")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
