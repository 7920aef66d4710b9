"""The OpenAI completions subset the server speaks: request checking and the shapes of its answers.

A request body is checked field by field on the host before anything reaches the engine; every refusal is an
`ApiError` rendered as OpenAI's error object {"error": {"message", "type", "param", "code"}}. Fields OpenAI defines
but this server does not implement are accepted only at their neutral values (n=1, echo=false, logprobs=null, ...),
so a client never gets silently different semantics; a field OpenAI does not define is refused, as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

import numpy as np

from ltm_jax.inference.inputs import SEED_RANGE

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


@dataclasses.dataclass(frozen=True)
class CompletionParams:
  """A checked completion request: one token-id prompt per choice, and the settings shared by all of them."""
  prompts: list[np.ndarray]
  max_tokens: int
  temperature: float
  top_k: int | None
  top_p: float | None
  stop: tuple[str, ...]
  seed: int | None
  stream: bool
  include_usage: bool


# Fields OpenAI's completions endpoint defines that this server does not implement: the values it accepts for them.
NEUTRAL = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (), "presence_penalty": (0,),
           "frequency_penalty": (0,), "suffix": (), "logit_bias": ({},)}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options",
         "user", *NEUTRAL}


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same(value, allowed) -> bool:
  """JSON equality that keeps booleans apart from numbers (false is not 0)."""
  if isinstance(value, bool) or isinstance(allowed, bool):
    return value is allowed
  return value == allowed


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict:
  """The request body as a JSON object, or a 400."""
  try:
    value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
  except (UnicodeDecodeError, ValueError) as e:
    raise ApiError(400, f"the request body is not valid JSON: {str(e).splitlines()[0]}") from None
  if not isinstance(value, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(value).__name__}")
  return value


def parse_completion(body: dict, *, model_name: str, vocab_size: int, encode: Callable[[str], np.ndarray],
                     check: Callable[[int, int], tuple[str, str] | None]) -> CompletionParams:
  """A completion request body (a JSON object) -> CompletionParams, or an ApiError naming the first bad field.
  `encode` turns a text prompt into token ids; `check(prompt_tokens, max_tokens)` says why a prompt cannot have
  that many new tokens (the model's context): (the field to blame, a message), or None."""
  unknown = sorted(set(body) - KNOWN)
  if unknown:
    raise ApiError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
  for name, allowed in NEUTRAL.items():
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
  if not isinstance(body.get("user", ""), str):
    raise ApiError(400, "user must be a string", "user")

  prompts = _prompts(body.get("prompt"), vocab_size, encode)
  max_tokens = body.get("max_tokens")
  max_tokens = 16 if max_tokens is None else max_tokens
  if not _is_int(max_tokens) or max_tokens < 1:
    raise ApiError(400, f"max_tokens must be an integer >= 1, got {json.dumps(max_tokens)}", "max_tokens")
  for ids in prompts:
    problem = check(len(ids), max_tokens)
    if problem is not None:
      raise ApiError(400, problem[1], problem[0], code="context_length_exceeded")

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
  return CompletionParams(prompts, max_tokens, float(temperature), top_k, None if top_p is None else float(top_p),
                          _stop(body.get("stop")), seed, stream, _include_usage(body.get("stream_options"), stream))


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
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise ApiError(400, f"stop must be a non-empty string or a list of them, got {json.dumps(stop)[:80]}", "stop")
  if len(stops) > MAX_STOPS:
    raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
  return tuple(stops)


def _include_usage(options, stream: bool) -> bool:
  if options is None:
    return False
  if not stream:
    raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
  if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
      options.get("include_usage", False), bool):
    raise ApiError(400, f"stream_options must be {{\"include_usage\": true|false}}, got {json.dumps(options)[:80]}",
                   "stream_options")
  return options.get("include_usage", False)


def completion_body(cid: str, created: int, model: str, choices: list[dict], usage: dict | None) -> dict:
  """A text_completion object (the whole answer, or one streamed chunk)."""
  body = {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices}
  if usage is not None:
    body["usage"] = usage
  return body


def choice(index: int, text: str, finish_reason: str | None) -> dict:
  return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}
