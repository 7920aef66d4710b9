"""`ltm serve` over real HTTP on 127.0.0.1: completions equal `LanguageModel.generate`, alone and in a crowd;
streaming; stop strings; a disconnect frees its row; 429 on a full queue; OpenAI-style 4xx for bad requests; the
official `openai` client; a latent model's z fitted per request; the CLI's refusal of an address it cannot use.

The model is a micro hybrid (RWKV-4 + attention, context 64) saved to a workdir from its initialisation with the head
scaled up, as tests/test_generate.py does: random init gives near-uniform logits, and spread logits make greedy
choices decided by the model rather than by rounding (a barely trained model would mostly repeat one character,
which would hide a wrong row or position). One server, started once, serves most tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time

import httpx
import jax
import openai
import pytest
import uvicorn

from conftest import micro_config
from ltm_jax import api, cli
from ltm_jax import model as model_lib
from ltm_jax.config import LatentConfig
from ltm_jax.serve import Engine
from ltm_jax.serve import slots as slots_lib
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
def _running(engine: Engine, name: str):
  """The app over `engine` under uvicorn in a thread, on a socket bound to a free port of 127.0.0.1."""
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(create_app(engine, name), log_level="warning", lifespan="on"))
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
  """(base URL, engine): 16 rows, chunks of 8 steps, two prompt-length buckets and one prefill group size (three
  programs to compile)."""
  engine = Engine(lm, max_batch=SLOTS, chunk=8, max_wait_ms=50, queue=QUEUE, length_buckets=(16, CONTEXT),
                  group_sizes=(SLOTS,))
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
  """A sample's value from /metrics (`name` with its labels, as Prometheus writes them); 0 before it exists."""
  lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " ")]
  return float(lines[0].split(" ")[-1]) if lines else 0.0


def _compiled() -> tuple[int, int]:
  return slots_lib.admit._cache_size(), slots_lib.decode_chunk._cache_size()


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


def test_stop_strings_end_the_text_streamed_or_not(server, expected, client):
  stop = expected["SELECT"][9:11]
  cut = expected["SELECT"][:expected["SELECT"].find(stop)]
  body = {"prompt": "SELECT", "max_tokens": NEW, "temperature": 0, "stop": [stop, "\x00never"]}
  answer = _complete(client, **body)["choices"][0]
  assert (answer["text"], answer["finish_reason"]) == (cut, "stop")
  with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
    chunks = [json.loads(e) for e in _sse(response.iter_lines())[:-1]]
  assert "".join(c["choices"][0]["text"] for c in chunks) == cut


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


def test_a_full_queue_answers_429(server, client, monkeypatch):
  url, engine = server

  async def flood(waiting, release):
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as c:
      body = {"prompt": "q", "max_tokens": 2, "temperature": 0}
      first = asyncio.ensure_future(c.post("/v1/completions", json=body))
      await asyncio.to_thread(waiting.wait, DEADLINE)  # It holds a row; the scheduler is stopped.
      queued = [asyncio.ensure_future(c.post("/v1/completions", json=body)) for _ in range(QUEUE)]
      await asyncio.to_thread(_wait_for, lambda: engine.queue_depth == QUEUE, "a full queue")
      refused = await c.post("/v1/completions", json=body)
      depth = _metric(client, "ltm_queue_depth")
      release.set()
      return refused, depth, await asyncio.gather(first, *queued)

  with _held(engine, monkeypatch) as (waiting, release):
    refused, depth, served = asyncio.run(flood(waiting, release))
  assert refused.status_code == 429
  assert refused.json()["error"]["code"] == "queue_full"
  assert depth == QUEUE
  assert [r.status_code for r in served] == [200] * (QUEUE + 1)


BAD_REQUESTS = [  # (body: a dict sent as JSON or raw bytes, the status, the field blamed)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"\xff\xfe", 400, None),
    (b'{"prompt": "hi", "temperature": NaN}', 400, None),
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
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
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


def test_metrics_are_prometheus_text(server, client):
  text = client.get("/metrics").text
  for name in ("ltm_requests_total", "ltm_generated_tokens_total", "ltm_batch_occupancy", "ltm_queue_depth",
               "ltm_time_to_first_token_seconds_bucket", "ltm_time_per_output_token_seconds_bucket",
               "ltm_compiled_programs"):
    assert name in text
  assert _metric(client, 'ltm_requests_total{status="200"}') >= 1
  assert _metric(client, "ltm_generated_tokens_total") > 0


def test_a_latent_model_infers_each_requests_z_from_its_own_prompt():
  cfg = micro_config(max_seq_len=CONTEXT, n_layers=1, layer_pattern="A")  # One layer: a quicker compile.
  lm = api.build(dataclasses.replace(cfg, latent=LatentConfig(enabled=True, n_per_layer=2, inner_steps=2)), seed=2)
  lm.params["head"]["kernel"] = lm.params["head"]["kernel"] * 200.0
  prompts = ["abcdef", "uvwxyz"]  # One length: the references share their compilations.
  # generate fits z to a prompt alone, from the latent half of the seed's key, as each request's own z must be.
  expected = [lm.generate(p, 12, temperature=0.0, seed=i) for i, p in enumerate(prompts)]
  assert expected[0] != expected[1]
  engine = Engine(lm, max_batch=2, chunk=8, max_wait_ms=200, length_buckets=(CONTEXT,), group_sizes=(2,))
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
