"""`ltm serve` under Poisson load through the official `openai` client: continuous batching against static batches,
the same requests one at a time and a lone request; then malformed requests, each of which must get a 4xx.

  python benchmarks/serve_load.py            # the tiny config (context 256), 64 streams: about 4 minutes on 2 cores
  python benchmarks/serve_load.py --quick    # micro model, 4 rows, 8 streams, 100 malformed requests: proves the script
  python benchmarks/serve_load.py --pin --prefill-budget 256 --name serve-load-budget256   # a bounded admission

Model and servers: the tiny config's architecture at its initialisation (as in benchmarks/serve.py; speed does not
depend on the weights), served by `ltm serve --max-batch 64 --chunk 16 --prefill-chunk 128` in its own process on
127.0.0.1, then by a second process with `--static-batches`: requests are admitted only while every row is free, so
the requests taken together run to completion before the next batch starts (same programs, same sampling). Both
processes share one persistent compilation cache (a temporary folder, or JAX_COMPILATION_CACHE_DIR when set), so the
second loads the programs the first compiled. --prefill-budget goes to the continuous server only (`ltm serve
--prefill-budget`: each admission round prefills at most that many prompt tokens, and decode chunks are shorter while
requests wait); the static baseline is the same in every run.

Requests (drawn once from a fixed seed by serve.py's `_requests`): prompts of 4 to 120 bytes (one token per byte),
max_tokens 8 to 128, temperature 1 with a seed each (random weights stop at the end-of-text token now and then: the
tokens counted are those the usage reports), streamed with `stream_options: {include_usage, continuous_usage_stats}`
so that every event carries the completion tokens so far. Arrival times are a Poisson process of `rate` requests/s
(100: more than 2 cores complete, so the streams stay full while arrivals last; streams_mean, the mean number of
open streams, shows how full they were); at most `streams` (64) streams are open at once, and an arrival that finds
them all open waits in the client for one (as vLLM's benchmark_serving --max-concurrency). Arrivals later than
`seconds` (60) are not sent, and streams still open `drain` (120) seconds after that are closed; both are counted.
The client never retries (max_retries=0). The sizes are SIZES["full"] (SIZES["quick"] with --quick).

Phases, in order:
  lone        one request (a 60-byte prompt, the largest max_tokens) alone on the server, `lone` (5) times, seeds 0,
              1, ...
  sequential  the first `sequential` (24) requests of the list, one at a time (one stream, all arrived at once)
  continuous  every request (384) at its Poisson arrival time, `streams` streams, the continuous-batching server
  static      the same requests and arrival times against the --static-batches server
  malformed   `malformed` (1000) malformed requests, 16 at a time, to the continuous server (after its phases): bad
              JSON, wrong types, negative or huge max_tokens, an unknown model, huge n, unknown fields, a body over
              1 MiB, ... (`MALFORMED`); each must get a 4xx, and a valid request must complete after them

Every request sent ends as completed (its finish_reason and [DONE] arrived), refused (an HTTP status other than 200,
counted by status), failed (an error event or a broken connection) or cut (still open at the time bound); with
those not sent, the counts add up to the requests of the phase. The server's own counters (`ltm_requests_total` by
status, `ltm_finished_requests_total` by reason, read from /metrics before and after) must agree: every HTTP status
the client got, and as many finished (stop or length) prompts as completed requests.

Throughput: completion tokens streamed / seconds from the first request sent to the last answer. TTFT: request sent
-> the first event that brings tokens. TPOT is measured per token (`serve.time_per_token`): the server streams each
decode step's tokens as they reach its host (with --stream-per-chunk, at decode-chunk boundaries, in bursts of up to
--chunk), and an event may carry several tokens; each event's usage says how many tokens it brought, every token of an event is charged its share of the wait since the previous event, and a request's TPOT is
the mean over its tokens after its first event: (last event - first event) / (tokens - tokens of the first event).
The tokens of the first event are covered by TTFT; a request whose tokens all came in its first event (at most
--chunk tokens) has no TPOT and is left out, not counted as 0 (tpot_requests says how many have one). p50 and p99
are over requests; the JSON's per_request lists every request's tokens, tokens of its first event, events, TTFT and
TPOT, for reading the tails.

Goals, at 64 streams: continuous throughput >= 4x sequential; continuous TPOT p99 <= 2x the lone request's TPOT
(the median over its runs). The table and the JSON say whether each is met. Every decode chunk runs over all
64 (--max-batch) rows however many are occupied, so the lone request pays a full chunk's compute alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import tempfile
import time

from common import print_table, write_results
from serve import _requests, _workdir, running_server, time_per_token

import httpx
import numpy as np
import openai

# The run's sizes (every results file's), and --quick's: 4 rows under 8 streams (the continuous phase queues), prompts
# over 16 tokens fed in pieces: 5 programs to compile (admit for groups of 1 and 4 at one length bucket, decode,
# feed, place), the same code paths.
SIZES = {
    "full": dict(overrides=["model.max_seq_len=256"], max_prompt=120, max_tokens=(8, 128), streams=64, requests=384,
                 rate=100.0, seconds=60.0, drain=120.0, sequential=24, lone=5, malformed=1000, max_batch=64,
                 prefill_chunk=128),
    "quick": dict(overrides=["model.d_model=32", "model.n_layers=2", "model.max_seq_len=128"], max_prompt=40,
                  max_tokens=(4, 40), streams=8, requests=48, rate=50.0, seconds=60.0, drain=120.0, sequential=8,
                  lone=2, malformed=100, max_batch=4, chunk=8, prefill_chunk=16),
}
LONE_PROMPT = 60
LONE_TEXT = "the quick brown fox jumps over the lazy dog, " * 2
MALFORMED_AT_ONCE = 16


def _pct(xs: list[float], q: float) -> float:
  return float(np.percentile(xs, q)) if xs else float("nan")


async def consume(stream, record: dict, clock=time.perf_counter) -> None:
  """Reads a streamed completion into `record` (which holds "sent", the clock when the request went out): "arrivals"
  [(time, completion tokens so far)] of the events that brought tokens, "tokens", "finish" (the finish_reason),
  "ended", "ttft" and "tpot" (seconds; None without them). An error event raises openai.APIError (the client turns
  it into one)."""
  arrivals, finish = [], None
  try:
    async for chunk in stream:
      now = clock()
      if chunk.usage is not None and chunk.usage.completion_tokens > (arrivals[-1][1] if arrivals else 0):
        arrivals.append((now, chunk.usage.completion_tokens))
      for choice in chunk.choices:
        finish = choice.finish_reason or finish
  finally:
    record.update(arrivals=arrivals, tokens=arrivals[-1][1] if arrivals else 0, finish=finish, ended=clock(),
                  ttft=arrivals[0][0] - record["sent"] if arrivals else None, tpot=time_per_token(arrivals))


async def _send(client: openai.AsyncOpenAI, model: str, body: dict, record: dict) -> None:
  """One streamed request; its outcome goes into `record` (see `tally`)."""
  record.update(sent=time.perf_counter(), outcome="cut", http=None)
  try:
    stream = await client.completions.create(model=model, **body)
  except openai.APIStatusError as e:
    record.update(outcome="refused", http=e.status_code, ended=time.perf_counter())
    return
  except openai.APIError as e:  # No HTTP answer (a broken connection).
    record.update(outcome="failed", error=f"{type(e).__name__}: {e}", ended=time.perf_counter())
    return
  record["http"] = 200
  try:
    await consume(stream, record)
  except openai.APIError as e:
    record.update(outcome="failed", error=f"{type(e).__name__}: {e}")
  else:
    record["outcome"] = "completed" if record["finish"] in ("stop", "length") else "failed"


async def _phase(url: str, model: str, bodies: list[dict], arrivals: list[float], streams: int, window: float,
                 drain: float) -> tuple[list[dict], float]:
  """Sends bodies[i] at arrivals[i] seconds (those after `window` are not sent) over at most `streams` open streams;
  closes what is still open `drain` seconds after the window. -> (one record per body, wall seconds)."""
  records = [{"outcome": "not_sent"} for _ in bodies]
  open_streams = asyncio.Semaphore(streams)
  start = time.perf_counter()

  async def one(body: dict, at: float, record: dict) -> None:
    if at > window:
      return
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    record["arrived"] = time.perf_counter()
    async with open_streams:
      await _send(client, model, body, record)

  limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
  async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=window + drain,
                                http_client=httpx.AsyncClient(limits=limits)) as client:
    tasks = [asyncio.ensure_future(one(b, a, r)) for b, a, r in zip(bodies, arrivals, records)]
    _, pending = await asyncio.wait(tasks, timeout=window + drain)
    for task in pending:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
  return records, time.perf_counter() - start


def tally(records: list[dict]) -> dict:
  """The phase's accounting: requests, and how many were completed, refused (and by status), failed, cut, not sent;
  `lost` is what none of those covers (0 when every request is accounted for)."""
  counts = collections.Counter(r["outcome"] for r in records)
  refused = collections.Counter(str(r["http"]) for r in records if r["outcome"] == "refused")
  row = {"requests": len(records), **{k: counts[k] for k in ("completed", "refused", "failed", "cut", "not_sent")},
         "refused_by_status": dict(refused)}
  row["lost"] = row["requests"] - sum(counts[k] for k in ("completed", "refused", "failed", "cut", "not_sent"))
  return row


def summarise(name: str, records: list[dict]) -> dict:
  """One row of the table: the accounting, throughput, mean open streams, TTFT and TPOT p50 / p99 (ms)."""
  row = {"phase": name, **tally(records)}
  sent = [r for r in records if r["outcome"] != "not_sent"]
  seconds = max(r["ended"] for r in sent) - min(r["sent"] for r in sent) if sent else float("nan")
  tokens = sum(r.get("tokens", 0) for r in sent)
  ttft = [r["ttft"] * 1e3 for r in sent if r.get("ttft") is not None]
  tpot = [r["tpot"] * 1e3 for r in sent if r.get("tpot") is not None]
  row.update(tokens=tokens, seconds=round(seconds, 2), tokens_per_s=tokens / seconds,
             streams_mean=sum(r["ended"] - r["sent"] for r in sent) / seconds, ttft_p50_ms=_pct(ttft, 50),
             ttft_p99_ms=_pct(ttft, 99), tpot_requests=len(tpot), tpot_p50_ms=_pct(tpot, 50),
             tpot_p99_ms=_pct(tpot, 99))
  # Per request sent, for reading the tails: [tokens, tokens of the first event, events with tokens, TTFT, TPOT (ms)].
  ms = lambda x: None if x is None else round(x * 1e3, 3)
  row["per_request"] = [[r.get("tokens", 0), r["arrivals"][0][1] if r.get("arrivals") else 0,
                         len(r.get("arrivals", ())), ms(r.get("ttft")), ms(r.get("tpot"))] for r in sent]
  errors = sorted({r["error"] for r in sent if r.get("error")})
  if errors:
    row["errors"] = errors[:5]
  return row


# Every sample carries the server's model_name label (a server before it had none).
_METRIC = re.compile(r'^ltm_(requests|finished_requests)_total\{(?:model_name="[^"]*",)?(?:status|reason)="([^"]+)"\} '
                     r'(\S+)$', re.M)
# The server's time accounts: decode chunks (their seconds and steps) and admissions between them.
_TIMES = ("ltm_decode_chunk_seconds_sum", "ltm_decode_chunk_seconds_count", "ltm_decode_steps_total",
          "ltm_admission_seconds_sum", "ltm_admission_seconds_count")
_TIME = re.compile(rf'^({"|".join(_TIMES)})(?:\{{model_name="[^"]*"\}})? (\S+)$', re.M)


def server_counts(url: str) -> dict:
  """{"requests": {status: n}, "finished": {reason: n}} from the server's /metrics, once it is idle."""
  for _ in range(100):  # A cancelled row is freed at the next chunk boundary.
    health = httpx.get(url + "/health").json()
    if not health["occupancy"] and not health["queue_depth"]:
      break
    time.sleep(0.05)
  counts = {"requests": collections.Counter(), "finished": collections.Counter()}
  text = httpx.get(url + "/metrics").text
  for kind, label, value in _METRIC.findall(text):
    counts["requests" if kind == "requests" else "finished"][label] += int(float(value))
  counts["times"] = {name: float(value) for name, value in _TIME.findall(text)}
  return counts


def server_delta(before: dict, after: dict) -> dict:
  return {kind: {k: v for k, v in (after[kind] - before[kind]).items() if v} for kind in ("requests", "finished")}


def process_cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of process `pid` and all its threads so far (Linux: /proc/PID/stat)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def where_time_went(wall: float, server_cpu: float, client_cpu: float, before: dict, after: dict) -> dict:
  """A phase's time accounts: CPU the server and the client (this process) used, in cores over the phase's wall time;
  the server's mean decode step (its chunks' seconds over their steps) and the shares of wall time its decode chunks
  and admissions took."""
  d = {name: after["times"].get(name, 0.0) - before["times"].get(name, 0.0) for name in _TIMES}
  steps = d["ltm_decode_steps_total"]
  return {"wall_s": round(wall, 2), "server_cores": server_cpu / wall, "client_cores": client_cpu / wall,
          "decode_steps": int(steps),
          "decode_step_ms": d["ltm_decode_chunk_seconds_sum"] / steps * 1e3 if steps else None,
          "decode_share": d["ltm_decode_chunk_seconds_sum"] / wall,
          "admissions": int(d["ltm_admission_seconds_count"]),
          "admission_ms_mean": (d["ltm_admission_seconds_sum"] / d["ltm_admission_seconds_count"] * 1e3
                                if d["ltm_admission_seconds_count"] else None),
          "admission_share": d["ltm_admission_seconds_sum"] / wall}


def agrees(row: dict, records: list[dict], delta: dict) -> bool:
  """The server counted every HTTP status the client got, and as many finished prompts as completed requests."""
  statuses = collections.Counter(str(r["http"]) for r in records if r.get("http") is not None)
  finished = delta["finished"].get("stop", 0) + delta["finished"].get("length", 0)
  return dict(statuses) == delta["requests"] and finished == row["completed"]


def _run_phase(name: str, server, model: str, bodies, arrivals, streams, window, drain) -> dict:
  url = server.url
  before = server_counts(url)
  server_cpu, client_cpu = process_cpu_seconds(server.pid), time.process_time()
  records, wall = asyncio.run(_phase(url, model, bodies, arrivals, streams, window, drain))
  server_cpu, client_cpu = process_cpu_seconds(server.pid) - server_cpu, time.process_time() - client_cpu
  row = summarise(name, records)
  after = server_counts(url)
  row["server"] = server_delta(before, after)
  row["time"] = where_time_went(wall, server_cpu, client_cpu, before, after)
  row["server_agrees"] = agrees(row, records, row["server"])
  print(f"{name}: {row['completed']}/{row['requests']} completed, {row['tokens_per_s']:.1f} tokens/s, "
        f"server agrees: {row['server_agrees']}", flush=True)
  return row


# Each: (name, method, path, body as bytes or a JSON value). The model name is filled in as {model}.
MALFORMED = [
    ("bad_json", "POST", "/v1/completions", b'{"model": "{model}", "prompt": "a"'),
    ("not_an_object", "POST", "/v1/completions", b"[1, 2, 3]"),
    ("empty_body", "POST", "/v1/completions", b""),
    ("not_utf8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("nan", "POST", "/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    ("prompt_a_number", "POST", "/v1/completions", {"prompt": 5}),
    ("prompt_missing", "POST", "/v1/completions", {"max_tokens": 4}),
    ("prompt_mixed_list", "POST", "/v1/completions", {"prompt": ["a", 1]}),
    ("max_tokens_a_string", "POST", "/v1/completions", {"prompt": "a", "max_tokens": "16"}),
    ("max_tokens_negative", "POST", "/v1/completions", {"prompt": "a", "max_tokens": -5}),
    ("max_tokens_zero", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}),
    ("max_tokens_huge", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 10**12}),
    ("max_tokens_float", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 4.5}),
    ("unknown_model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "a"}),
    ("model_a_number", "POST", "/v1/completions", {"model": 7, "prompt": "a"}),
    ("huge_n", "POST", "/v1/completions", {"prompt": "a", "n": 10**9}),
    ("best_of", "POST", "/v1/completions", {"prompt": "a", "best_of": 4}),
    ("unknown_field", "POST", "/v1/completions", {"prompt": "a", "frobnicate": True}),
    ("token_outside_vocab", "POST", "/v1/completions", {"prompt": [10**9]}),
    ("temperature_negative", "POST", "/v1/completions", {"prompt": "a", "temperature": -1}),
    ("temperature_a_string", "POST", "/v1/completions", {"prompt": "a", "temperature": "hot"}),
    ("top_p_above_1", "POST", "/v1/completions", {"prompt": "a", "top_p": 2}),
    ("top_k_zero", "POST", "/v1/completions", {"prompt": "a", "top_k": 0}),
    ("five_stops", "POST", "/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}),
    ("seed_too_big", "POST", "/v1/completions", {"prompt": "a", "seed": 2**70}),
    ("stream_a_string", "POST", "/v1/completions", {"prompt": "a", "stream": "yes"}),
    ("stream_options_unstreamed", "POST", "/v1/completions", {"prompt": "a", "stream_options": {}}),
    ("prompt_past_context", "POST", "/v1/completions", {"prompt": "a" * 5000}),
    ("body_over_1mib", "POST", "/v1/completions", {"prompt": "a" * (1 << 20)}),
    ("chat_no_messages", "POST", "/v1/chat/completions", {"messages": []}),
    ("chat_bad_role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("chat_tools", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
    ("wrong_method", "GET", "/v1/completions", None),
    ("unknown_path", "POST", "/v1/nothing", {"prompt": "a"}),
]


async def _malformed(url: str, model: str, count: int) -> list[dict]:
  """`count` malformed requests, MALFORMED in turn, MALFORMED_AT_ONCE at a time -> [{"case", "status"}] (status
  None: no HTTP answer)."""
  todo = collections.deque(MALFORMED[i % len(MALFORMED)] for i in range(count))
  results = []

  async def worker(client: httpx.AsyncClient) -> None:
    while todo:
      name, method, path, body = todo.popleft()
      if isinstance(body, bytes):
        content = body.replace(b"{model}", model.encode())
      else:
        content = None if body is None else httpx.Request("POST", url, json=body).content
      try:
        status = (await client.request(method, path, content=content,
                                       headers={"Content-Type": "application/json"})).status_code
      except httpx.HTTPError:
        status = None
      results.append({"case": name, "status": status})

  async with httpx.AsyncClient(base_url=url, timeout=60) as client:
    await asyncio.gather(*[worker(client) for _ in range(MALFORMED_AT_ONCE)])
  return results


def malformed_phase(url: str, model: str, count: int) -> dict:
  """The malformed requests, then one valid request through the openai client: how each was answered, and whether
  the server's counters agree."""
  before = server_counts(url)
  results = asyncio.run(_malformed(url, model, count))
  statuses = collections.Counter(str(r["status"]) for r in results)
  not_4xx = sorted({r["case"] for r in results if r["status"] is None or not 400 <= r["status"] < 500})
  by_case = collections.defaultdict(collections.Counter)
  for r in results:
    by_case[r["case"]][str(r["status"])] += 1
  after = server_counts(url)
  valid = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60).completions.create(
      model=model, prompt="The ", max_tokens=8, temperature=0)
  delta = server_delta(before, after)
  row = {"sent": count, "answered_4xx": sum(n for s, n in statuses.items() if s.startswith("4")),
         "statuses": dict(statuses), "not_4xx_cases": not_4xx,
         "by_case": {case: dict(c) for case, c in by_case.items()}, "server": delta,
         "server_agrees": delta["requests"] == dict(statuses) and not delta["finished"],
         "valid_after": valid.choices[0].finish_reason in ("stop", "length") and valid.usage.completion_tokens > 0}
  print(f"malformed: {row['answered_4xx']}/{count} answered 4xx {row['statuses']}, a valid request then completed: "
        f"{row['valid_after']}", flush=True)
  return row


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true",
                 help="a micro model on 4 rows, 8 streams, 48 requests, 100 malformed requests (seconds, not minutes)")
  p.add_argument("--chunk", type=int, default=16, help="ltm serve --chunk (--quick: 8)")
  p.add_argument("--prefill-budget", type=int, default=0,
                 help="ltm serve --prefill-budget for the continuous server (its lone and sequential phases too; the "
                      "static baseline runs without): prompt tokens one admission round may prefill (0: off)")
  p.add_argument("--stream-per-chunk", action="store_true",
                 help="the servers hand text out per decode chunk, not per step (ltm serve --stream-per-chunk)")
  p.add_argument("--pin", action="store_true",
                 help="the servers run on CPU 0 only and this client on the other CPUs (Linux), so that the client's "
                      "work does not slow the server's steps")
  p.add_argument("--name", default=None,
                 help="results file: benchmarks/results/NAME-<device>.json (default serve-load, or serve-load-quick)")
  args = p.parse_args()
  vars(args).update(SIZES["quick" if args.quick else "full"])
  overrides, max_prompt, max_tokens = args.overrides, args.max_prompt, args.max_tokens
  bodies = _requests(max(args.requests, args.sequential), max_prompt, max_tokens)
  arrivals = np.cumsum(np.random.default_rng(1).exponential(1 / args.rate, args.requests)).tolist()
  lone_body = {**_requests(1, 4, (max_tokens[1], max_tokens[1]))[0], "prompt": LONE_TEXT[:LONE_PROMPT]}
  lone = [{**lone_body, "seed": i} for i in range(args.lone)]
  options = ["--max-batch", str(args.max_batch), "--chunk", str(args.chunk), "--prefill-chunk", str(args.prefill_chunk)]
  options += ["--stream-per-chunk"] if args.stream_per_chunk else []
  admission = ["--prefill-budget", str(args.prefill_budget)]
  server_cpus = None
  if args.pin:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
      raise SystemExit(f"--pin needs at least 2 CPUs; this process may use {len(cpus)}")
    server_cpus = {cpus[0]}
    os.sched_setaffinity(0, cpus[1:])
  load_before, began = os.getloadavg(), time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = _workdir(os.path.join(tmp, "workdir"), overrides)
    cache_given = "JAX_COMPILATION_CACHE_DIR" in os.environ  # Then the first server may load programs too.
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "compilation-cache"))
    with running_server(workdir, *options, *admission, env=env, cpus=server_cpus) as server:
      print(server.ready, flush=True)
      model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
      _run_phase("warm-up", server, model, bodies[:2], [0.0, 0.0], 2, 0.0, args.drain)
      rows = [_run_phase("lone", server, model, lone, [0.0] * len(lone), 1, 0.0, args.drain),
              _run_phase("sequential", server, model, bodies[:args.sequential], [0.0] * args.sequential, 1, 0.0,
                         args.drain),
              _run_phase("continuous", server, model, bodies[:args.requests], arrivals, args.streams,
                         args.seconds, args.drain)]
      malformed = malformed_phase(server.url, model, args.malformed)
    continuous_server = {"ready": server.ready, "exit": server.exit, "log_tail": list(server.log)[-5:]}
    with running_server(workdir, *options, "--static-batches", env=env, cpus=server_cpus) as server:
      print(server.ready, flush=True)
      _run_phase("warm-up", server, model, bodies[:2], [0.0, 0.0], 2, 0.0, args.drain)
      rows.append(_run_phase("static", server, model, bodies[:args.requests], arrivals, args.streams,
                             args.seconds, args.drain))
    static_server = {"ready": server.ready, "exit": server.exit, "log_tail": list(server.log)[-5:]}
  lone_tpot, sequential = rows[0]["tpot_p50_ms"], rows[1]["tokens_per_s"]
  for row in rows:
    row["vs_sequential"] = row["tokens_per_s"] / sequential
    row["tpot_p99_vs_lone"] = row["tpot_p99_ms"] / lone_tpot
  continuous = rows[2]
  goals = {"throughput_4x_sequential": bool(continuous["vs_sequential"] >= 4),
           "tpot_p99_within_2x_lone": bool(continuous["tpot_p99_vs_lone"] <= 2)}
  print_table(rows, ["phase", "requests", "completed", "refused", "failed", "cut", "not_sent", "lost", "tokens",
                     "seconds", "tokens_per_s", "vs_sequential", "streams_mean", "ttft_p50_ms", "ttft_p99_ms",
                     "tpot_requests", "tpot_p50_ms", "tpot_p99_ms", "tpot_p99_vs_lone", "server_agrees"])
  print_table([{"phase": row["phase"], **row["time"]} for row in rows],
              ["phase", "wall_s", "server_cores", "client_cores", "decode_steps", "decode_step_ms", "decode_share",
               "admissions", "admission_ms_mean", "admission_share"])
  print(f"lone request TPOT (median of {args.lone}): {lone_tpot:.3f} ms")
  print(f"goal: continuous throughput >= 4x sequential: {continuous['vs_sequential']:.2f}x, "
        f"{'met' if goals['throughput_4x_sequential'] else 'NOT met'}")
  print(f"goal: continuous TPOT p99 <= 2x the lone request's: {continuous['tpot_p99_vs_lone']:.2f}x, "
        f"{'met' if goals['tpot_p99_within_2x_lone'] else 'NOT met'}")
  print(f"malformed: {malformed['answered_4xx']} of {malformed['sent']} answered 4xx, server agrees: "
        f"{malformed['server_agrees']}, a valid request then completed: {malformed['valid_after']}")
  print(f"server exit status after SIGTERM: continuous {continuous_server['exit']}, static {static_server['exit']}; "
        f"load average before {load_before}, after {os.getloadavg()}; {time.perf_counter() - began:.0f} s in all")
  path = write_results(args.name or ("serve-load-quick" if args.quick else "serve-load"), rows, model=(
      "micro (init weights)" if args.quick else "tiny (init weights)"), overrides=overrides, streams=args.streams,
      requests=args.requests, rate=args.rate, seconds=args.seconds, drain=args.drain, sequential=args.sequential,
      lone=args.lone, max_batch=args.max_batch, chunk=args.chunk, prefill_chunk=args.prefill_chunk,
      stream_per_chunk=args.stream_per_chunk, prefill_budget=args.prefill_budget,
      pinned={"server": sorted(server_cpus), "client": sorted(os.sched_getaffinity(0))} if args.pin else None,
      prompt_bytes=[4, max_prompt], max_tokens=list(max_tokens), lone_prompt_bytes=LONE_PROMPT,
      lone_tpot_ms=lone_tpot, goals=goals, malformed=malformed, continuous_server=continuous_server,
      static_server=static_server, compilation_cache_given=cache_given, load_average_before=list(load_before),
      load_average_after=list(os.getloadavg()), total_seconds=round(time.perf_counter() - began, 1))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
