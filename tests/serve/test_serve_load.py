"""benchmarks/serve_load.py: TPOT per token from a fake stream's usage, a phase's accounting, and a --quick run (both
servers, every phase, 100 malformed requests) in which every request is accounted for and the servers' counters
agree with the client's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import types

import pytest

from conftest import ROOT

if str(ROOT / "benchmarks") not in sys.path:
  sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402  (a script of benchmarks/, importable once that folder is on the path)


def _chunk(tokens: int | None, finish: str | None = None, choice: bool = True):
  """A streamed completion chunk as the openai client parses it: the usage so far and at most one choice."""
  return types.SimpleNamespace(usage=None if tokens is None else types.SimpleNamespace(completion_tokens=tokens),
                               choices=[types.SimpleNamespace(finish_reason=finish)] if choice else [])


async def _stream(chunks):
  for chunk in chunks:
    yield chunk


def _consume(chunks, times, sent=0.0) -> dict:
  record = {"sent": sent}
  asyncio.run(serve_load.consume(_stream(chunks), record, clock=iter(times).__next__))
  return record


def test_tpot_is_per_token_after_the_first_event_of_a_fake_stream():
  # A first chunk of 16 tokens at 0.5 s, 16 more at 0.7 s, the last 4 (a stop inside a chunk) at 0.8 s, then the
  # finish event and the usage-only event, which bring no tokens.
  chunks = [_chunk(16), _chunk(32), _chunk(36), _chunk(36, "stop"), _chunk(36, choice=False)]
  record = _consume(chunks, [0.5, 0.7, 0.8, 0.81, 0.82, 0.83])
  assert record["tokens"] == 36 and record["finish"] == "stop"
  assert record["ttft"] == pytest.approx(0.5)
  assert record["tpot"] == pytest.approx((0.8 - 0.5) / (36 - 16))  # 20 tokens after the first event, in 0.3 s.
  assert record["tpot"] != pytest.approx((0.8 - 0.5) / 35)  # Not (last - first) / (n - 1) over bursts.
  assert record["arrivals"] == [(0.5, 16), (0.7, 32), (0.8, 36)]
  # Every token in the first event: a time to first token, no TPOT (left out, not 0).
  lone = _consume([_chunk(8), _chunk(8, "length"), _chunk(8, choice=False)], [0.2, 0.21, 0.22, 0.23])
  assert lone["tokens"] == 8 and lone["ttft"] == pytest.approx(0.2) and lone["tpot"] is None
  # Events without usage (continuous_usage_stats off) bring no counted tokens.
  assert _consume([_chunk(None), _chunk(None, "stop")], [0.1, 0.2, 0.3])["tokens"] == 0


def test_a_phase_accounts_for_every_request_and_checks_the_servers_counts():
  records = [{"outcome": "completed", "http": 200, "sent": 0.0, "ended": 2.0, "tokens": 40, "ttft": 0.1,
              "tpot": 0.01, "arrivals": [(0.1, 16), (0.34, 40)]},
             {"outcome": "completed", "http": 200, "sent": 0.5, "ended": 1.5, "tokens": 8, "ttft": 0.2, "tpot": None},
             {"outcome": "refused", "http": 429, "sent": 1.0, "ended": 1.0},
             {"outcome": "failed", "http": 200, "sent": 1.0, "ended": 1.2, "tokens": 3, "error": "APIError: boom"},
             {"outcome": "cut", "http": 200, "sent": 1.0, "ended": 4.0, "tokens": 5},
             {"outcome": "not_sent"}]
  row = serve_load.summarise("x", records)
  assert (row["requests"], row["completed"], row["refused"], row["failed"], row["cut"], row["not_sent"],
          row["lost"]) == (6, 2, 1, 1, 1, 1, 0)
  assert row["refused_by_status"] == {"429": 1} and row["tokens"] == 56 and row["seconds"] == 4.0
  assert row["tpot_requests"] == 1 and row["errors"] == ["APIError: boom"]
  assert row["per_request"][0] == [40, 16, 2, 100.0, 10.0] and len(row["per_request"]) == 5
  server = {"requests": {"200": 4, "429": 1}, "finished": {"stop": 1, "length": 1, "cancelled": 1, "error": 1}}
  assert serve_load.agrees(row, records, server)
  assert not serve_load.agrees(row, records, {**server, "requests": {"200": 4}})  # A refusal the server missed.
  assert not serve_load.agrees(row, records, {**server, "finished": {"stop": 1}})  # A completion it missed.


def test_a_phases_time_accounts_come_from_the_servers_counters():
  before = {"times": {"ltm_decode_chunk_seconds_sum": 1.0, "ltm_decode_chunk_seconds_count": 2.0,
                      "ltm_decode_steps_total": 32.0, "ltm_admission_seconds_sum": 0.5,
                      "ltm_admission_seconds_count": 1.0}}
  after = {"times": {"ltm_decode_chunk_seconds_sum": 4.0, "ltm_decode_chunk_seconds_count": 8.0,
                     "ltm_decode_steps_total": 92.0, "ltm_admission_seconds_sum": 2.5,
                     "ltm_admission_seconds_count": 5.0}}
  time_ = serve_load.where_time_went(10.0, 12.0, 5.0, before, after)
  assert time_["server_cores"] == 1.2 and time_["client_cores"] == 0.5 and time_["decode_steps"] == 60
  assert time_["decode_step_ms"] == pytest.approx(50.0) and time_["decode_share"] == pytest.approx(0.3)
  assert time_["admissions"] == 4 and time_["admission_ms_mean"] == pytest.approx(500.0)
  assert time_["admission_share"] == pytest.approx(0.2)


def test_process_cpu_seconds_agree_with_the_processes_own_clock():
  """Linux only (/proc): this process's CPU time read from /proc agrees with time.process_time() over a busy loop."""
  proc, own = serve_load.process_cpu_seconds(os.getpid()), time.process_time()
  while time.process_time() - own < 0.3:
    pass
  busy = time.process_time() - own
  assert serve_load.process_cpu_seconds(os.getpid()) - proc == pytest.approx(busy, abs=0.05)


@pytest.mark.slow
@pytest.mark.long
def test_quick_run_loses_no_request_and_survives_the_malformed_ones(tmp_path):
  env = {**os.environ, "LTM_BENCH_RESULTS": str(tmp_path)}
  done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--quick"], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stdout + done.stderr
  result = json.loads((tmp_path / "serve-load-quick-cpu.json").read_text())
  rows = {row["phase"]: row for row in result["results"]}
  assert list(rows) == ["lone", "sequential", "continuous", "static"]
  config = result["config"]
  for row in rows.values():
    counted = sum(row[k] for k in ("completed", "refused", "failed", "cut", "not_sent"))
    assert counted == row["requests"] and row["lost"] == 0, row
    assert row["completed"] == row["requests"] and row["server_agrees"], row
    assert row["tpot_requests"] >= 1 and row["tokens"] > 0, row
    assert row["time"]["decode_steps"] > 0 and row["time"]["admissions"] > 0 and row["time"]["server_cores"] > 0, row
  assert rows["continuous"]["requests"] == rows["static"]["requests"] == config["requests"]
  assert rows["sequential"]["requests"] == config["sequential"] and rows["lone"]["requests"] == config["lone"]
  malformed = config["malformed"]
  assert malformed["answered_4xx"] == malformed["sent"] == 100 and not malformed["not_4xx_cases"]
  assert malformed["server_agrees"] and malformed["valid_after"]
  assert set(malformed["by_case"]) == {case[0] for case in serve_load.MALFORMED}
  assert config["continuous_server"]["exit"] == config["static_server"]["exit"] == 0
  assert set(config["goals"]) == {"throughput_4x_sequential", "tpot_p99_within_2x_lone"}
