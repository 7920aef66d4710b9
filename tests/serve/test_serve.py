"""`ltm serve` over real HTTP on 127.0.0.1: completions equal `LanguageModel.generate`, alone and in a crowd, for a
long prompt prefilled in pieces while another request decodes, and for requests that join mid-decode one prefill
budget per round; streaming; stop strings and the tokens counted after them; a disconnect frees its row; 429 on a
full queue that cancelled requests leave at once, 400 for more prompts than the queue; failures and the request
timeout as HTTP errors or error events; chat completions and their template; OpenAI-style 4xx for bad requests; the
official `openai` client; the metrics' values; a latent model's z fitted per request; the CLI's refusal of an address
it cannot use.

The model is a micro hybrid (RWKV-4 + attention, context 64) saved to a workdir from its initialisation with the head
scaled up, as tests/test_generate.py does: random init gives near-uniform logits, and spread logits make greedy
choices decided by the model rather than by rounding (a barely trained model would mostly repeat one character,
which would hide a wrong row or position). One server, started once, serves most tests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import re
import socket
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest
import uvicorn

from conftest import micro_config
from ltm_jax import api, cli, compilation_cache
from ltm_jax import model as model_lib
from ltm_jax.config import LatentConfig
from ltm_jax.serve import Engine, protocol
from ltm_jax.serve import engine as engine_lib
from ltm_jax.serve import slots as slots_lib
from ltm_jax.serve import app as app_lib
from ltm_jax.serve.app import create_app
from ltm_jax.train import checkpoint as ckpt_lib

CONTEXT = 64
SLOTS = 16
QUEUE = 16
NEW = 24  # max_tokens of the compared completions.
# Sixteen prompts of 1 to 36 bytes (the byte tokenizer: one token each), all different.
PROMPTS = ["", "a", "Hi", "The ", "def f(", "x = [1, 2", "import numpy", "Once upon a ti", "SELECT",
           "for i in range(10):", "The quick brown fox jum", "lorem ipsum dolor sit amet",
           "print('hello world')\nprint(", "{\"key\": [1, 2, 3], \"other\": ", "abcabcabcabcabcabcabcabcabcabcabc",
           "In the beginning the Universe was cr"]
DEADLINE = 60.0  # Seconds any wait below gives up after (a hang fails the test instead of stalling the suite).
TOLERANCE = 1e-4  # Logprobs against float64: the decoding's float32 logits, a token at a time, against the forward's.


def _wait_for(condition, what: str) -> None:
  end = time.monotonic() + DEADLINE
  while not condition():
    if time.monotonic() > end:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.01)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("serve")
  cfg = micro_config(max_seq_len=CONTEXT)
  params = jax.jit(lambda key: model_lib.init_params(cfg.model, key))(jax.random.key(1))  # Jitted: quicker.
  params["head"]["kernel"] = params["head"]["kernel"] * 200.0
  ckpt_lib.save_params(path, cfg, params)
  return path


@pytest.fixture(scope="module")
def lm(workdir):
  return api.load(workdir)


@pytest.fixture(scope="module")
def expected(lm) -> dict[str, str]:
  """The greedy continuation of every prompt of PROMPTS by `LanguageModel.generate`: one ragged batch, in which
  each row decodes as it would alone."""
  texts = lm.generate(PROMPTS, NEW, temperature=0.0)
  assert len(set(texts)) == len(PROMPTS)  # Different continuations: a row given another's text would show.
  return dict(zip(PROMPTS, texts))


@contextlib.contextmanager
def _running(engine: Engine, name: str, **app_options):
  """The app over `engine` under uvicorn in a thread, on a socket bound to a free port of 127.0.0.1."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(create_app(engine, name, **app_options), log_level="warning",
                                         lifespan="on"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  _wait_for(lambda: server.started, "the server to start")
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(DEADLINE)
    sock.close()


@pytest.fixture(scope="module")
def server(lm):
  """(base URL, engine): 16 rows, chunks of 8 steps; prompts of up to 16 tokens prefilled whole (one length bucket,
  one group size), longer ones in pieces of 16 tokens in 4 lanes (four programs to compile)."""
  engine = Engine(lm, max_batch=SLOTS, chunk=8, max_wait_ms=50, queue=QUEUE, length_buckets=(16,),
                  group_sizes=(SLOTS,), prefill_chunk=16, prefill_lanes=4)
  engine.start()
  with _running(engine, lm.config.name) as url:
    yield url, engine


@pytest.fixture
def client(server):
  with httpx.Client(base_url=server[0], timeout=DEADLINE) as c:
    yield c


def _complete(client, **body) -> dict:
  response = client.post("/v1/completions", json=body)
  assert response.status_code == 200, response.text
  return response.json()


def _sse(lines) -> list[str]:
  """The data fields of a server-sent event stream."""
  return [line[len("data: "):] for line in lines if line.startswith("data: ")]


@contextlib.contextmanager
def _held(engine: Engine, monkeypatch):
  """Stops the scheduler before its next decode chunk until `release` is set or the block exits; yields (waiting,
  release): `waiting` is set once the scheduler waits."""
  waiting, release = threading.Event(), threading.Event()
  run_chunk = engine._run_chunk

  def held():
    waiting.set()
    release.wait()
    run_chunk()

  monkeypatch.setattr(engine, "_run_chunk", held)
  try:
    yield waiting, release
  finally:
    monkeypatch.undo()
    release.set()


def _metric(client, name: str) -> float:
  """A sample's value from /metrics (`name` with its labels other than model_name, as Prometheus writes them); 0
  before it exists."""
  lines = [re.sub(r'\{model_name="[^"]*",?', "{", line).replace("{}", "")
           for line in client.get("/metrics").text.splitlines()]
  lines = [line for line in lines if line.startswith(name + " ")]
  return float(lines[0].split(" ")[-1]) if lines else 0.0


def _compiled() -> tuple[int, ...]:
  return tuple(f._cache_size() for f in (slots_lib.admit, slots_lib.decode_chunk, slots_lib.feed_lanes,
                                         slots_lib.place))


def _recording(engine: Engine, monkeypatch, *names: str) -> list[tuple[str, object]]:
  """Records the engine's calls of the methods `names` in order, as (name, first argument)."""
  calls = []
  for name in names:
    method = getattr(engine, name)

    def recorded(*args, _name=name, _method=method):
      calls.append((_name, args[0] if args else None))
      return _method(*args)
    monkeypatch.setattr(engine, name, recorded)
  return calls


def test_greedy_completions_equal_generate_alone_and_sixteen_together(server, lm, expected, client):
  url, engine = server
  compiled = _compiled()
  alone = _complete(client, model=lm.config.name, prompt=PROMPTS[9], max_tokens=NEW, temperature=0)
  assert alone["choices"][0]["text"] == expected[PROMPTS[9]]
  assert alone["object"] == "text_completion" and alone["model"] == lm.config.name
  assert alone["usage"]["prompt_tokens"] == len(PROMPTS[9])
  assert alone["choices"][0]["finish_reason"] in ("stop", "length")

  async def together():
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      return await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": NEW,
                                                                    "temperature": 0}) for p in PROMPTS])

  answers = asyncio.run(together())
  assert [a.status_code for a in answers] == [200] * len(PROMPTS)
  assert [a.json()["choices"][0]["text"] for a in answers] == [expected[p] for p in PROMPTS]
  assert _compiled() == compiled  # Every program was compiled at start-up.
  assert _metric(client, "ltm_batch_slots") == SLOTS


def test_sampled_tokens_do_not_depend_on_neighbours(server, lm, client):
  url, _ = server
  body = {"prompt": "Once upon", "max_tokens": NEW, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 11}
  alone = _complete(client, **body)["choices"][0]["text"]
  assert alone == lm.generate("Once upon", NEW, temperature=0.9, top_k=40, top_p=0.95, seed=11)

  async def crowd():
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      others = [c.post("/v1/completions", json={"prompt": p, "max_tokens": NEW, "temperature": 1.5, "seed": i})
                for i, p in enumerate(PROMPTS[:7])]
      return await asyncio.gather(c.post("/v1/completions", json=body), *others)

  answers = asyncio.run(crowd())
  assert answers[0].json()["choices"][0]["text"] == alone
  other = _complete(client, **{**body, "seed": 12})["choices"][0]["text"]
  assert other != alone  # The seed matters.


def test_a_top_k_past_the_vocabulary_filters_nothing_and_fails_no_neighbour(server, lm):
  """A top_k at or above the vocabulary keeps every token, however large: one past int32 samples as no top_k does,
  and the requests admitted beside it are served."""
  url, _ = server
  body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0.9, "seed": 5}

  async def together():
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      return await asyncio.gather(c.post("/v1/completions", json={**body, "top_k": 2**40}),
                                  c.post("/v1/completions", json=body),
                                  c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "temperature": 0}))

  answers = asyncio.run(together())
  assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
  texts = [r.json()["choices"][0]["text"] for r in answers[:2]]
  assert texts == [lm.generate("Once upon", 8, temperature=0.9, seed=5)] * 2


def test_streaming_joins_to_the_answer_and_ends_with_done(server, expected, client):
  body = {"prompt": ["The ", "Hi"], "max_tokens": NEW, "temperature": 0}
  whole = _complete(client, **body)
  with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as response:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse(response.iter_lines())
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  texts, finish = ["", ""], [None, None]
  for chunk in chunks[:-1]:
    (choice,) = chunk["choices"]
    assert finish[choice["index"]] is None  # Nothing after a choice's last chunk.
    texts[choice["index"]] += choice["text"]
    finish[choice["index"]] = choice["finish_reason"]
  assert texts == [c["text"] for c in whole["choices"]] == [expected["The "], expected["Hi"]]
  assert finish == [c["finish_reason"] for c in whole["choices"]]
  assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_stop_strings_end_the_text_streamed_or_not(server, lm, expected, client):
  stop = expected["SELECT"][9:11]
  cut = expected["SELECT"][:expected["SELECT"].find(stop)]
  body = {"prompt": "SELECT", "max_tokens": NEW, "temperature": 0, "stop": [stop, "\x00never"]}
  assert cut.isascii()  # One token per character: the tokens behind the text are its length.
  whole = _complete(client, **body)
  answer = whole["choices"][0]
  assert (answer["text"], answer["finish_reason"]) == (cut, "stop")
  assert lm.generate("SELECT", NEW, temperature=0.0, stop=body["stop"]) == cut  # The same stop strings, in the API.
  assert whole["usage"]["completion_tokens"] == len(cut)  # Not the tokens drawn up to the chunk's end.
  options = {"include_usage": True, "continuous_usage_stats": True}
  with client.stream("POST", "/v1/completions", json={**body, "stream": True, "stream_options": options}) as response:
    chunks = [json.loads(e) for e in _sse(response.iter_lines())[:-1]]
  assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == cut
  counts = [c["usage"]["completion_tokens"] for c in chunks]
  assert counts == sorted(counts) and counts[-1] == len(cut)
  assert all(c["usage"]["completion_tokens"] == len(text) for c, text in zip(
      chunks, itertools.accumulate(c["choices"][0]["text"] for c in chunks if c["choices"])))


def test_a_disconnect_frees_the_row(server, client, monkeypatch):
  url, engine = server
  cancelled = _metric(client, 'ltm_finished_requests_total{reason="cancelled"}')
  with _held(engine, monkeypatch) as (waiting, _):
    stream = httpx.Client(base_url=url, timeout=DEADLINE)
    with stream.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 40, "stream": True}) as r:
      assert r.status_code == 200
      waiting.wait(DEADLINE)
      assert engine.occupancy == 1
    stream.close()  # Gone before its first token.
    _wait_for(lambda: all(row is None or row.request.cancelled for row in engine._rows), "the request's cancellation")
  _wait_for(lambda: engine.occupancy == 0, "the row to be freed")
  assert _metric(client, 'ltm_finished_requests_total{reason="cancelled"}') == cancelled + 1
  assert client.get("/health").json()["occupancy"] == 0


def test_a_client_gone_before_its_body_arrived_is_counted_as_499_not_an_error(server, client, caplog):
  """A connection closed halfway through the body it announced: no request, no server error logged, one 499."""
  url, _ = server
  before = _metric(client, 'ltm_requests_total{status="499"}')
  server_log = logging.getLogger("uvicorn.error")  # Where uvicorn logs an application's exception; not propagated.
  server_log.addHandler(caplog.handler)
  try:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
      sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    _wait_for(lambda: _metric(client, 'ltm_requests_total{status="499"}') == before + 1, "the request to be counted")
  finally:
    server_log.removeHandler(caplog.handler)
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_a_full_queue_answers_429_and_cancelled_requests_leave_it_at_once(server, client, monkeypatch):
  url, engine = server
  too_many = client.post("/v1/completions", json={"prompt": ["q"] * (QUEUE + 1), "max_tokens": 2})
  assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"  # It could never fit.

  async def flood(waiting, release):
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      body = {"prompt": "q", "max_tokens": 2, "temperature": 0}
      first = asyncio.ensure_future(c.post("/v1/completions", json=body))
      await asyncio.to_thread(waiting.wait, DEADLINE)  # It holds a row; the scheduler is stopped.
      queued = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(QUEUE)]
      await asyncio.to_thread(_wait_for, lambda: engine.queue_depth == QUEUE, "a full queue")
      refused = await c.post("/v1/completions", json=body)
      depth = _metric(client, "ltm_queue_depth")
      for request in queued[:3]:
        request.cancel()  # The clients go away while their requests wait.
      await asyncio.to_thread(_wait_for, lambda: engine.queue_depth == QUEUE - 3, "cancelled requests to leave")
      taken = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(3)]
      await asyncio.to_thread(_wait_for, lambda: engine.queue_depth == QUEUE, "their places to be taken")
      release.set()
      return refused, depth, await asyncio.gather(first, *queued[3:], *taken)

  with _held(engine, monkeypatch) as (waiting, release):
    refused, depth, served = asyncio.run(flood(waiting, release))
  assert refused.status_code == 429
  assert refused.json()["error"]["code"] == "queue_full"
  assert depth == QUEUE
  assert [r.status_code for r in served] == [200] * (QUEUE + 1)
  texts = {r.json()["choices"][0]["text"] for r in served}
  assert len(texts) == 1  # Greedy: every answer to the same prompt is the same.
  assert _complete(client, prompt="q", max_tokens=2, temperature=0)["choices"][0]["text"] in texts


BAD_REQUESTS = [  # (body: a dict sent as JSON or raw bytes, the status, the field blamed)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"\xff\xfe", 400, None),
    (b'{"prompt": "hi", "temperature": NaN}', 400, None),
    (b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", 400, None),  # Deeper than json's recursion limit.
    (b'{"prompt": "\\ud800"}', 400, None),  # A lone surrogate: not text.
    (b'{"prompt": "hi", "\\udfff": 1}', 400, None),
    ({"prompt": "hi", "temperature": 10**400}, 400, "temperature"),  # An integer beyond float's range.
    ({"prompt": "hi", "top_p": -10**400}, 400, "top_p"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", 1]}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"prompt": "x" * CONTEXT}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": CONTEXT - 1}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": 0}, 400, "top_k"),
    ({"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ({"prompt": "hi", "stop": 7}, 400, "stop"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": "2"}, 400, "n"),
    ({"prompt": "hi", "n": QUEUE + 1}, 400, "n"),
    ({"prompt": "hi", "n": 10**9}, 400, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (b"{" + b" " * (1 << 20) + b"}", 413, None),
]


def test_bad_requests_get_their_4xx_and_the_server_keeps_serving(server, client):
  for body, status, param in BAD_REQUESTS:
    if isinstance(body, dict):
      response = client.post("/v1/completions", json=body)
    else:
      response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, (body if len(body) < 100 else "big", response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert error["param"] == param and error["type"]
  assert client.get("/v1/completions").status_code == 405
  assert client.post("/v1/nothing", json={}).json()["error"]["type"] == "not_found_error"
  assert _complete(client, prompt="still here", max_tokens=3)["usage"]["completion_tokens"] <= 3
  assert client.get("/health").json()["status"] == "ok"


def test_the_openai_client_can_call_the_server(server, lm, expected):
  url, _ = server
  client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
  assert [m.id for m in client.models.list()] == [lm.config.name]
  answer = client.completions.create(model=lm.config.name, prompt="def f(", max_tokens=NEW, temperature=0)
  assert answer.choices[0].text == expected["def f("]
  assert answer.usage.prompt_tokens == 6
  pieces = client.completions.create(model=lm.config.name, prompt="def f(", max_tokens=NEW, temperature=0,
                                     stream=True)
  assert "".join(p.choices[0].text for p in pieces if p.choices) == answer.choices[0].text
  with pytest.raises(openai.BadRequestError, match="max_tokens"):
    client.completions.create(model=lm.config.name, prompt="x", max_tokens=0)
  scored = client.completions.create(model=lm.config.name, prompt="def f(", max_tokens=4, temperature=0, n=2,
                                     logprobs=2)
  assert [c.index for c in scored.choices] == [0, 1] and scored.choices[0].text == expected["def f("][:4]
  assert len(scored.choices[1].logprobs.token_logprobs) == 4 and len(scored.choices[1].logprobs.top_logprobs[0]) >= 2
  chat = client.chat.completions.create(model=lm.config.name, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4, logprobs=True, top_logprobs=2)
  assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_metrics_count_what_the_answers_say(server, client):
  names = ('ltm_requests_total{status="200"}', "ltm_generated_tokens_total", "ltm_prompt_tokens_total",
           'ltm_finished_requests_total{reason="length"}', "ltm_time_per_output_token_seconds_count",
           "ltm_time_per_output_token_seconds_sum", "ltm_decode_chunk_seconds_count", "ltm_decode_chunk_seconds_sum",
           "ltm_time_to_first_token_seconds_count", "ltm_decode_steps_total", "ltm_admission_seconds_count",
           "ltm_admission_seconds_sum")
  before = {name: _metric(client, name) for name in names}
  answer = _complete(client, prompt="Hi", max_tokens=8, temperature=0)  # One chunk of 8 steps.
  # The answer leaves as its last token is handed out; the chunk is counted once the scheduler has it back.
  _wait_for(lambda: server[1].occupancy == 0, "the chunk to end")
  delta = {name: _metric(client, name) - before[name] for name in names}
  assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
  assert answer["choices"][0]["finish_reason"] == "length"
  assert delta['ltm_requests_total{status="200"}'] == 1
  assert delta["ltm_generated_tokens_total"] == 8 and delta["ltm_prompt_tokens_total"] == 2
  assert delta['ltm_finished_requests_total{reason="length"}'] == 1
  assert delta["ltm_time_to_first_token_seconds_count"] == 1
  assert delta["ltm_decode_chunk_seconds_count"] == 1 and delta["ltm_time_per_output_token_seconds_count"] == 1
  assert delta["ltm_decode_steps_total"] == 8
  assert delta["ltm_admission_seconds_count"] == 1 and delta["ltm_admission_seconds_sum"] > 0
  # Eight tokens streamed from one chunk are timed as each reached the host: their 7 gaps lie within the chunk
  # (0 if the tokens were timed when the chunk handed them out together).
  assert 0 < delta["ltm_time_per_output_token_seconds_sum"] <= delta["ltm_decode_chunk_seconds_sum"] / 7
  assert _metric(client, "ltm_compiled_programs") == server[1].programs == 4
  samples = [line for line in client.get("/metrics").text.splitlines() if line.startswith("ltm_")]
  assert samples and all('model_name="micro"' in line for line in samples)  # Every sample names the model.
  with pytest.raises(ValueError, match="the engine serves its model as 'micro', which labels its metrics"):
    create_app(server[1], "other")


def test_a_row_times_each_token_when_it_was_drawn_and_counts_the_tokens_it_returns(lm):
  row = engine_lib._Row(engine_lib.Request(np.array([1], np.int32), 16, lambda event: None), lm.tokenizer)
  tokens = np.frombuffer(b"abcdefgh", np.uint8).astype(np.int32)
  assert row.add(tokens, lm.tokenizer.eos_id, np.arange(1.0, 9.0), 8.0) is None  # Tokens at 1, 2, ..., 8 s.
  assert row.add(tokens, lm.tokenizer.eos_id, np.arange(11.0, 19.0), 18.0) == "length"  # At 11, ..., 18 s.
  assert row.time_per_token() == pytest.approx(17 / 15)
  stopped = engine_lib._Row(engine_lib.Request(np.array([1], np.int32), 16, lambda event: None, stop=("cd",)),
                            lm.tokenizer)
  assert stopped.add(tokens, lm.tokenizer.eos_id, np.arange(1.0, 9.0), 8.0) == "stop"
  assert (stopped.text, stopped.produced, stopped.returned) == ("ab", 8, 2)
  assert stopped.time_per_token() == pytest.approx(1.0)


def test_text_streams_token_by_token(server, lm, expected):
  """With stream_steps (the server's default), each decode step's token reaches its request as its own piece of
  text (a multi-byte character waits for its last byte), not a chunk's tokens at once."""
  _, engine = server
  pieces, done = [], threading.Event()

  def receive(event):
    if isinstance(event, engine_lib.Piece):
      pieces.append(event)
    else:
      done.set()

  prompt = PROMPTS[3]
  engine.submit([engine_lib.Request(lm.encode(prompt), NEW, receive, temperature=0.0)])
  assert done.wait(DEADLINE)
  assert "".join(p.text for p in pieces) == expected[prompt]
  counts = [0] + [p.tokens for p in pieces]
  assert counts[-1] == NEW and max(np.diff(counts)) <= 4 < engine.chunk, counts  # A UTF-8 character: 1-4 bytes.


def test_pieces_queued_together_are_joined_into_one_event_before_the_finish():
  pieces = [engine_lib.Piece("ab", 2), engine_lib.Piece("c", 3), engine_lib.Piece("de", 5)]
  finished = engine_lib.Finished("length", 1, 5)
  assert app_lib._coalesced(pieces + [finished]) == [engine_lib.Piece("abcde", 5), finished]
  assert app_lib._coalesced([finished]) == [finished]


def test_static_batches_run_each_batch_to_completion_before_the_next(lm, expected):
  """Three greedy requests for two rows: the third waits for the whole first batch, including its longer request
  (continuous batching would give it the row of the shorter one); the longer answer is still `lm.generate`'s, with
  text handed out at the chunks' ends (stream_steps off), and its logprobs (asked for) are the float64 reference's."""
  engine = Engine(lm, max_batch=2, chunk=8, max_wait_ms=50, length_buckets=(16,), group_sizes=(2,), prefill_chunk=16,
                  prefill_lanes=1, static_batches=True, stream_steps=False)
  engine.start()
  events, texts = [], collections.defaultdict(str)

  def emit(i):
    def receive(event):
      events.append((i, event))
      texts[i] += getattr(event, "text", "")
    return receive

  prompts, budgets = PROMPTS[3:6], (8, NEW, 8)
  try:
    engine.submit([engine_lib.Request(lm.encode(p), n, emit(i), temperature=0.0, logprobs=2 if i == 1 else None)
                   for i, (p, n) in enumerate(zip(prompts, budgets))])
    _wait_for(lambda: sum(isinstance(e, engine_lib.Finished) for _, e in events) == 3, "three requests to finish")
  finally:
    engine.stop(DEADLINE)
  order = [i for i, _ in events]
  last_of_first_batch = max(k for k, (i, e) in enumerate(events) if i in (0, 1) and isinstance(e, engine_lib.Finished))
  assert order.index(2) > last_of_first_batch, order
  assert texts[1] == expected[prompts[1]]
  entries = [entry for i, e in events if i == 1 and isinstance(e, engine_lib.Piece) for entry in e.logprobs]
  ids = _greedy_ids(lm, lm.encode(prompts[1]), len(entries))
  (finished,) = [e for i, e in events if i == 1 and isinstance(e, engine_lib.Finished)]
  assert [entry.token for entry in entries] == list(ids) and len(ids) == finished.completion_tokens
  reference = _reference_logprobs(lm, lm.encode(prompts[1]), ids)
  np.testing.assert_allclose([entry.logprob for entry in entries], reference[np.arange(len(ids)), ids],
                             atol=TOLERANCE)
  assert [[t for t, _ in entry.top] for entry in entries] == np.argsort(-reference)[:, :2].tolist()
  assert not any(e.logprobs for i, e in events if i != 1 and isinstance(e, engine_lib.Piece))


def test_requests_join_mid_decode_one_budget_of_prompt_tokens_per_round(lm, expected):
  """With a prefill budget of one 16-token bucket, six greedy requests that arrive while another decodes are
  admitted one per round, with a short decode chunk between rounds while any wait; every text is still
  `lm.generate`'s, groups are never padded, and nothing compiles after start-up."""
  engine = Engine(lm, max_batch=8, chunk=8, max_wait_ms=0, length_buckets=(16,), group_sizes=(1, 4),
                  prefill_chunk=16, prefill_lanes=1, prefill_budget=16)
  assert engine.waiting_chunk == 2
  engine.start()
  compiled = _compiled()
  groups, chunks = [], []
  admit_group, decode = engine._admit_group, engine._decode

  def recorded_admit_group(group, length):
    groups.append((len(group), group.count(None)))  # (group size, padding entries)
    return admit_group(group, length)

  def recorded_decode(active, steps):
    chunks.append(steps)
    return decode(active, steps)

  engine._admit_group, engine._decode = recorded_admit_group, recorded_decode
  texts, finished = collections.defaultdict(str), threading.Semaphore(0)

  def emit(prompt):
    def receive(event):
      texts[prompt] += getattr(event, "text", "")
      if isinstance(event, engine_lib.Finished):
        finished.release()
    return receive

  first, joining = PROMPTS[7], PROMPTS[1:7]  # 14 tokens, then 1 to 12 tokens: one bucket of 16 each.
  try:
    engine.submit([engine_lib.Request(lm.encode(first), NEW, emit(first), temperature=0.0)])
    _wait_for(lambda: texts[first], "the first request to decode")
    engine.submit([engine_lib.Request(lm.encode(p), NEW, emit(p), temperature=0.0) for p in joining])
    for _ in range(1 + len(joining)):
      assert finished.acquire(timeout=DEADLINE)
  finally:
    engine.stop(DEADLINE)
  assert {p: texts[p] for p in [first, *joining]} == {p: expected[p] for p in [first, *joining]}
  assert groups == [(1, 0)] * (1 + len(joining))  # One request a round, in a group of its own.
  assert set(chunks) <= {2, 8} and chunks.count(2) >= len(joining) - 1, chunks
  assert _compiled() == compiled


def test_a_long_prompt_is_prefilled_in_pieces_while_another_request_decodes(server, expected, client, monkeypatch):
  _, engine = server
  calls = _recording(engine, monkeypatch, "_feed_lanes", "_place", "_decode")
  short, long = PROMPTS[3], PROMPTS[15]  # 4 and 36 tokens: the long one is fed as 4 + 16 + 16.
  answer = _complete(client, prompt=[short, long], max_tokens=NEW, temperature=0)
  assert [c["text"] for c in answer["choices"]] == [expected[short], expected[long]]
  names = [name for name, _ in calls]
  pieces = [[len(ids) for ids, _ in argument.values()] for name, argument in calls if name == "_feed_lanes"]
  assert pieces == [[4], [16], [16]]
  placed = names.index("_place")
  # The short request decoded between the pieces, and the long one joined its batch mid-decode.
  assert names[:placed] == ["_feed_lanes", "_decode", "_feed_lanes", "_decode", "_feed_lanes"]
  assert names[placed + 1:].count("_decode") >= 1


def test_a_failure_is_an_http_error_or_an_error_event_never_a_finish_reason(server, client, monkeypatch):
  _, engine = server

  def broken(active, steps):
    raise RuntimeError("the device went away")

  monkeypatch.setattr(engine, "_decode", broken)
  with client.stream("POST", "/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 4,
                                                      "stream": True}) as response:
    events = _sse(response.iter_lines())
  assert events[-1] == "[DONE]"
  bodies = [json.loads(e) for e in events[:-1]]
  assert "the device went away" in bodies[-1]["error"]["message"]
  assert all(c["finish_reason"] in (None, "stop", "length") for b in bodies[:-1] for c in b["choices"])
  failed = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
  assert failed.status_code == 500 and "the device went away" in failed.json()["error"]["message"]
  monkeypatch.undo()
  assert _complete(client, prompt="ab", max_tokens=4)["usage"]["completion_tokens"] <= 4  # Serving again.


def test_a_failure_to_hand_out_text_fails_the_requests_and_serving_goes_on(server, client, monkeypatch):
  _, engine = server

  def broken(*args):
    raise UnicodeError("text went wrong")

  monkeypatch.setattr(engine, "_hand_out", broken)
  failed = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
  assert failed.status_code == 500 and "text went wrong" in failed.json()["error"]["message"]
  monkeypatch.undo()
  assert _complete(client, prompt="ab", max_tokens=4)["usage"]["completion_tokens"] <= 4


def _finished(engine: Engine) -> collections.Counter:
  """The engine's finished prompts by reason, from its metrics."""
  counts = collections.Counter()
  for line in engine.metrics.render()[0].decode().splitlines():
    if line.startswith("ltm_finished_requests_total{"):
      counts[line.split('reason="')[1].split('"')[0]] += float(line.split(" ")[-1])
  return counts


def test_the_request_timeout_cancels_and_answers_504_or_an_error_event(server, lm, monkeypatch):
  """A request that holds a row and two prompts that wait in the queue time out: 504 and an error event, and each
  of the three prompts is counted once, as a timeout."""
  _, engine = server
  before = _finished(engine)
  with _running(engine, lm.config.name, request_timeout=0.5, stop_engine_on_shutdown=False) as url, \
      httpx.Client(base_url=url, timeout=DEADLINE) as client, _held(engine, monkeypatch) as (waiting, _):
    answered = {status: _metric(client, f'ltm_requests_total{{status="{status}"}}') for status in ("200", "504")}
    started = time.monotonic()
    late = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8})
    assert late.status_code == 504 and late.json()["error"]["code"] == "timeout"
    assert 0.5 <= time.monotonic() - started < DEADLINE / 2
    assert waiting.is_set()  # It held a row, which the scheduler frees at its next chunk.
    with client.stream("POST", "/v1/completions", json={"prompt": ["abc", "de"], "max_tokens": 8,
                                                        "stream": True}) as response:
      events = _sse(response.iter_lines())
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "timeout"
    assert engine.queue_depth == 0  # The streamed ones waited in the queue, and left it when cancelled.
    answered = {status: _metric(client, f'ltm_requests_total{{status="{status}"}}') - count
                for status, count in answered.items()}
  _wait_for(lambda: engine.occupancy == 0, "the timed-out request's row to be freed")
  assert _finished(engine) - before == {"timeout": 3}
  assert answered == {"200": 0, "504": 2}  # Each request once, the streamed one by how its stream ended.


CHAT_BAD = [  # (messages, a part of the message)
    (None, "messages must be"),
    ([], "messages must be"),
    ("hi", "messages must be"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"role": "tool", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "tool_calls"),
    ([{"role": "user", "content": "hi", "name": 0}], "messages[0].name"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "the last message"),
    ([{"role": "user", "content": "x" * CONTEXT}], "context"),
]
CHAT_BAD_FIELDS = [  # (fields besides valid messages, the field blamed)
    ({"n": 1.5}, "n"), ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"user": 0}, "user"),
]


def test_chat_messages_are_checked_and_put_in_the_documented_turn_format(server, client):
  messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi\r\n\n\nthere"},
              {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}, {"role": "user", "content": "?"}]
  assert protocol.chat_prompt(messages) == ("System: Be brief.\n\nUser: Hi\nthere\n\nAssistant: Hello\n\n"
                                            "User: ?\n\nAssistant:")
  for messages, part in CHAT_BAD:
    response = client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400, (messages, response.text)
    error = response.json()["error"]
    assert part in error["message"] and "\n" not in error["message"] and error["param"] == "messages", error
  for fields, param in CHAT_BAD_FIELDS:
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, (fields, response.text)
  # Optional fields may be null, as in OpenAI's API.
  response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "name": None}],
                                                       "user": None, "max_tokens": 2})
  assert response.status_code == 200, response.text


def test_chat_completions_answer_what_the_template_prompt_continues_to(server, lm, client):
  messages = [{"role": "user", "content": "Hi"}]
  prompt = "User: Hi\n\nAssistant:"
  reference = _complete(client, prompt=prompt, max_tokens=NEW, temperature=0, stop=["\n\nUser:"])
  body = {"model": lm.config.name, "messages": messages, "max_tokens": NEW, "temperature": 0}
  response = client.post("/v1/chat/completions", json=body)
  assert response.status_code == 200, response.text
  answer = response.json()
  (choice,) = answer["choices"]
  assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
  assert choice["message"]["content"] == reference["choices"][0]["text"].lstrip()
  assert choice["finish_reason"] == reference["choices"][0]["finish_reason"]
  assert answer["usage"] == reference["usage"] and answer["usage"]["prompt_tokens"] == len(prompt)
  with client.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as streamed:
    chunks = [json.loads(e) for e in _sse(streamed.iter_lines())[:-1]]
  assert all(c["object"] == "chat.completion.chunk" for c in chunks)
  deltas = [c["choices"][0] for c in chunks if c["choices"]]
  assert deltas[0]["delta"]["role"] == "assistant"
  assert "".join(d["delta"].get("content", "") for d in deltas) == choice["message"]["content"]
  assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + [choice["finish_reason"]]
  assert chunks[-1]["usage"] == answer["usage"]
  official = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
  reply = official.chat.completions.create(model=lm.config.name, messages=messages, max_tokens=NEW, temperature=0)
  assert reply.choices[0].message.content == choice["message"]["content"]


def test_a_latent_model_infers_each_requests_z_from_its_own_prompt():
  cfg = micro_config(max_seq_len=CONTEXT, n_layers=1, layer_pattern="A")  # One layer: a quicker compile.
  lm = api.build(dataclasses.replace(cfg, latent=LatentConfig(enabled=True, n_per_layer=2, inner_steps=2)), seed=2)
  lm.params["head"]["kernel"] = lm.params["head"]["kernel"] * 200.0
  prompts = ["abcdef", "uvwxyz"]  # One length: the references share their compilations.
  # generate fits z to a prompt alone, from the latent half of the seed's key, as each request's own z must be.
  expected = [lm.generate(p, 12, temperature=0.0, seed=i) for i, p in enumerate(prompts)]
  assert expected[0] != expected[1]
  engine = Engine(lm, max_batch=2, chunk=8, max_wait_ms=200, length_buckets=(CONTEXT,), group_sizes=(2,),
                  model_name="latent")
  engine.start()

  async def together(url):
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      return await asyncio.gather(*[c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                                    "seed": i}) for i, p in enumerate(prompts)])

  with _running(engine, "latent") as url:
    answers = asyncio.run(together(url))
  assert [a.json()["choices"][0]["text"] for a in answers] == expected


def test_cli_refuses_an_address_it_cannot_listen_on_before_loading(workdir, capsys):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert cli.main(["serve", "--workdir", str(workdir), "--port", str(port)]) == 2
  assert f"error: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
  assert cli.main(["serve", "--workdir", str(workdir), "--port", "70000"]) == 2
  assert "--port must be in [0, 65535], got 70000" in capsys.readouterr().err


def test_each_request_gets_one_access_line_at_info(server, client, caplog):
  """An answered request's line has its status, usage and finish reason; a refused one its error; /health and
  /metrics are logged at DEBUG only."""
  caplog.set_level(logging.INFO, logger="ltm_jax.serve.access")
  _complete(client, prompt="Hi", max_tokens=4, temperature=0)
  client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
  client.get("/health")
  lines = lambda: [r.getMessage() for r in caplog.records if r.name == "ltm_jax.serve.access"]
  _wait_for(lambda: len(lines()) >= 2, "two access lines")  # Written once each answer has been sent.
  answered, refused = lines()[:2]
  assert re.fullmatch(r'127\.0\.0\.1:\d+ "POST /v1/completions" 200 \d+\.\d{3}s prompt_tokens=2 completion_tokens=4 '
                      r'finish_reason=length', answered), answered
  assert refused.startswith('127.0.0.1:') and '"POST /v1/completions" 400 ' in refused
  assert refused.endswith('error="max_tokens must be an integer >= 1, got 0"'), refused
  assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "ltm_jax.serve.access")
  assert not any("/health" in line for line in lines())


def test_the_start_line_names_the_weights_served(workdir, capsys, monkeypatch, tmp_path):
  """`ltm serve --quantize int4` says so on its start line, with the group size, the weights kept at int8 and the
  parameters' size; the compilation cache is set up (--compilation-cache, default None: JAX's folder or the user's
  cache) before the model is loaded. The engine's compilation, the server and the cache's global setting are stubbed
  out: the line and the order of the calls are what is tested."""
  monkeypatch.setattr(engine_lib.Engine, "start", lambda self: None)
  calls = []
  monkeypatch.setattr(app_lib, "serve", lambda engine, **options: calls.append(("serve", engine, options)) or 0)
  monkeypatch.setattr(compilation_cache, "use", lambda folder: calls.append(("cache", folder)))
  load = api.load
  monkeypatch.setattr(api, "load", lambda *args: calls.append(("load",)) or load(*args))
  for flags, weights in ((["--quantize", "int4", "--quantize-group", "8", "--quantize-keep-int8", "head"],
                          r"int4 weights in groups of 8, head at int8, \d+\.\d\d MiB"),
                         (["--quantize", "int8"], r"int8 weights, \d+\.\d\d MiB"), ([], r"float weights, \d+\.\d\d MiB")):
    assert cli.main(["serve", "--workdir", str(workdir), "--port", "0", *flags]) == 0
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"serving micro \(step 0, {weights}\) on http://127\.0\.0\.1:0: 32 slots, \d+ programs "
                        r"compiled in 0\.0s", line), line
  _, engine, options = calls[2]
  assert engine.model_name == "micro" and engine.lm.quantized and options["log_level"] == "info"
  assert [c[:2] if c[0] == "cache" else c[:1] for c in calls[:3]] == [("cache", None), ("load",), ("serve",)]
  assert cli.main(["serve", "--workdir", str(workdir), "--port", "0", "--compilation-cache", str(tmp_path)]) == 0
  assert calls[-3] == ("cache", str(tmp_path))


def test_n_choices_each_sample_with_a_seed_of_their_own(server, lm, client):
  """n choices per prompt, indexed prompt * n + choice, the k-th sampled as `lm.generate` samples with seed + k;
  usage counts each prompt once and every choice's tokens; streamed, the choices join to the same texts; chat
  answers n messages."""
  body = {"prompt": ["Once upon", "Hi"], "max_tokens": NEW, "temperature": 0.9, "seed": 5, "n": 2}
  answer = _complete(client, **body)
  texts = [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
  assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
  assert texts == [lm.generate(p, NEW, temperature=0.9, seed=5 + k)
                   for k, p in enumerate(["Once upon", "Once upon", "Hi", "Hi"])]
  assert texts[0] != texts[1]  # Two samples, not one repeated.
  used = answer["usage"]
  assert used["prompt_tokens"] == len("Once upon") + len("Hi")
  drawn = [lm.generate_tokens([lm.encode(p)], NEW, key=jax.random.key(5 + k), temperature=0.9)[0]
           for k, p in enumerate(["Once upon", "Once upon", "Hi", "Hi"])]
  eos = lm.tokenizer.eos_id
  assert used["completion_tokens"] == sum(int(np.argmax(t == eos)) if eos in t else NEW for t in drawn)
  with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
    chunks = [json.loads(e) for e in _sse(response.iter_lines())[:-1]]
  streamed = ["", "", "", ""]
  for chunk in chunks:
    for choice in chunk["choices"]:
      streamed[choice["index"]] += choice["text"]
  assert streamed == texts
  chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 3,
                                                   "max_tokens": 4, "temperature": 1.5, "seed": 1})
  assert chat.status_code == 200, chat.text
  assert [c["index"] for c in chat.json()["choices"]] == [0, 1, 2]
  assert all(c["message"]["role"] == "assistant" for c in chat.json()["choices"])


def _reference_logprobs(lm, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """log_softmax in float64 of the model's logits (its full forward pass over prompt + tokens) before each of
  `tokens` -> [len(tokens), vocabulary]."""
  logits = np.asarray(lm.forward(np.concatenate([prompt, tokens])[None]), np.float64)[0, len(prompt) - 1:-1]
  logits = logits - logits.max(-1, keepdims=True)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _greedy_ids(lm, prompt: np.ndarray, count: int) -> np.ndarray:
  return lm.generate_tokens([prompt], NEW, key=jax.random.key(0), temperature=0.0)[0, :count]


def test_completion_logprobs_are_the_models_log_softmax(server, lm, client):
  """logprobs=5: each token's logprob and its five most likely alternatives are those of a float64 log_softmax of
  the model's logits over the whole sequence (before temperature: the model's own distribution); the streamed
  chunks carry the same, piece by piece."""
  body = {"prompt": "The ", "max_tokens": NEW, "temperature": 0, "logprobs": 5}
  answer = _complete(client, **body)
  (choice,) = answer["choices"]
  got = choice["logprobs"]
  prompt = lm.encode("The ")
  ids = _greedy_ids(lm, prompt, answer["usage"]["completion_tokens"])
  reference = _reference_logprobs(lm, prompt, ids)
  assert len(got["token_logprobs"]) == len(ids) == len(got["top_logprobs"]) == len(got["text_offset"]) > 0
  np.testing.assert_allclose(got["token_logprobs"], reference[np.arange(len(ids)), ids], atol=TOLERANCE)
  name = lambda token: protocol.token_text(lm.tokenizer.decode_bytes([token]), token, lm.tokenizer.eos_id)
  assert got["tokens"] == [name(t) for t in ids]
  for top, row, token in zip(got["top_logprobs"], reference, ids):
    best = np.argsort(-row)[:5]
    expected = {**{name(t): row[t] for t in best}, name(token): row[token]}
    assert top.keys() == expected.keys()
    np.testing.assert_allclose([top[k] for k in expected], list(expected.values()), atol=TOLERANCE)
  assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])
  with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
    chunks = [json.loads(e)["choices"][0] for e in _sse(response.iter_lines())[:-1]]
  streamed = [c["logprobs"] for c in chunks if c["logprobs"] is not None]
  for key in got:
    assert sum((part[key] for part in streamed), []) == got[key], key


def test_chat_logprobs_of_a_sampled_reply_with_their_bytes(server, lm, client):
  """Chat logprobs with top_logprobs=3 on a sampled reply (temperature 0.9): each token's bytes, logprob and three
  most likely alternatives, against the float64 reference; without logprobs, none."""
  body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0.9, "seed": 3}
  plain = client.post("/v1/chat/completions", json=body).json()["choices"][0]
  answer = client.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 3}).json()
  (choice,) = answer["choices"]
  assert plain["logprobs"] is None and choice["message"] == plain["message"]  # Scoring changes no token.
  content = choice["logprobs"]["content"]
  assert len(content) == answer["usage"]["completion_tokens"] > 0
  as_id = lambda item: item["bytes"][0] if item["bytes"] else lm.tokenizer.eos_id  # Byte tokenizer: one byte each.
  ids = np.array([as_id(item) for item in content])
  assert bytes(sum((item["bytes"] for item in content), [])).decode("utf-8", "replace").lstrip() == \
      choice["message"]["content"]
  reference = _reference_logprobs(lm, lm.encode("User: Hi\n\nAssistant:"), ids)
  np.testing.assert_allclose([item["logprob"] for item in content], reference[np.arange(len(ids)), ids],
                             atol=TOLERANCE)
  for item, row in zip(content, reference):
    assert [as_id(top) for top in item["top_logprobs"]] == list(np.argsort(-row)[:3])
    np.testing.assert_allclose([top["logprob"] for top in item["top_logprobs"]], np.sort(row)[::-1][:3],
                               atol=TOLERANCE)


@pytest.mark.parametrize("context, prefill_chunk, programs", [(256, 128, 19), (1024, 128, 19), (256, None, 21),
                                                               (1024, None, 29)])
def test_the_programs_compiled_are_those_the_docs_count(context, prefill_chunk, programs):
  """docs/serving.md's counts for 32 rows: 19 at the default --prefill-chunk 128 for any context past 129 tokens (4
  group sizes x 4 length buckets, the decode chunk, feed_lanes and place); with whole prompts, 21 for a context of
  256 (4 x 5 + 1) and 29 for 1024 (4 x 7 + 1). Nothing is compiled here: the engine counts what `start` would."""
  lm = api.LanguageModel(micro_config(max_seq_len=context), None)
  assert Engine(lm, max_batch=32, prefill_chunk=prefill_chunk).programs == programs


def test_the_access_lines_are_written_once_on_stderr(capsys, monkeypatch):
  """`serve`'s logging set-up writes each access line once on stderr, even where the root logger has a handler of
  its own (as some library may have set up)."""
  logger = logging.getLogger("ltm_jax.serve")
  monkeypatch.setattr(logger, "handlers", [])
  monkeypatch.setattr(logger, "propagate", True)
  monkeypatch.setattr(logger, "level", logger.level)
  monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler()])  # Binds stderr as captured.
  from ltm_jax.serve import access
  access.configure("info")
  access.LOGGER.info('127.0.0.1:1 "POST /v1/completions" 200 0.001s')
  assert capsys.readouterr().err.count('"POST /v1/completions" 200') == 1
