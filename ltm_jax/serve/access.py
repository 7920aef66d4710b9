"""Access logs: one line per HTTP request on the `ltm_jax.serve.access` logger, once its answer has been sent (a
stream: once it has ended), e.g.

  127.0.0.1:51234 "POST /v1/completions" 200 0.412s prompt_tokens=5 completion_tokens=16 finish_reason=length
  127.0.0.1:51236 "POST /v1/completions" 400 0.002s error="max_tokens must be an integer >= 1, got 0"

at INFO, and at DEBUG for GET /health and /metrics (probes and scrapers would drown the rest). The handlers add what
they know about the request (`note`); `AccessLog` is the ASGI middleware that times the request, reads its status
and writes the line.
"""

from __future__ import annotations

import json
import logging
import time

LOGGER = logging.getLogger("ltm_jax.serve.access")
QUIET_PATHS = ("/health", "/metrics")


def note(scope: dict, **fields) -> None:
  """Adds `fields` (name=value pairs, logged in this order after the status and time) to the request's line."""
  scope.setdefault("state", {}).setdefault("access", {}).update(fields)


class AccessLog:
  """ASGI middleware writing the access line of every HTTP request `app` answers."""

  def __init__(self, app):
    self.app = app

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    started, status = time.monotonic(), [None]

    async def sending(message):
      if message["type"] == "http.response.start":
        status[0] = message["status"]
      await send(message)

    try:
      await self.app(scope, receive, sending)
    finally:
      quiet = scope["method"] == "GET" and scope["path"] in QUIET_PATHS
      level = logging.DEBUG if quiet else logging.INFO
      if LOGGER.isEnabledFor(level):
        LOGGER.log(level, line(scope, status[0], time.monotonic() - started))


def line(scope: dict, status: int | None, seconds: float) -> str:
  """The access line of a request (`status` None: no answer was started)."""
  client = scope.get("client")
  where = f"{client[0]}:{client[1]}" if client else "-"
  fields = scope.get("state", {}).get("access", {})
  extra = "".join(f" {name}={json.dumps(value) if isinstance(value, str) and ' ' in value else value}"
                  for name, value in fields.items())
  return f'{where} "{scope["method"]} {scope["path"]}" {status or "-"} {seconds:.3f}s{extra}'


def configure(level: str) -> None:
  """Writes the server's logs (`ltm_jax.serve.*`) at `level` and above to stderr, one line each, through a handler
  of their own only (not also through the root logger's, which a library may have configured)."""
  logger = logging.getLogger("ltm_jax.serve")
  if not logger.handlers:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
  logger.setLevel(level.upper())
  logger.propagate = False
