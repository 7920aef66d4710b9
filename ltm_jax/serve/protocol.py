"""The OpenAI completions and chat completions subset the server speaks: request checking and the shapes of answers.

A request body is checked field by field on the host before anything reaches the engine; every refusal is an
`ApiError` rendered as OpenAI's error object {"error": {"message", "type", "param", "code"}}. Fields OpenAI defines
but this server does not implement are accepted only at their neutral values (echo=false, suffix=null, penalties
0, ...), so a client never gets silently different semantics; a field OpenAI does not define is refused, as OpenAI does.
`stream_options` also takes vLLM's `continuous_usage_stats`: every streamed chunk then carries the usage so far.

Chat messages become one text prompt through `chat_prompt`, the plain turn format RWKV World models are trained on,
used for byte-level models too:

  System: <system message>\n\nUser: <message>\n\nAssistant: <reply>\n\nUser: <message>\n\nAssistant:

Roles: system (and OpenAI's developer, written as System), user, assistant; the last message is the user's. A
message's content (a string or a list of text parts; its optional name is not used) has its surrounding whitespace
stripped and its blank lines collapsed ("\n\n" separates turns). The reply is what the model writes after the last "Assistant:" up to the next turn marker (`CHAT_STOP`,
added to the request's stop strings), its leading whitespace dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable

import numpy as np

from ltm_jax.inference.inputs import SEED_RANGE
from ltm_jax.inference.text import stop_strings
from ltm_jax.serve.slots import MAX_LOGPROBS

MAX_STOPS = 4  # OpenAI's limit on stop strings.


class ApiError(Exception):
  """A refused request: the HTTP status and OpenAI's error fields."""

  def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

  def body(self) -> dict:
    return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\n\nUser:"  # The next turn marker: a reply ends where the model starts the user's next turn.


@dataclasses.dataclass(frozen=True)
class CompletionParams:
  """A checked completion request: its token-id prompts, each answered by `n` choices, and the settings shared by all
  of them."""
  prompts: list[np.ndarray]
  max_tokens: int
  temperature: float
  top_k: int | None
  top_p: float | None
  stop: tuple[str, ...]
  seed: int | None
  stream: bool
  include_usage: bool
  continuous_usage: bool = False
  n: int = 1
  logprobs: int | None = None  # Alternatives per token's logprobs (None: no logprobs).


# Fields OpenAI's completions endpoint defines that this server does not implement: the values it accepts for them.
NEUTRAL = {"echo": (False,), "presence_penalty": (0,), "frequency_penalty": (0,), "suffix": (), "logit_bias": ({},)}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
         "user", "n", "best_of", "logprobs", *NEUTRAL}
# The same for the chat endpoint.
CHAT_NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
                "response_format": ({"type": "text"},)}
CHAT_KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
              "seed", "stream", "stream_options", "user", "n", "logprobs", "top_logprobs", *CHAT_NEUTRAL}


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    return False
  try:
    return math.isfinite(value)
  except OverflowError:  # An integer beyond float's range.
    return False


def _same(value, allowed) -> bool:
  """JSON equality that keeps booleans apart from numbers (false is not 0)."""
  if isinstance(value, bool) or isinstance(allowed, bool):
    return value is allowed
  return value == allowed


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not valid JSON")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(body: bytes) -> dict:
  """The request body as a JSON object, or a 400."""
  try:
    value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
  except (UnicodeDecodeError, ValueError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {str(e).splitlines()[0]}") from None
  except RecursionError:
    raise ApiError(400, "the request body is not valid JSON: it is nested too deeply") from None
  # JSON's \u escapes can spell a lone UTF-16 surrogate, which no text holds (nor encodes, nor answers); UTF-8 bytes
  # cannot, so only a body with such an escape is encoded again to find one.
  if _SURROGATE_ESCAPE.search(body):
    try:
      json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
      raise ApiError(400, f"the request body holds a lone surrogate ({e.object[e.start:e.end]!a}), which is not "
                          "text") from None
  if not isinstance(value, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(value).__name__}")
  return value


def parse_completion(body: dict, *, model_name: str, vocab_size: int, encode: Callable[[str], np.ndarray],
                     check: Callable[[int, int], tuple[str, str] | None]) -> CompletionParams:
  """A completion request body (a JSON object) -> CompletionParams, or an ApiError naming the first bad field.
  `encode` turns a text prompt into token ids; `check(prompt_tokens, max_tokens)` says why a prompt cannot have
  that many new tokens (the model's context): (the field to blame, a message), or None."""
  _common(body, KNOWN, NEUTRAL, model_name)
  prompts = _prompts(body.get("prompt"), vocab_size, encode)
  params = _settings(body, prompts, body.get("max_tokens"), "max_tokens", 16, check, ())
  logprobs = body.get("logprobs")
  if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
    raise ApiError(400, f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {json.dumps(logprobs)}",
                   "logprobs")
  return dataclasses.replace(params, logprobs=logprobs)


def parse_chat(body: dict, *, model_name: str, encode: Callable[[str], np.ndarray], context: int,
               check: Callable[[int, int], tuple[str, str] | None]) -> CompletionParams:
  """A chat completion request body -> CompletionParams with the messages as one prompt (`chat_prompt`) and
  CHAT_STOP among the stop strings, or an ApiError naming the first bad field. max_tokens (or
  max_completion_tokens) defaults to the rest of the context."""
  _common(body, CHAT_KNOWN, CHAT_NEUTRAL, model_name)
  ids = encode(chat_prompt(body.get("messages")))
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  params = _settings(body, [ids], body.get(name), name, max(context - len(ids), 1), check, (CHAT_STOP,))
  wanted, top = _optional(body, "logprobs", False), body.get("top_logprobs")
  if not isinstance(wanted, bool):
    raise ApiError(400, f"logprobs must be true or false, got {json.dumps(wanted)}", "logprobs")
  if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
    raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {json.dumps(top)}",
                   "top_logprobs")
  if top is not None and not wanted:
    raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
  return dataclasses.replace(params, logprobs=(top or 0) if wanted else None)


def chat_prompt(messages) -> str:
  """The messages (OpenAI's [{"role", "content"}, ...], ending with a user message) as one prompt in the turn
  format of the module docstring, or an ApiError."""
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                        f"{json.dumps(messages)[:80]}", "messages")
  turns = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict):
      raise ApiError(400, f"{where} must be an object with role and content, got {json.dumps(message)[:80]}",
                     "messages")
    extra = sorted(set(message) - {"role", "content", "name"})
    if extra:
      raise ApiError(400, f"{where} has a field this server does not support: {extra[0]}", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
      raise ApiError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:80]}",
                     "messages")
    if message.get("name") is not None and not isinstance(message["name"], str):
      raise ApiError(400, f"{where}.name must be a string", "messages")
    turns.append(f"{CHAT_ROLES[role]}: {_content(message.get('content'), where)}")
  if messages[-1]["role"] != "user":
    raise ApiError(400, f"the last message must be the user's, got {json.dumps(messages[-1]['role'])}", "messages")
  return "\n\n".join(turns) + "\n\nAssistant:"


def _content(content, where: str) -> str:
  """A message's content (a string, or a list of {"type": "text", "text"} parts) as one line-normalised text."""
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                                       and isinstance(p["text"], str) for p in content):
    content = "".join(p["text"] for p in content)
  if not isinstance(content, str):
    raise ApiError(400, f"{where}.content must be a string or a list of text parts, got "
                        f"{json.dumps(content)[:80]}", "messages")
  return re.sub(r"\n\s*\n", "\n", content.replace("\r\n", "\n").strip())


def _common(body: dict, known: set, neutral: dict, model_name: str) -> None:
  """Checks the fields every endpoint shares the handling of: unknown ones, neutral ones, model, user."""
  unknown = sorted(set(body) - known)
  if unknown:
    raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
  for name, allowed in neutral.items():
    value = body.get(name)
    if value is not None and not any(_same(value, a) for a in allowed):
      choices = " or ".join(json.dumps(a) for a in (*allowed, None))
      raise ApiError(400, f"{name} is not supported by this server: it must be {choices}, got {json.dumps(value)}",
                     name)
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise ApiError(400, f"model must be a string, got {json.dumps(model)}", "model")
  if model is not None and model != model_name:
    raise ApiError(404, f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                   code="model_not_found")
  if body.get("user") is not None and not isinstance(body["user"], str):
    raise ApiError(400, "user must be a string", "user")


def _settings(body: dict, prompts: list[np.ndarray], max_tokens, max_name: str, default_max: int, check,
              extra_stop: tuple[str, ...]) -> CompletionParams:
  """The sampling and streaming fields shared by both endpoints, checked -> CompletionParams."""
  max_tokens = default_max if max_tokens is None else max_tokens
  if not _is_int(max_tokens) or max_tokens < 1:
    raise ApiError(400, f"{max_name} must be an integer >= 1, got {json.dumps(max_tokens)}", max_name)
  for ids in prompts:
    problem = check(len(ids), max_tokens)
    if problem is not None:
      param = max_name if problem[0] == "max_tokens" else "messages" if extra_stop else problem[0]
      raise ApiError(400, problem[1], param, code="context_length_exceeded")

  temperature = _optional(body, "temperature", 1.0)
  if not _is_number(temperature) or temperature < 0:
    raise ApiError(400, f"temperature must be a finite number >= 0 (0 = greedy), got {json.dumps(temperature)}",
                   "temperature")
  top_p = body.get("top_p")
  if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
    raise ApiError(400, f"top_p must be a number in (0, 1], got {json.dumps(top_p)}", "top_p")
  top_k = body.get("top_k")
  if top_k is not None and (not _is_int(top_k) or top_k < 1):
    raise ApiError(400, f"top_k must be an integer >= 1 or null, got {json.dumps(top_k)}", "top_k")
  seed = body.get("seed")
  if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
    raise ApiError(400, f"seed must be an integer in [-2**63, 2**63), got {json.dumps(seed)}", "seed")
  stream = _optional(body, "stream", False)
  if not isinstance(stream, bool):
    raise ApiError(400, f"stream must be true or false, got {json.dumps(stream)}", "stream")
  include_usage, continuous = _stream_options(body.get("stream_options"), stream)
  return CompletionParams(prompts, max_tokens, float(temperature), top_k, None if top_p is None else float(top_p),
                          _stop(body.get("stop")) + extra_stop, seed, stream, include_usage, continuous, _n(body))


def _n(body: dict) -> int:
  """n, the choices per prompt (each sampled with a seed of its own); best_of, where given, must equal it (drawing
  more and returning the best is not implemented)."""
  n = _optional(body, "n", 1)
  if not _is_int(n) or n < 1:
    raise ApiError(400, f"n must be an integer >= 1, got {json.dumps(n)}", "n")
  best_of = body.get("best_of")
  if best_of is not None and not _same(best_of, n):
    raise ApiError(400, f"best_of is not supported by this server: it must be null or n ({n}), got "
                        f"{json.dumps(best_of)}", "best_of")
  return n


def _optional(body: dict, name: str, default):
  value = body.get(name)
  return default if value is None else value


def _prompts(prompt, vocab_size: int, encode) -> list[np.ndarray]:
  """prompt: a string, a list of strings, a list of token ids, or a list of lists of token ids -> one id array per
  choice (an empty text starts from the beginning-of-text token)."""
  what = ("prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")
  if prompt is None:
    raise ApiError(400, "prompt is required", "prompt")
  if isinstance(prompt, str):
    return [encode(prompt)]
  if not isinstance(prompt, list) or not prompt:
    raise ApiError(400, f"{what}; got {json.dumps(prompt)[:80]}", "prompt")
  if all(_is_int(t) for t in prompt):
    return [_ids(prompt, vocab_size)]
  if all(isinstance(p, str) for p in prompt):
    return [encode(p) for p in prompt]
  if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
    return [_ids(p, vocab_size) for p in prompt]
  raise ApiError(400, f"{what}, not a mix; got {json.dumps(prompt)[:80]}", "prompt")


def _ids(tokens: list[int], vocab_size: int) -> np.ndarray:
  bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
  if bad is not None:
    raise ApiError(400, f"token id {tokens[bad]} at prompt position {bad} is outside the vocabulary "
                        f"[0, {vocab_size})", "prompt")
  return np.asarray(tokens, np.int32)


def _stop(stop) -> tuple[str, ...]:
  try:
    stops = stop_strings(stop)
  except ValueError as e:
    raise ApiError(400, str(e), "stop") from None
  if len(stops) > MAX_STOPS:
    raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
  return tuple(stops)


def _stream_options(options, stream: bool) -> tuple[bool, bool]:
  """(include_usage, continuous_usage_stats) of stream_options."""
  if options is None:
    return False, False
  if not stream:
    raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
  names = ("include_usage", "continuous_usage_stats")
  if not isinstance(options, dict) or set(options) - set(names) or not all(
      isinstance(options.get(name, False), bool) for name in names):
    raise ApiError(400, f"stream_options must be {{\"include_usage\": true|false, \"continuous_usage_stats\": "
                        f"true|false}}, got {json.dumps(options)[:80]}", "stream_options")
  return options.get("include_usage", False), options.get("continuous_usage_stats", False)


def _response(kind: str, cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
  body = {"id": cid, "object": kind, "created": created, "model": model, "choices": choices}
  if usage is not None:
    body["usage"] = usage
  return body


def completion_body(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
  """A text_completion object (the whole answer, or one streamed chunk)."""
  return _response("text_completion", cid, created, model, choices, usage)


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
  return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(raw: bytes, token: int, eos: int) -> str:
  """A token's text in logprobs: its bytes as UTF-8 (a byte of a longer character becomes U+FFFD); a token without
  bytes (a special id) by name."""
  if raw:
    return raw.decode("utf-8", errors="replace")
  return "<|endoftext|>" if token == eos else f"<|{token}|>"


def completion_logprobs(entries, token_bytes: Callable[[int], bytes], eos: int) -> dict:
  """OpenAI's completions logprobs object for `engine.TokenLogprob` entries: each token's text and logprob, its
  most likely alternatives with the token itself ({text: logprob}), and where its text starts in the choice's text."""
  name = lambda token: token_text(token_bytes(token), token, eos)
  return {"tokens": [name(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
          "top_logprobs": [{**{name(t): lp for t, lp in e.top}, name(e.token): e.logprob} for e in entries],
          "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries, token_bytes: Callable[[int], bytes], eos: int) -> dict:
  """OpenAI's chat logprobs object ({"content": [...]}) for `engine.TokenLogprob` entries: each token's text,
  logprob and bytes, with its most likely alternatives in the same form."""
  def item(token: int, logprob: float) -> dict:
    raw = token_bytes(token)
    return {"token": token_text(raw, token, eos), "logprob": logprob, "bytes": list(raw)}
  return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                      for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def chat_body(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
  """A chat.completion object (the whole answer)."""
  return _response("chat.completion", cid, created, model, choices, usage)


def chat_chunk(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
  """A chat.completion.chunk object (one streamed chunk)."""
  return _response("chat.completion.chunk", cid, created, model, choices, usage)


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
  return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
          "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
  return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
