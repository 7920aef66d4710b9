"""`ltm serve` under load: 1 to 64 concurrent streaming clients on localhost against the same requests one at a time.

  python benchmarks/serve.py            # the tiny config (context 256), levels 1..64: a few minutes on 2 CPU cores
  python benchmarks/serve.py --quick    # a micro model, levels 1 and 4: proves the script end to end

The model is the tiny config's architecture (`configs/tiny.py`, d_model 128, 4 layers RWKV-4 + attention) at its
initialisation, saved to a temporary workdir: speed does not depend on the weights. The server runs as its own
process (`ltm serve --max-batch 32 --chunk 16 --prefill-chunk 128`), so the clients here do not share its interpreter.

The requests are drawn once from a fixed seed: prompts of 4 to 120 bytes of text (one token per byte), max_tokens
16 to 64, temperature 1 with a seed each (random weights stop at the end-of-text token now and then; the tokens
counted are those the usage reports). Level c runs max(16, 2c) of them (the first ones of the same list) with c
clients, each streaming one request at a time; level 1 is the one-at-a-time baseline.

Per level: throughput (completion tokens / wall seconds from the first request to the last answer), p50/p99 time to
first token (request sent -> first text event) and p50/p99 per-token latency (TPOT), each against level 1.

TPOT is measured per token. Tokens reach the client in bursts of up to one decode chunk, and every event carries the
usage so far (vLLM's stream_options.continuous_usage_stats), so each event's tokens are known: a token that arrives
in an event is charged its share of the wait since the previous event, and a request's TPOT is the mean over its
tokens after the first event, (last event - first event) / (tokens - tokens of the first event). The tokens of the
first event are its time to first token, not zero-latency tokens; a request whose tokens all came in its first event
has no TPOT (it is left out, not counted as 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from common import ROOT, print_table, write_results

import httpx
import jax
import numpy as np

from ltm_jax import config as config_lib
from ltm_jax import model as model_lib
from ltm_jax.train import checkpoint as ckpt_lib

LEVELS = (1, 2, 4, 8, 16, 32, 64)
SERVER = {"max_batch": 32, "chunk": 16, "prefill_chunk": 128}  # `ltm serve --max-batch 32 --chunk 16 ...`
LEVEL_SECONDS = 120.0  # No new request starts after this long in one level (the table says how many ran).


def _workdir(path: str, overrides: list[str]) -> str:
  cfg = config_lib.load_config(str(ROOT / "configs" / "tiny.py"), overrides)
  params = model_lib.init_params(cfg.model, jax.random.key(0))
  ckpt_lib.save_params(path, cfg, params)
  return path


def _requests(count: int, max_prompt: int, max_tokens: tuple[int, int]) -> list[dict]:
  rng = np.random.default_rng(0)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz     .,"))
  return [{"prompt": "".join(rng.choice(letters, int(rng.integers(4, max_prompt + 1)))),
           "max_tokens": int(rng.integers(max_tokens[0], max_tokens[1] + 1)), "temperature": 1.0, "seed": i,
           "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
          for i in range(count)]


def time_per_token(arrivals: list[tuple[float, int]]) -> float | None:
  """TPOT from a request's events as (arrival time, completion tokens so far): the seconds per token after the
  first event; None when no token came after it."""
  if not arrivals:
    return None
  (first, first_tokens), (last, tokens) = arrivals[0], arrivals[-1]
  return (last - first) / (tokens - first_tokens) if tokens > first_tokens else None


async def _one(client: httpx.AsyncClient, body: dict) -> dict:
  sent = time.perf_counter()
  arrivals = []  # (time, completion tokens so far) of every event that brought tokens.
  tokens = 0
  async with client.stream("POST", "/v1/completions", json=body) as response:
    if response.status_code != 200:
      raise RuntimeError(f"status {response.status_code}: {await response.aread()}")
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[len("data: "):])
      if "error" in event:
        raise RuntimeError(f"error event: {event['error']['message']}")
      now = time.perf_counter()
      if event.get("usage") and event["usage"]["completion_tokens"] > tokens:
        tokens = event["usage"]["completion_tokens"]
        arrivals.append((now, tokens))
  return {"ttft": arrivals[0][0] - sent if arrivals else None, "tokens": tokens, "tpot": time_per_token(arrivals)}


async def _level(url: str, requests: list[dict], clients: int) -> dict:
  todo = list(requests)
  results = []
  started = time.perf_counter()

  async def worker(client):
    while todo and time.perf_counter() - started < LEVEL_SECONDS:
      results.append(await _one(client, todo.pop(0)))

  limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
  async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
    await asyncio.gather(*[worker(client) for _ in range(clients)])
  seconds = time.perf_counter() - started
  ttft = [r["ttft"] * 1e3 for r in results if r["ttft"] is not None]
  tpot = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
  tokens = sum(r["tokens"] for r in results)
  pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
  return {"clients": clients, "requests": len(results), "tpot_requests": len(tpot), "tokens": tokens,
          "seconds": round(seconds, 2),
          "tokens_per_s": tokens / seconds, "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
          "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99)}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Server:
  """A running `ltm serve`: its URL, its start-up line, its process id, its exit status once stopped (None before),
  and the last lines it wrote on stderr after start-up."""
  url: str
  ready: str
  pid: int
  exit: int | None = None
  log: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=50))


@contextlib.contextmanager
def running_server(workdir: str, *options: str, env: dict | None = None, cpus: set[int] | None = None):
  """`ltm serve --workdir workdir *options` as its own process on a free port of 127.0.0.1, yielded as a `Server`
  once it answers /health; stopped with SIGTERM on exit (its exit status recorded). Its stderr is read on a thread
  so the server never blocks on a full pipe. `cpus`: the only CPUs it may run on (Linux): the calling thread takes
  them while it starts the process, which inherits them (its threads, XLA's included, too)."""
  port = _free_port()
  own = None if cpus is None else os.sched_getaffinity(0)
  if cpus is not None:
    os.sched_setaffinity(0, cpus)
  try:
    process = subprocess.Popen([sys.executable, "-m", "ltm_jax", "serve", "--workdir", workdir, "--port", str(port),
                                *options], cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
  finally:
    if own is not None:
      os.sched_setaffinity(0, own)
  server = None
  try:
    ready = next((line for line in process.stderr if "serving" in line), "")
    if "programs compiled" not in ready:
      raise SystemExit(f"the server did not start: {ready}")
    server = Server(f"http://127.0.0.1:{port}", ready.strip(), process.pid)
    threading.Thread(target=server.log.extend, args=(process.stderr,), daemon=True).start()
    for _ in range(600):
      try:
        if httpx.get(server.url + "/health").status_code == 200:
          break
      except httpx.TransportError:
        time.sleep(0.1)
    yield server
  finally:
    process.send_signal(signal.SIGTERM)
    code = process.wait(120)
    if server is not None:
      server.exit = code


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="a micro model and levels 1 and 4")
  args = p.parse_args()
  levels = (1, 4) if args.quick else LEVELS
  overrides = (["model.d_model=32", "model.n_layers=2", "model.max_seq_len=128"] if args.quick
               else ["model.max_seq_len=256"])
  max_prompt, max_tokens = (40, (8, 24)) if args.quick else (120, (16, 64))
  requests = _requests(max(16, 2 * max(levels)), max_prompt, max_tokens)
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    options = [a for k, v in SERVER.items() for a in ("--" + k.replace("_", "-"), str(v))]
    with running_server(_workdir(tmp, overrides), *options) as server:
      print(server.ready)
      asyncio.run(_level(server.url, requests[:4], 4))  # Warm the connection handling; every program is compiled.
      rows = []
      for clients in levels:
        rows.append(asyncio.run(_level(server.url, requests[:max(16, 2 * clients)], clients)))
        print(f"{clients} clients: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
  code, ready = server.exit, server.ready
  base = rows[0]
  for row in rows:
    row["vs_one_at_a_time"] = row["tokens_per_s"] / base["tokens_per_s"]
    row["tpot_p99_vs_single_p99"] = row["tpot_p99_ms"] / base["tpot_p99_ms"]
    row["ttft_p99_vs_single_p99"] = row["ttft_p99_ms"] / base["ttft_p99_ms"]
  print_table(rows, ["clients", "requests", "tpot_requests", "tokens", "seconds", "tokens_per_s", "vs_one_at_a_time", "ttft_p50_ms",
                     "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tpot_p99_vs_single_p99"])
  print(f"server exit status after SIGTERM: {code}; load average before {load_before}, after {os.getloadavg()}")
  if not args.quick:
    path = write_results("serve", rows, model="tiny (init weights)", overrides=overrides, **SERVER,
                         server=ready.strip(), server_exit=code,
                         load_average_before=list(load_before), load_average_after=list(os.getloadavg()),
                         prompt_bytes=[4, max_prompt], max_tokens=list(max_tokens))
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
