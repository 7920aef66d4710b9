"""The HTTP layer: a Starlette ASGI app over an `Engine`, and `serve`, which runs it under uvicorn.

  POST /v1/completions        OpenAI completions (see `protocol`), streamed as server-sent events ending in [DONE]
  POST /v1/chat/completions   OpenAI chat completions: the messages as one prompt (`protocol.chat_prompt`)
  GET  /v1/models             the one model served
  GET  /health                200 while serving, 503 once shutting down
  GET  /metrics               Prometheus text

Starlette rather than FastAPI: five routes whose bodies are checked by hand (`protocol`), so that every refusal is
OpenAI's error object with the field at fault, which FastAPI's generated 422 validation errors are not; FastAPI would
add pydantic models and OpenAPI pages the server does not use. uvicorn runs it, as it runs vLLM's and others'.

Each prompt of a request becomes an engine `Request`; its events cross from the scheduler thread to the event loop
through an asyncio queue. A client that goes away (detected by the ASGI disconnect message) cancels its requests, so
they leave the queue at once, or their rows are freed at the next chunk boundary. finish_reason is "stop" or
"length" only: a request that fails, is cancelled by a shutdown, or outlives the request timeout is answered with an
HTTP error (500, 503, 504), or once streaming has begun with an error event ({"error": {...}}) followed by [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import time
import uuid

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ltm_jax.errors import LtmError
from ltm_jax.serve import access, protocol
from ltm_jax.serve.engine import Engine, Finished, Piece, QueueFull, Request, ShuttingDown
from ltm_jax.serve.protocol import ApiError

MAX_BODY_BYTES = 1 << 20


def create_app(engine: Engine, model_name: str | None = None, *, stop_engine_on_shutdown: bool = True,
               request_timeout: float | None = None) -> Starlette:
  """The app over a started `engine`, serving it as `model_name` (default and only choice: the engine's, which labels
  its metrics). On shutdown (uvicorn's lifespan) it stops the
  engine, cancelling what is still running, unless `stop_engine_on_shutdown` is False. request_timeout (seconds,
  None: none): a request not finished that long after it arrived is cancelled and answered 504 (streamed: an error
  event)."""
  if request_timeout is not None and not request_timeout > 0:
    raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout!r}")
  if model_name not in (None, engine.model_name):
    raise ValueError(f"the engine serves its model as {engine.model_name!r}, which labels its metrics; got "
                     f"model_name {model_name!r} (Engine(model_name=...) names it)")
  model_name = engine.model_name
  lm, metrics = engine.lm, engine.metrics
  created = int(time.time())
  state = {"closing": False}

  def encode(text: str) -> np.ndarray:
    try:
      ids = lm.encode(text)
    except LtmError as e:
      raise ApiError(400, f"this model cannot read text prompts: {e}; send token ids", "prompt") from None
    return ids if len(ids) else np.array([lm.tokenizer.bos_id], np.int32)

  def refuse(http: HttpRequest, error: ApiError) -> JSONResponse:
    metrics.requests.labels(str(error.status)).inc()
    access.note(http.scope, error=error.message)
    return JSONResponse(error.body(), status_code=error.status)

  async def run(http: HttpRequest, parse, chat: bool) -> Response:
    arrived = time.monotonic()
    if state["closing"]:
      return refuse(http, ApiError(503, "the server is shutting down", kind="server_error"))
    try:
      params = parse(protocol.parse_json(await _read_body(http)))
    except ApiError as e:
      return refuse(http, e)
    except ClientDisconnect:  # Gone before its whole body arrived: nobody reads an answer.
      metrics.requests.labels("499").inc()
      access.note(http.scope, error="the client disconnected")
      return Response(status_code=499)
    too_many = engine.too_many(len(params.prompts) * params.n)  # Before a list of n entries is made.
    if too_many:
      return refuse(http, ApiError(400, too_many, "n" if params.n > 1 else "prompt"))
    loop = asyncio.get_running_loop()
    choices = [ids for ids in params.prompts for _ in range(params.n)]  # Choice i * n + j: prompt i's j-th.
    queues = [asyncio.Queue() for _ in choices]
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little", signed=True)
    requests = [Request(ids, params.max_tokens, functools.partial(loop.call_soon_threadsafe, q.put_nowait),
                        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        seed=_choice_seed(seed, i), stop=params.stop, logprobs=params.logprobs)
                for i, (ids, q) in enumerate(zip(choices, queues))]
    try:
      engine.submit(requests)
    except QueueFull as e:
      return refuse(http, ApiError(429, f"{e}; retry later", kind="rate_limit_error", code="queue_full"))
    except ShuttingDown as e:
      return refuse(http, ApiError(503, str(e), kind="server_error"))
    answer = _Answer(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model_name, chat,
                     [len(ids) for ids in params.prompts], params.logprobs, lm.tokenizer)
    deadline = None if request_timeout is None else arrived + request_timeout
    if params.stream:
      events = _stream(requests, queues, answer, params, deadline, request_timeout, metrics, http.scope)
      return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _complete(http, requests, queues, answer, deadline, request_timeout, metrics)

  async def completions(http: HttpRequest) -> Response:
    return await run(http, lambda body: protocol.parse_completion(
        body, model_name=model_name, vocab_size=lm.config.model.vocab_size, encode=encode, check=engine.check),
        chat=False)

  async def chat_completions(http: HttpRequest) -> Response:
    return await run(http, lambda body: protocol.parse_chat(
        body, model_name=model_name, encode=encode, context=engine.context, check=engine.check), chat=True)

  async def models(_: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": model_name, "object": "model", "created": created, "owned_by": "ltm_jax",
         "max_model_len": engine.context}]})

  async def health(_: HttpRequest) -> Response:
    if state["closing"]:
      return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok", "slots": engine.max_batch, "occupancy": engine.occupancy,
                         "queue_depth": engine.queue_depth})

  async def prometheus(_: HttpRequest) -> Response:
    content, media_type = metrics.render()
    return Response(content, media_type=media_type)

  async def http_error(http: HttpRequest, error: HTTPException) -> Response:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return refuse(http, ApiError(error.status_code, error.detail, kind=kind))

  @contextlib.asynccontextmanager
  async def lifespan(_):
    try:
      yield
    finally:
      state["closing"] = True
      if stop_engine_on_shutdown:
        await asyncio.to_thread(engine.stop)

  routes = [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"])]
  return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan,
                   middleware=[Middleware(access.AccessLog)])


@dataclasses.dataclass
class _Answer:
  """What shapes one answer: its id, creation time, model name, endpoint (chat or text completion), the tokens of
  each prompt (usage counts a prompt once, however many choices continue it), and with logprobs (`logprobs` set)
  the tokenizer that names the tokens."""
  cid: str
  created: int
  model: str
  chat: bool
  prompt_tokens: list[int]
  logprobs: int | None = None
  tokenizer: object = None

  def scores(self, entries) -> dict | None:
    """The logprobs object of a choice's (or a streamed piece's) `TokenLogprob` entries; None without logprobs."""
    if self.logprobs is None:
      return None
    token_bytes = lambda token: self.tokenizer.decode_bytes(np.asarray([token]))
    shape = protocol.chat_logprobs if self.chat else protocol.completion_logprobs
    return shape(entries, token_bytes, self.tokenizer.eos_id)

  def body(self, choices: list[tuple[int, str, str | None, tuple]], usage: dict | None) -> dict:
    """The whole answer: choices as (index, text, finish_reason, TokenLogprob entries)."""
    if self.chat:
      return protocol.chat_body(self.cid, self.created, self.model, [
          protocol.chat_choice(i, text, reason, self.scores(entries)) for i, text, reason, entries in choices], usage)
    return protocol.completion_body(self.cid, self.created, self.model, [
        protocol.choice(i, text, reason, self.scores(entries)) for i, text, reason, entries in choices], usage)

  def chunk(self, index: int | None, text: str | None, reason: str | None, usage: dict | None,
            first: bool = False, entries: tuple = ()) -> dict:
    """One streamed chunk of choice `index` (None: no choice, the usage alone), with the logprobs of the tokens
    behind its text (`entries`). A chat choice's first chunk carries the assistant role."""
    scores = self.scores(entries) if text else None
    if self.chat:
      delta = {} if text is None else {"content": text}
      if first:
        delta = {"role": "assistant", **delta}
      choices = [] if index is None else [protocol.chat_delta(index, delta, reason, scores)]
      return protocol.chat_chunk(self.cid, self.created, self.model, choices, usage)
    choices = [] if index is None else [protocol.choice(index, text or "", reason, scores)]
    return protocol.completion_body(self.cid, self.created, self.model, choices, usage)


FAILED = ("error", "cancelled", "timeout")  # The finish reasons of a request that ended without an answer.


def _failure(finished: Finished, timeout: float | None) -> tuple[int, dict]:
  """The HTTP status and error body of a request that ended without an answer."""
  if finished.reason == "error":
    return 500, protocol.error_body(finished.error or "generation failed", "server_error")
  if finished.reason == "timeout":
    return 504, _timed_out(timeout)
  return 503, protocol.error_body("the request was cancelled: the server is shutting down", "server_error")


def _choice_seed(seed: int, index: int) -> int:
  """The seed of a request's index-th choice: the request's seed for the first, so one prompt sampled with seed s
  gives `LanguageModel.generate(seed=s)`'s tokens; the others get their own (seed + index, in range)."""
  return (seed + index + 2**63) % 2**64 - 2**63


async def _read_body(http: HttpRequest) -> bytes:
  declared = http.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
    raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
  body = bytearray()
  async for part in http.stream():
    body += part
    if len(body) > MAX_BODY_BYTES:
      raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
  return bytes(body)


async def _until_disconnected(http: HttpRequest) -> None:
  """Returns when the client disconnects (the body has been read, so the next ASGI message is the disconnect)."""
  while (await http.receive())["type"] != "http.disconnect":
    pass


async def _gather(requests, queues) -> list[tuple[str, tuple, Finished]]:
  """Every request's whole text, the logprobs of its tokens (`TokenLogprob`s, with logprobs) and its Finished."""
  results = []
  for q in queues:
    text, entries = [], []
    while not isinstance(event := await q.get(), Finished):
      text.append(event.text)
      entries += event.logprobs
    results.append(("".join(text), tuple(entries), event))
  return results


def _timed_out(timeout: float) -> dict:
  return protocol.error_body(f"the request did not finish within the server's request timeout of {timeout:g} s",
                             "timeout_error", code="timeout")


async def _complete(http, requests, queues, answer: _Answer, deadline, timeout, metrics) -> Response:
  """The non-streamed answer; a disconnect before it is ready cancels the requests, and so does the deadline
  (monotonic seconds, None: none), which is answered 504."""
  gathering = asyncio.ensure_future(_gather(requests, queues))
  watching = asyncio.ensure_future(_until_disconnected(http))
  wait = None if deadline is None else max(deadline - time.monotonic(), 0)
  disconnected = False
  try:
    await asyncio.wait({gathering, watching}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    disconnected = watching.done()
  finally:
    watching.cancel()
    if not gathering.done():
      gathering.cancel()
      for request in requests:
        request.cancel("cancelled" if disconnected or deadline is None else "timeout")
  if not gathering.done() or gathering.cancelled():
    if disconnected or deadline is None:
      metrics.requests.labels("499").inc()  # The client closed the connection; nobody reads this answer.
      access.note(http.scope, error="the client disconnected")
      return Response(status_code=499)
    metrics.requests.labels("504").inc()
    access.note(http.scope, error="timeout")
    return JSONResponse(_timed_out(timeout), status_code=504)
  results = gathering.result()
  failed = [f for _, _, f in results if f.reason in FAILED]
  if failed:
    status, body = _failure(failed[0], timeout)
    metrics.requests.labels(str(status)).inc()
    access.note(http.scope, error=body["error"]["message"])
    return JSONResponse(body, status_code=status)
  metrics.requests.labels("200").inc()
  texts = [text.lstrip() if answer.chat else text for text, _, _ in results]
  choices = [(i, text, f.reason, entries) for i, (text, (_, entries, f)) in enumerate(zip(texts, results))]
  used = protocol.usage(sum(answer.prompt_tokens), sum(f.completion_tokens for _, _, f in results))
  _note_usage(http.scope, used, [f.reason for _, _, f in results])
  return JSONResponse(answer.body(choices, used))


def _note_usage(scope: dict, used: dict, reasons: list[str]) -> None:
  """The access line's fields of an answered request."""
  access.note(scope, prompt_tokens=used["prompt_tokens"], completion_tokens=used["completion_tokens"],
              finish_reason=",".join(reasons))


def _coalesced(items: list) -> list:
  """`items` (Pieces, then possibly a Finished) with each run of consecutive Pieces joined into one."""
  out = []
  for item in items:
    if out and isinstance(item, Piece) and isinstance(out[-1], Piece):
      before = out.pop()
      item = Piece(before.text + item.text, item.tokens, before.logprobs + item.logprobs)
    out.append(item)
  return out


async def _stream(requests, queues, answer: _Answer, params, deadline, timeout, metrics, scope):
  """Server-sent events: one chunk per piece of text of any prompt (a chat reply's leading whitespace dropped; the
  pieces that queued up while the event loop was busy joined into one), a last chunk per prompt with its finish
  reason, then (with include_usage) the usage, then [DONE]. With continuous_usage_stats every chunk carries the usage
  so far. A request that fails, is cancelled by a shutdown or passes the deadline ends the stream with an error event
  and [DONE]. Closed early (the client went away), it cancels the requests. The access line (`scope`) gets the
  usage and finish reasons, or the error."""
  def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"

  prompt_tokens = sum(answer.prompt_tokens)
  completion = [0] * len(queues)
  reasons: list[str | None] = [None] * len(queues)
  started = [False] * len(queues)  # A chat choice has sent text (its leading whitespace is behind it).
  held = [()] * len(queues)  # Logprobs of text not sent yet (a chat reply's leading whitespace).

  def usage_now():
    return protocol.usage(prompt_tokens, sum(completion)) if params.continuous_usage else None

  pending = {asyncio.ensure_future(q.get()): i for i, q in enumerate(queues)}
  # The HTTP status went out with the first event; the request is counted once, by how its stream ended: 200,
  # its error event's status, or 499 when the client went away first.
  status = "499"
  try:
    while pending:
      wait = None if deadline is None else max(deadline - time.monotonic(), 0)
      done, _ = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
      if not done:
        for request in requests:
          request.cancel("timeout")
        status = "504"
        access.note(scope, error="timeout")
        yield event(_timed_out(timeout))
        break
      failed = None
      for future in done:
        i = pending.pop(future)
        items = [future.result()]
        while not queues[i].empty():  # Text that queued up while the loop was busy goes out as one event.
          items.append(queues[i].get_nowait())
        for item in _coalesced(items):
          if isinstance(item, Piece):
            completion[i] = item.tokens
            text, held[i] = item.text, held[i] + item.logprobs
            if answer.chat and not started[i]:
              text = text.lstrip()
            if text:  # A chat reply's leading whitespace goes out with the text after it, logprobs included.
              yield event(answer.chunk(i, text, None, usage_now(), answer.chat and not started[i], held[i]))
              started[i], held[i] = True, ()
          elif item.reason in FAILED:
            failed = item
          else:
            completion[i], reasons[i] = item.completion_tokens, item.reason
            yield event(answer.chunk(i, None if answer.chat else "", item.reason, usage_now(),
                                     first=answer.chat and not started[i]))
        if isinstance(items[-1], Piece):
          pending[asyncio.ensure_future(queues[i].get())] = i
      if failed is not None:
        code, body = _failure(failed, timeout)
        status = str(code)
        access.note(scope, error=body["error"]["message"])
        yield event(body)
        break
    else:
      status = "200"
      _note_usage(scope, protocol.usage(prompt_tokens, sum(completion)), reasons)
      if params.include_usage:
        yield event(answer.chunk(None, None, None, protocol.usage(prompt_tokens, sum(completion))))
    yield "data: [DONE]\n\n"
  finally:
    metrics.requests.labels(status).inc()
    for future in pending:
      future.cancel()
    for request in requests:
      request.cancel()  # A no-op for finished requests.


def serve(engine: Engine, model_name: str | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          grace: float = 30.0, request_timeout: float | None = None, log_level: str = "info") -> int:
  """Runs the app under uvicorn until SIGINT or SIGTERM: it then stops accepting connections, lets in-flight
  requests finish for up to `grace` seconds, cancels the rest, and returns 0. request_timeout: see `create_app`.
  log_level: the server's logs on stderr ("info": an access line per request, `access`; "warning": none)."""
  import uvicorn
  access.configure(log_level)
  config = uvicorn.Config(create_app(engine, model_name, request_timeout=request_timeout), host=host, port=port,
                          log_level="warning", timeout_graceful_shutdown=grace, lifespan="on")
  server = uvicorn.Server(config)
  # uvicorn raises the signal that stopped it again once it has shut down; a handler that does nothing makes that
  # second delivery a no-op, so a requested stop exits with status 0 instead of dying by the signal.
  previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    server.run()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return 0
