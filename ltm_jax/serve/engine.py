"""Continuous batching: one scheduler thread owns S decoding rows (`slots.Slots`) and keeps them busy.

  engine = Engine(lm, max_batch=32, chunk=16)
  engine.start()                         # compiles every program up front, then starts the scheduler thread
  engine.submit([Request(ids, 64, ..., emit=callback)])   # QueueFull when the waiting queue is full
  engine.stop()

The scheduler loops: admit waiting requests into free rows (prefilled in groups by prompt-length bucket), run one
on-device loop of `chunk` decode steps over all S rows, hand each row's new text to its request, free the rows that
finished or were cancelled. A request therefore waits at most one chunk to join a running batch, and no request waits
for a slower neighbour. When the engine is idle, the first arrival waits up to `max_wait_ms` for company, so a burst
of requests is prefilled together.

Shapes are bucketed so that steady traffic compiles nothing: prompts are left-padded to a power-of-two length bucket
(16, 32, ..., the context) and admitted in groups of 1, 4, 16, ... up to max_batch rows (padding rows are dropped on
device). The programs are one `admit` per (group size, length bucket) and one `decode_chunk`; `start` compiles all of
them (`programs` counts them).

Requests' callbacks run on the scheduler thread and must not block (the HTTP layer hands events to its event loop).
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.serve import slots as slots_lib
from ltm_jax.serve.metrics import ServerMetrics

MIN_BUCKET = 16  # The shortest prompt-length bucket: shorter prompts are left-padded to it.


class QueueFull(Exception):
  """The waiting queue cannot take the request."""


class ShuttingDown(Exception):
  """The engine is stopping and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class Piece:
  """New text of a request (never empty)."""
  text: str


@dataclasses.dataclass(frozen=True)
class Finished:
  """The request ended. reason: "stop" (end of text or a stop string), "length" (max_tokens), "cancelled" (the
  client went away or the server stopped) or "error" (`error` says what failed)."""
  reason: str
  prompt_tokens: int
  completion_tokens: int
  error: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One prompt to continue. ids: prompt token ids [T] (T >= 1); max_tokens >= 1, with T + max_tokens within the
  engine's context; temperature (0: greedy), top_k (None: off), top_p (None: off); seed picks the request's PRNG key
  as `LanguageModel.generate(seed=...)` does; stop: strings that end the text (not included). `emit` receives its
  `Piece`s and one `Finished`, on the scheduler thread."""
  ids: np.ndarray
  max_tokens: int
  emit: Callable[[Piece | Finished], None]
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  stop: tuple[str, ...] = ()
  arrived: float = dataclasses.field(default_factory=time.monotonic)
  cancelled: bool = False

  def cancel(self) -> None:
    """Ends the request at the scheduler's next chunk boundary (its row, if it has one, is freed there)."""
    self.cancelled = True


class _Row:
  """A request in a decoding row, with its text so far."""

  def __init__(self, request: Request, tokenizer):
    self.request, self.tokenizer = request, tokenizer
    self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self.produced = 0  # Tokens drawn, stop token excluded.
    self.text, self.sent = "", 0
    self.first_token_at: float | None = None
    self.hold = max((len(s) for s in request.stop), default=1) - 1  # Text kept back while a stop string may start.

  def add(self, tokens: np.ndarray, eos: int, now: float) -> str | None:
    """Takes this row's tokens of a chunk; returns the finish reason, or None while it goes on."""
    tokens = tokens[:self.request.max_tokens - self.produced]
    hits = np.flatnonzero(tokens == eos)
    ended = hits.size > 0
    kept = tokens[:hits[0]] if ended else tokens
    if self.first_token_at is None and tokens.size:
      self.first_token_at = now
    self.produced += kept.size
    self.text += self.decoder.decode(self.tokenizer.decode_bytes(kept))
    reason = "stop" if ended else "length" if self.produced >= self.request.max_tokens else None
    cut = min((i for i in (self.text.find(s) for s in self.request.stop) if i >= 0), default=-1)
    if cut >= 0:
      self.text, reason = self.text[:cut], "stop"
    elif reason is not None:
      self.text += self.decoder.decode(b"", final=True)
    return reason

  def take_text(self, final: bool) -> str:
    """The text not yet handed out; while going on, the last characters that could begin a stop string stay."""
    end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
    piece, self.sent = self.text[self.sent:end], end
    return piece


def _send(request: Request, event: Piece | Finished) -> None:
  """Hands an event to a request; a receiver that fails (its event loop closed) only cancels its own request."""
  try:
    request.emit(event)
  except Exception:
    request.cancel()


def _ladder(first: int, factor: int, last: int) -> tuple[int, ...]:
  """first, first * factor, ... below last, then last."""
  steps = []
  while first < last:
    steps.append(first)
    first *= factor
  return tuple(steps) + (last,)


class Engine:
  """The scheduler over `lm` (a `LanguageModel`, possibly int8-quantised). max_batch: decoding rows S; chunk: decode
  steps per on-device loop (the longest a new request waits to join, and how often text is handed out); max_wait_ms:
  how long an idle engine holds a first request for others to prefill with it; queue: requests that may wait for a
  row. Every prompt plus its max_tokens must fit the context (model.max_seq_len); `check` says why one does not.
  length_buckets and group_sizes replace the default ladders of prompt lengths and prefill group sizes (fewer
  programs to compile, more padding)."""

  def __init__(self, lm, *, max_batch: int = 32, chunk: int = 16, max_wait_ms: float = 10.0, queue: int = 256,
               metrics: ServerMetrics | None = None, length_buckets: Sequence[int] | None = None,
               group_sizes: Sequence[int] | None = None):
    for name, value in (("max_batch", max_batch), ("chunk", chunk), ("queue", queue)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not max_wait_ms >= 0:
      raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
    if lm.tokenizer.eos_id is None:
      raise ValueError("the model's tokenizer has no end-of-text token to stop at")
    self.lm, self.max_batch, self.chunk, self.queue_size = lm, max_batch, chunk, queue
    self.max_wait = max_wait_ms / 1000
    self.metrics = metrics or ServerMetrics()
    m = lm.config.model
    self.context = m.max_seq_len
    self.model = model_lib.LM(m, lm.config.latent, cache_capacity=model_lib.cache_capacity(m, self.context))
    self.axes = slots_lib.state_batch_axes(self.model)
    self.length_buckets = tuple(length_buckets or _ladder(min(MIN_BUCKET, self.context), 2, self.context))
    self.group_sizes = tuple(group_sizes or _ladder(1, 4, max_batch))
    if list(self.length_buckets) != sorted(set(self.length_buckets)) or self.length_buckets[0] < 1 or \
        self.length_buckets[-1] < self.context - 1:
      raise ValueError(f"length_buckets must increase from >= 1 to at least the longest prompt, {self.context - 1} "
                       f"tokens; got {self.length_buckets}")
    if list(self.group_sizes) != sorted(set(self.group_sizes)) or self.group_sizes[0] < 1 or \
        self.group_sizes[-1] > max_batch:
      raise ValueError(f"group_sizes must increase from >= 1 to at most max_batch={max_batch}; got "
                       f"{self.group_sizes}")
    self.stop_tokens = (int(lm.tokenizer.eos_id),)
    self._waiting: collections.deque[Request] = collections.deque()
    self._rows: list[_Row | None] = [None] * max_batch
    self._cv = threading.Condition()
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._slots = None
    self.compile_seconds = 0.0

  @property
  def programs(self) -> int:
    """Compiled programs: one admit per (group size, length bucket), one decode chunk."""
    return len(self.group_sizes) * len(self.length_buckets) + 1

  @property
  def queue_depth(self) -> int:
    return len(self._waiting)

  @property
  def occupancy(self) -> int:
    return sum(row is not None for row in self._rows)

  def check(self, prompt_tokens: int, max_tokens: int) -> tuple[str, str] | None:
    """Why a prompt of `prompt_tokens` cannot get `max_tokens` new tokens here: (the parameter to blame, a message),
    or None when it can."""
    if prompt_tokens > self.context - 1:
      return "prompt", f"the prompt has {prompt_tokens} tokens; this model's context is {self.context} tokens"
    if prompt_tokens + max_tokens > self.context:
      return "max_tokens", (f"max_tokens {max_tokens} + the prompt's {prompt_tokens} tokens exceed this model's "
                            f"context of {self.context} tokens")
    return None

  # ------------------------------------------------------------------------------------------------ life cycle

  def start(self) -> None:
    """Compiles every program (each run once on padding rows, which change nothing), then starts scheduling."""
    started = time.monotonic()
    self._slots = slots_lib.empty_slots(self.model, self.max_batch)
    for size in self.group_sizes:
      for length in self.length_buckets:
        self._admit_group([None] * size, length)
    self._decode(np.zeros(self.max_batch, bool))
    jax.block_until_ready(self._slots)
    self.compile_seconds = time.monotonic() - started
    self.metrics.slots.set(self.max_batch)
    self.metrics.programs.set(self.programs)
    self._thread = threading.Thread(target=self._loop, name="ltm-serve-scheduler", daemon=True)
    self._thread.start()

  def submit(self, requests: Sequence[Request]) -> None:
    """Queues requests (all or none): QueueFull when they do not fit the queue, ShuttingDown after `stop`."""
    with self._cv:
      if self._stopping or self._thread is None:
        raise ShuttingDown("the server is shutting down")
      if len(self._waiting) + len(requests) > self.queue_size:
        raise QueueFull(f"the queue is full ({len(self._waiting)} of {self.queue_size} requests waiting)")
      self._waiting.extend(requests)
      self.metrics.queue_depth.set(len(self._waiting))
      self._cv.notify()

  def stop(self, timeout: float | None = None) -> None:
    """Takes no more requests, cancels those waiting or decoding, and waits for the scheduler to finish."""
    with self._cv:
      self._stopping = True
      for request in self._waiting:
        request.cancel()
      for row in self._rows:
        if row is not None:
          row.request.cancel()
      self._cv.notify()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout)

  # ------------------------------------------------------------------------------------------------ scheduling

  def _loop(self) -> None:
    while True:
      with self._cv:
        while not self._waiting and not self.occupancy and not self._stopping:
          self._cv.wait()
        if self._stopping and not self._waiting and not self.occupancy:
          return
        if not self.occupancy and self.max_wait:  # Idle: let a burst gather before prefilling it.
          deadline = self._waiting[0].arrived + self.max_wait
          while len(self._waiting) < self.max_batch and not self._stopping and time.monotonic() < deadline:
            self._cv.wait(max(deadline - time.monotonic(), 0))
        admitted = self._take_waiting()
      try:
        self._admit(admitted)
        if self.occupancy:
          self._run_chunk()
      except Exception as error:  # A failed device call: end what was in flight, start over with fresh rows.
        self._fail_all(error)

  def _take_waiting(self) -> list[tuple[int, Request]]:
    """Pops waiting requests into free rows (cancelled ones end here); under the lock."""
    free = [i for i, row in enumerate(self._rows) if row is None]
    admitted = []
    while self._waiting and free:
      request = self._waiting.popleft()
      if request.cancelled:
        self._finish(request, "cancelled", 0)
        continue
      row = free.pop(0)
      self._rows[row] = _Row(request, self.lm.tokenizer)
      admitted.append((row, request))
    self.metrics.queue_depth.set(len(self._waiting))
    return admitted

  def _admit(self, admitted: list[tuple[int, Request]]) -> None:
    """Prefills the admitted requests into their rows, in groups of one length bucket and group size."""
    by_bucket: dict[int, list[tuple[int, Request]]] = collections.defaultdict(list)
    for row, request in admitted:
      by_bucket[next(b for b in self.length_buckets if b >= len(request.ids))].append((row, request))
    for length, group in by_bucket.items():
      while group:
        size = next((s for s in self.group_sizes if s >= len(group)), self.group_sizes[-1])
        self._admit_group(group[:size] + [None] * (size - len(group[:size])), length)
        group = group[size:]

  def _admit_group(self, group: list[tuple[int, Request] | None], length: int) -> None:
    """One `admit` call for a group (None: a padding entry, dropped on device) of prompts of at most `length`."""
    size = len(group)
    tokens = np.full((size, length), self.lm.tokenizer.pad_id, np.int32)
    lengths, rows = np.ones(size, np.int32), np.full(size, self.max_batch, np.int32)
    budget, top_k = np.zeros(size, np.int32), np.zeros(size, np.int32)
    temperature, top_p = np.zeros(size, np.float32), np.ones(size, np.float32)
    key_data = np.stack([slots_lib.host_key_data(0 if entry is None else entry[1].seed) for entry in group])
    for i, entry in enumerate(group):
      if entry is None:
        continue
      row, r = entry
      tokens[i, length - len(r.ids):], lengths[i], rows[i], budget[i] = r.ids, len(r.ids), row, r.max_tokens
      temperature[i], top_k[i], top_p[i] = r.temperature, r.top_k or 0, 1.0 if r.top_p is None else r.top_p
    self._slots = slots_lib.admit(self.model, self.lm.params, self._slots, tokens, lengths, rows, key_data, budget,
                                  temperature, top_k, top_p, axes=self.axes)

  def _decode(self, active: np.ndarray):
    tokens, count, self._slots = slots_lib.decode_chunk(self.model, self.lm.params, self._slots, active,
                                                        steps=self.chunk, stop_tokens=self.stop_tokens)
    return tokens, count

  def _run_chunk(self) -> None:
    """One decode chunk over every row; hands out text, frees finished and cancelled rows."""
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is not None and row.request.cancelled:
          self._rows[i] = None
          self._finish(row.request, "cancelled", row.produced, row)
      active = np.array([row is not None for row in self._rows])
    occupancy = int(active.sum())
    self.metrics.occupancy.set(occupancy)
    if not occupancy:
      return
    started = time.monotonic()
    tokens, count = self._decode(active)
    tokens, count = np.asarray(tokens), int(count)
    now = time.monotonic()
    self.metrics.chunk_seconds.observe(now - started)
    generated = 0
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is None:
          continue
        before, waiting_first = row.produced, row.first_token_at is None
        reason = row.add(tokens[i, :count], self.stop_tokens[0], now)
        generated += row.produced - before
        if waiting_first and row.first_token_at is not None:
          self.metrics.ttft.observe(row.first_token_at - row.request.arrived)
        piece = row.take_text(final=reason is not None)
        if piece:
          _send(row.request, Piece(piece))
        if reason is not None:
          self._rows[i] = None
          self._finish(row.request, reason, row.produced, row, now)
    self.metrics.tokens.inc(generated)

  def _finish(self, request: Request, reason: str, produced: int, row: _Row | None = None,
              now: float | None = None, error: str | None = None) -> None:
    if row is not None and row.first_token_at is not None and now is not None and produced > 1:
      self.metrics.tpot.observe((now - row.first_token_at) / (produced - 1))
    self.metrics.prompt_tokens.inc(len(request.ids))
    self.metrics.finished.labels(reason).inc()
    _send(request, Finished(reason, len(request.ids), produced, error))

  def _fail_all(self, error: Exception) -> None:
    message = f"generation failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is not None:
          self._rows[i] = None
          self._finish(row.request, "error", row.produced, error=message)
      self._slots = slots_lib.empty_slots(self.model, self.max_batch)
