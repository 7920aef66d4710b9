"""Continuous batching: one scheduler thread owns S decoding rows (`slots.Slots`) and keeps them busy.

  engine = Engine(lm, max_batch=32, chunk=16)
  engine.start()                         # compiles every program up front, then starts the scheduler thread
  engine.submit([Request(ids, 64, ..., emit=callback)])   # QueueFull when the waiting queue is full
  engine.stop()

The scheduler loops: admit waiting requests into free rows (prefilled in groups by prompt-length bucket), feed one
piece of every long prompt in a prefill lane (with `prefill_chunk`), run one on-device loop of `chunk` decode steps
over the decoding rows, handing each row's new text to its request as every step's tokens reach the host, and free
the rows that finished or were cancelled. A request therefore waits at most one chunk to join a running batch (plus
one chunk per piece of a long prompt), no request waits for a slower neighbour, and a long prompt delays the others
by one piece per chunk, not by its whole prefill. With a `prefill_budget`, a round prefills at most that many prompt
tokens and chunks run fewer steps while requests wait, so admissions are smaller and more frequent. When the engine
is idle, the first arrival waits up to `max_wait_ms` for company, so a burst of requests is prefilled together. A
cancelled request that is still waiting leaves the queue at once.

Shapes are bucketed so that steady traffic compiles nothing: prompts are left-padded to a power-of-two length bucket
(16, 32, ..., the context) and admitted in groups of 1, 4, 16, ... up to max_batch rows (padding rows are dropped on
device). The programs are one `admit` per (group size, length bucket), one `decode_chunk`, and with chunked prefill
one `feed_lanes` and one `place`; `start` compiles all of them (`programs` counts them).

Requests' callbacks run on the scheduler thread, or on the hand-out thread that streams each step's tokens, and must
not block (the HTTP layer hands events to its event loop).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from queue import SimpleQueue

import jax
import numpy as np

from ltm_jax import model as model_lib
from ltm_jax.inference import text as text_lib
from ltm_jax.serve import slots as slots_lib
from ltm_jax.serve.metrics import ServerMetrics

_INT32_MAX = np.iinfo(np.int32).max
MIN_BUCKET = 16  # The shortest prompt-length bucket: shorter prompts are left-padded to it.


class QueueFull(Exception):
  """The waiting queue cannot take the request."""


class ShuttingDown(Exception):
  """The engine is stopping and takes no new requests."""


class TooManyPrompts(ValueError):
  """A request holds more prompts than the whole queue: it could never be accepted."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """A completion token's log probability under the model (log_softmax of its logits, before temperature, top-k and
  top-p), the `Request.logprobs` most likely tokens as (id, logprob) pairs, most likely first, and where the token's
  text starts in the request's text (characters)."""
  token: int
  logprob: float
  top: tuple[tuple[int, float], ...]
  offset: int


@dataclasses.dataclass(frozen=True)
class Piece:
  """New text of a request (never empty); tokens: completion tokens behind all of the text handed out so far;
  logprobs: with `Request.logprobs`, one `TokenLogprob` per token behind this piece (those after the last piece's)."""
  text: str
  tokens: int = 0
  logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class Finished:
  """The request ended, sent once per request. reason: "stop" (end of text or a stop string), "length"
  (max_tokens), "cancelled" (the client went away or the server stopped), "timeout" (the server's request timeout)
  or "error" (`error` says what failed); a cancelled request ends with its cancellation's reason, whatever happens
  to its row after. completion_tokens: the tokens behind the text returned (a stop string and what was drawn after
  it are not counted; nor is the end-of-text token)."""
  reason: str
  prompt_tokens: int
  completion_tokens: int
  error: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
  """One prompt to continue. ids: prompt token ids [T] (T >= 1); max_tokens >= 1, with T + max_tokens within the
  engine's context; temperature (0: greedy), top_k (None: off), top_p (None: off); seed picks the request's PRNG key
  as `LanguageModel.generate(seed=...)` does; stop: strings that end the text (not included); logprobs (None: off):
  the pieces carry each token's logprob and this many most likely alternatives (0 to `slots.MAX_LOGPROBS`). `emit`
  receives its `Piece`s and one `Finished`, from the engine's threads (it must not block)."""
  ids: np.ndarray
  max_tokens: int
  emit: Callable[[Piece | Finished], None]
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  stop: tuple[str, ...] = ()
  logprobs: int | None = None
  arrived: float = dataclasses.field(default_factory=time.monotonic)
  cancelled: str | None = None  # Why it was cancelled, once it has been.
  finished: bool = False  # Its Finished has been sent (and counted).
  withdraw: Callable[[Request], None] | None = dataclasses.field(default=None, repr=False)  # Set by `submit`.

  def cancel(self, reason: str = "cancelled") -> None:
    """Ends the request, to be counted as `reason` ("cancelled": the client went away or the server stopped;
    "timeout": the request timeout passed): one still waiting leaves the queue at once (and gets its Finished); one
    in a row ends at the scheduler's next chunk boundary, which frees the row. After the first call, or once the
    request has finished, a no-op."""
    if self.cancelled or self.finished:
      return
    self.cancelled = reason
    if self.withdraw is not None:
      self.withdraw(self)


class _Row:
  """A request in a decoding row, with its text so far (`text.StopText`: cut at a stop string, with the tokens
  behind each prefix). Each kept token is timed when it reached the host (with per-chunk hand-out, at its step within
  the chunk: the chunk's time split evenly among the steps it ran)."""

  def __init__(self, request: Request, tokenizer):
    self.request = request
    self.out = text_lib.StopText(tokenizer, request.stop)
    self.produced = 0  # Tokens drawn, stop token excluded.
    self.stamps: list[float] = []  # When each kept token was drawn.
    self.available_at: float | None = None  # When the first token reached the host.
    self.fed = 0  # Prompt tokens prefilled so far (chunked prefill).
    self.lane: int | None = None  # The prefill lane while the prompt is being fed in pieces.
    self.reason: str | None = None  # Why it finished, once it has (its row is freed at the chunk's end).
    self.scores: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []  # Per kept token, with logprobs.
    self.handed = 0  # Tokens behind the pieces sent so far.

  @property
  def text(self) -> str:
    return self.out.text

  def add(self, tokens: np.ndarray, eos: int, stamps: Sequence[float], now: float,
          scores: slots_lib.Scores | None = None) -> str | None:
    """Takes this row's next drawn tokens, drawn at `stamps` and on the host at `now`, with their `scores` (per
    token: logprob, ids [K], top [K]; needed with request.logprobs); returns the finish reason, or None while it
    goes on."""
    tokens = tokens[:self.request.max_tokens - self.produced]
    hits = np.flatnonzero(tokens == eos)
    ended = hits.size > 0
    kept = tokens[:hits[0]] if ended else tokens
    if self.available_at is None and tokens.size:
      self.available_at = now
    self.stamps.extend(stamps[:kept.size])
    if self.request.logprobs is not None:
      n = self.request.logprobs
      self.scores += [(int(token), float(scores.logprob[j]),
                       tuple(zip(scores.ids[j, :n].tolist(), scores.top[j, :n].tolist())))
                      for j, token in enumerate(kept)]
    self.produced += kept.size
    reason = "stop" if ended else "length" if self.produced >= self.request.max_tokens else None
    if self.out.add(kept):
      reason = "stop"
    elif reason is not None:
      self.out.close()
    self.reason = reason
    return reason

  @property
  def returned(self) -> int:
    """Completion tokens behind the whole text (after a stop-string cut)."""
    return self.out.returned

  def piece(self, final: bool) -> Piece | None:
    """The text not yet handed out, as a Piece (None when there is none; while going on, the last characters that
    could begin a stop string stay), with the logprobs of the tokens behind it."""
    text = self.out.take(final)
    if not text:
      return None
    tokens = self.out.tokens_behind(self.out.sent)
    logprobs = tuple(TokenLogprob(*self.scores[i], self.out.ends[i - 1] if i else 0)
                     for i in range(self.handed, min(tokens, len(self.scores))))
    self.handed = tokens
    return Piece(text, tokens, logprobs)

  def time_per_token(self) -> float | None:
    """Seconds per returned token after the first: (last - first returned token's time) / (tokens - 1)."""
    n = self.returned
    return None if n < 2 else (self.stamps[n - 1] - self.stamps[0]) / (n - 1)


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
  steps per on-device loop (the longest a new request waits to join); max_wait_ms:
  how long an idle engine holds a first request for others to prefill with it; queue: requests that may wait for a
  row. Every prompt plus its max_tokens must fit the context (model.max_seq_len); `check` says why one does not.
  model_name: the name the model is served as (default: its config's name), which labels the metrics (`metrics`,
  default a `ServerMetrics` of its own). length_buckets and group_sizes replace the default ladders of prompt lengths and prefill group sizes (fewer
  programs to compile, more padding).

  prefill_chunk (None: off): prompts longer than this many tokens are prefilled in pieces of it, one piece between
  two decode chunks, in up to `prefill_lanes` prompts at a time (each lane holds one prompt's state while it is fed),
  so a long prompt delays the running requests by one piece per chunk rather than by its whole length. The first
  piece is the remainder (1 to prefill_chunk tokens), every later one exactly prefill_chunk tokens; prompts that fit
  one piece are prefilled whole, as without it (their length buckets then end at prefill_chunk). Latent models fit
  z to the whole prompt and so always prefill it whole.

  prefill_budget (None: off): the prompt tokens one admission round may prefill whole, each prompt counted at its
  length bucket (the padded length it is prefilled at). Waiting requests are admitted in arrival order while they fit
  the budget (the first of a round always is); the rest wait for the next round. A round's prompts of one bucket are
  cut into the largest groups that need no padding rows where the group sizes allow (5 -> 4 + 1, not one group of
  16), so the tokens prefilled are mostly those counted. Pieces of long prompts (prefill_chunk) are bounded by their
  own size and not counted.

  waiting_chunk: decode steps per chunk while requests wait at the chunk's start (default: chunk // 4 with a
  prefill_budget, else chunk), so that the rounds that admit them come sooner, each stalling the decoding rows for
  less. Shorter chunks run the same compiled program (its step count is an argument): nothing more is compiled.

  static_batches: the baseline continuous batching is measured against (benchmarks/serve_load.py). Waiting requests
  are admitted only while every row is free, so the requests taken together (up to max_batch, gathered for up to
  max_wait_ms) run as one batch to completion before the next batch starts; programs, sampling and answers are
  otherwise the same.

  stream_steps (default): each decode step's tokens are handed out as they reach the host, during the chunk, so a
  request's text streams token by token and it finishes at the step that ends it (its row is freed at the chunk's
  end). Off: text is handed out when a chunk ends, up to `chunk` tokens at once, a host round trip a step cheaper."""

  def __init__(self, lm, *, max_batch: int = 32, chunk: int = 16, max_wait_ms: float = 10.0, queue: int = 256,
               metrics: ServerMetrics | None = None, length_buckets: Sequence[int] | None = None,
               group_sizes: Sequence[int] | None = None, prefill_chunk: int | None = None, prefill_lanes: int = 4,
               prefill_budget: int | None = None, waiting_chunk: int | None = None, static_batches: bool = False,
               stream_steps: bool = True, model_name: str | None = None):
    for name, value in (("max_batch", max_batch), ("chunk", chunk), ("queue", queue),
                        ("prefill_lanes", prefill_lanes), ("prefill_chunk", prefill_chunk or 1),
                        ("prefill_budget", prefill_budget or 1), ("waiting_chunk", waiting_chunk or 1)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not max_wait_ms >= 0:
      raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
    if lm.tokenizer.eos_id is None:
      raise ValueError("the model's tokenizer has no end-of-text token to stop at")
    self.lm, self.max_batch, self.chunk, self.queue_size = lm, max_batch, chunk, queue
    self.max_wait = max_wait_ms / 1000
    self.static_batches, self.stream_steps = static_batches, stream_steps
    self.prefill_budget = prefill_budget
    default_waiting_chunk = max(chunk // 4, 1) if prefill_budget else chunk
    self.waiting_chunk = min(waiting_chunk or default_waiting_chunk, chunk)
    self.model_name = model_name or lm.config.name
    self.metrics = metrics or ServerMetrics(self.model_name)
    m = lm.config.model
    self.context = m.max_seq_len
    self.model = model_lib.LM(m, lm.config.latent, cache_capacity=model_lib.cache_capacity(m, self.context))
    self.axes = slots_lib.state_batch_axes(self.model)
    latent = model_lib.uses_latents(lm.config.latent) is not None
    # Pieces only when some prompt is longer than one piece.
    self.prefill_chunk = None if latent or not prefill_chunk or prefill_chunk >= self.context - 1 else prefill_chunk
    self.prefill_lanes = min(prefill_lanes, max_batch)
    longest = self.prefill_chunk or self.context - 1  # The longest prompt prefilled whole.
    self.length_buckets = tuple(length_buckets or _ladder(min(MIN_BUCKET, longest), 2, longest))
    self.group_sizes = tuple(group_sizes or _ladder(1, 4, max_batch))
    if list(self.length_buckets) != sorted(set(self.length_buckets)) or self.length_buckets[0] < 1 or \
        self.length_buckets[-1] < longest:
      raise ValueError(f"length_buckets must increase from >= 1 to at least the longest prompt prefilled whole, "
                       f"{longest} tokens; got {self.length_buckets}")
    if list(self.group_sizes) != sorted(set(self.group_sizes)) or self.group_sizes[0] < 1 or \
        self.group_sizes[-1] > max_batch:
      raise ValueError(f"group_sizes must increase from >= 1 to at most max_batch={max_batch}; got "
                       f"{self.group_sizes}")
    self.stop_tokens = (int(lm.tokenizer.eos_id),)
    self._waiting: collections.deque[Request] = collections.deque()
    self._rows: list[_Row | None] = [None] * max_batch
    self._lane_rows: list[int | None] = [None] * self.prefill_lanes  # The row each prefill lane feeds.
    self._cv = threading.Condition()  # Reentrant: a request cancelled on the scheduler thread withdraws under it.
    self._stopping = False
    self._thread: threading.Thread | None = None
    self._slots = None
    self._lanes = None
    self._active = np.zeros(max_batch, bool)  # The rows the running decode chunk draws for.
    self._steps: SimpleQueue = SimpleQueue()  # Decode steps' tokens for the hand-out thread.
    self._hand_out_error: Exception | None = None
    self.compile_seconds = 0.0

  @property
  def programs(self) -> int:
    """Compiled programs: one admit per (group size, length bucket), one decode chunk, and with chunked prefill one
    piece program and one that places a fed prompt into its row."""
    return len(self.group_sizes) * len(self.length_buckets) + 1 + (2 if self.prefill_chunk else 0)

  @property
  def queue_depth(self) -> int:
    return len(self._waiting)

  @property
  def occupancy(self) -> int:
    """Rows held by requests, those whose prompt is still being fed included."""
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
    if self.prefill_chunk:
      self._lanes = slots_lib.empty_lanes(self.model, self.prefill_lanes)
      self._feed_lanes({})
      self._place({})
    self._decode(np.zeros(self.max_batch, bool), self.chunk)
    jax.block_until_ready((self._slots, self._lanes))
    self.compile_seconds = time.monotonic() - started
    self.metrics.slots.set(self.max_batch)
    self.metrics.programs.set(self.programs)
    self._thread = threading.Thread(target=self._loop, name="ltm-serve-scheduler", daemon=True)
    self._thread.start()
    if self.stream_steps:
      threading.Thread(target=self._hand_out_steps, name="ltm-serve-steps", daemon=True).start()

  def too_many(self, count: int) -> str | None:
    """Why `count` requests submitted together could never be queued (more than the whole queue), or None."""
    if count > self.queue_size:
      return f"the request asks for {count} completions (prompts x n); this server queues at most {self.queue_size}"
    return None

  def submit(self, requests: Sequence[Request]) -> None:
    """Queues requests (all or none): TooManyPrompts when they are more than the whole queue, QueueFull when they do
    not fit the queue now, ShuttingDown after `stop`."""
    with self._cv:
      if self._stopping or self._thread is None:
        raise ShuttingDown("the server is shutting down")
      if self.too_many(len(requests)):
        raise TooManyPrompts(self.too_many(len(requests)))
      if len(self._waiting) + len(requests) > self.queue_size:
        raise QueueFull(f"the queue is full ({len(self._waiting)} of {self.queue_size} requests waiting)")
      for request in requests:
        request.withdraw = self._withdraw
      self._waiting.extend(requests)
      self.metrics.queue_depth.set(len(self._waiting))
      self._cv.notify()

  def _withdraw(self, request: Request) -> None:
    """A cancelled request still waiting leaves the queue now (one in a row is freed at the next chunk boundary)."""
    with self._cv:
      if request in self._waiting:
        self._waiting.remove(request)
        self.metrics.queue_depth.set(len(self._waiting))
        self._finish(request, request.cancelled, 0)

  def stop(self, timeout: float | None = None) -> None:
    """Takes no more requests, cancels those waiting or decoding, and waits for the scheduler to finish."""
    with self._cv:
      self._stopping = True
      for request in list(self._waiting):
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
          self._steps.put(None)  # Ends the hand-out thread.
          return
        if not self.occupancy and self.max_wait:  # Idle: let a burst gather before prefilling it.
          deadline = self._waiting[0].arrived + self.max_wait
          while len(self._waiting) < self.max_batch and not self._stopping and time.monotonic() < deadline:
            self._cv.wait(max(deadline - time.monotonic(), 0))
        admitted, pieces = self._take_waiting()
      try:
        if admitted or pieces:
          self._prefill(admitted, pieces)
        if self.occupancy:
          self._run_chunk()
      except Exception as error:  # A failed device call: end what was in flight, start over with fresh rows.
        self._fail_all(error)

  def _take_waiting(self) -> tuple[list[tuple[int, Request]], dict[int, tuple[np.ndarray, bool]]]:
    """Under the lock: frees the rows of cancelled requests still being fed, pops waiting requests into free rows
    (and long prompts into free prefill lanes, in arrival order), and picks the next piece of every lane ->
    (requests to prefill whole as (row, request), {lane: (its next piece of tokens, whether it starts the prompt)}).
    With static_batches nothing is taken while any row is held: the running batch finishes first. With a
    prefill_budget, whole prompts are taken while their length buckets fit it (the first always is)."""
    for lane, row_index in enumerate(self._lane_rows):
      row = None if row_index is None else self._rows[row_index]
      if row is not None and row.request.cancelled:
        self._rows[row_index], self._lane_rows[lane] = None, None
        self._finish(row.request, row.request.cancelled, 0)
    free = [] if self.static_batches and self.occupancy else [i for i, row in enumerate(self._rows) if row is None]
    admitted, spent = [], 0
    while self._waiting and free:
      request = self._waiting[0]
      long = self.prefill_chunk is not None and len(request.ids) > self.prefill_chunk
      if long and None not in self._lane_rows:
        break  # Every lane is busy: it waits, and so do the requests behind it.
      if not long and self.prefill_budget is not None:
        spent += self._bucket(len(request.ids))
        if admitted and spent > self.prefill_budget:
          break  # The round's budget is spent: it waits for the next round, and so do the requests behind it.
      self._waiting.popleft()
      row = free.pop(0)
      self._rows[row] = _Row(request, self.lm.tokenizer)
      if long:
        lane = self._lane_rows.index(None)
        self._lane_rows[lane], self._rows[row].lane = row, lane
      else:
        admitted.append((row, request))
    self.metrics.queue_depth.set(len(self._waiting))
    pieces = {}
    for lane, row_index in enumerate(self._lane_rows):
      if row_index is not None:
        row = self._rows[row_index]
        ids, size = row.request.ids, self.prefill_chunk
        first = (len(ids) - 1) % size + 1  # The remainder first: every later piece is whole.
        end = first if row.fed == 0 else row.fed + size
        pieces[lane] = (ids[row.fed:end], row.fed == 0)
        row.fed = end
    return admitted, pieces

  def _fed(self) -> dict[int, int]:
    """{lane: row} of the lanes whose prompt has been fed whole; they leave their lanes (under the lock)."""
    with self._cv:
      done = {}
      for lane, row_index in enumerate(self._lane_rows):
        if row_index is not None and self._rows[row_index].fed == len(self._rows[row_index].request.ids):
          done[lane], self._lane_rows[lane] = row_index, None
          self._rows[row_index].lane = None
      return done

  def _prefill(self, admitted: list[tuple[int, Request]], pieces: dict[int, tuple[np.ndarray, bool]]) -> None:
    """Prefills whole prompts into their rows and feeds the prefill lanes their next pieces (placing the prompts fed
    whole), timed until the slots are ready: the time every decoding row waits for it."""
    started = time.monotonic()
    self._admit(admitted)
    if pieces:
      self._feed_lanes(pieces)
      fed = self._fed()
      if fed:
        self._place(fed)
    jax.block_until_ready((self._slots, self._lanes))
    self.metrics.admission_seconds.observe(time.monotonic() - started)

  def _admit(self, admitted: list[tuple[int, Request]]) -> None:
    """Prefills the admitted requests into their rows, in groups of one length bucket and group size."""
    by_bucket: dict[int, list[tuple[int, Request]]] = collections.defaultdict(list)
    for row, request in admitted:
      by_bucket[self._bucket(len(request.ids))].append((row, request))
    for length, group in by_bucket.items():
      while group:
        size = self._group_size(len(group))
        self._admit_group(group[:size] + [None] * (size - len(group[:size])), length)
        group = group[size:]

  def _bucket(self, prompt_tokens: int) -> int:
    """The length bucket a prompt prefilled whole is padded to."""
    return next(b for b in self.length_buckets if b >= prompt_tokens)

  def _group_size(self, count: int) -> int:
    """The group size for the next `admit` call of `count` prompts of one bucket: the smallest that takes them all
    (the largest when none does); with a prefill_budget, the largest that pads nothing (the smallest when every
    size pads), so that the round's prefill stays within the budget."""
    if self.prefill_budget is not None:
      return max((s for s in self.group_sizes if s <= count), default=self.group_sizes[0])
    return next((s for s in self.group_sizes if s >= count), self.group_sizes[-1])

  def _settings(self, entries: list[Request | None]):
    """The per-request arrays `admit` and `place` take: key data, budget, temperature, top_k, top_p (None: a
    padding entry)."""
    size = len(entries)
    budget, top_k = np.zeros(size, np.int32), np.zeros(size, np.int32)
    temperature, top_p = np.zeros(size, np.float32), np.ones(size, np.float32)
    key_data = np.stack([slots_lib.host_key_data(0 if r is None else r.seed) for r in entries])
    for i, r in enumerate(entries):
      if r is not None:
        budget[i], temperature[i] = r.max_tokens, r.temperature
        # The sampler keeps every token for a top_k at or above the vocabulary: any larger k is the same setting,
        # and one past int32 would fail the whole admission round, other requests' included.
        top_k[i], top_p[i] = min(r.top_k or 0, _INT32_MAX), 1.0 if r.top_p is None else r.top_p
    return key_data, budget, temperature, top_k, top_p

  def _admit_group(self, group: list[tuple[int, Request] | None], length: int) -> None:
    """One `admit` call for a group (None: a padding entry, dropped on device) of prompts of at most `length`."""
    size = len(group)
    tokens = np.full((size, length), self.lm.tokenizer.pad_id, np.int32)
    lengths, rows = np.ones(size, np.int32), np.full(size, self.max_batch, np.int32)
    for i, entry in enumerate(group):
      if entry is not None:
        row, r = entry
        tokens[i, length - len(r.ids):], lengths[i], rows[i] = r.ids, len(r.ids), row
    settings = self._settings([None if entry is None else entry[1] for entry in group])
    self._slots = slots_lib.admit(self.model, self.lm.params, self._slots, tokens, lengths, rows, *settings,
                                  axes=self.axes)

  def _feed_lanes(self, pieces: dict[int, tuple[np.ndarray, bool]]) -> None:
    """One `feed_lanes` call: each lane in `pieces` takes its next piece (left-padded to prefill_chunk); the others
    are unchanged."""
    lanes, size = self.prefill_lanes, self.prefill_chunk
    tokens = np.full((lanes, size), self.lm.tokenizer.pad_id, np.int32)
    lengths, fresh = np.zeros(lanes, np.int32), np.zeros(lanes, bool)
    for lane, (ids, first) in pieces.items():
      tokens[lane, size - len(ids):], lengths[lane], fresh[lane] = ids, len(ids), first
    self._lanes = slots_lib.feed_lanes(self.model, self.lm.params, self._lanes, tokens, lengths, fresh,
                                       axes=self.axes)

  def _place(self, fed: dict[int, int]) -> None:
    """One `place` call: the lanes in `fed` ({lane: row}) are written into their rows, ready to decode."""
    rows = np.full(self.prefill_lanes, self.max_batch, np.int32)
    entries: list[Request | None] = [None] * self.prefill_lanes
    for lane, row in fed.items():
      rows[lane], entries[lane] = row, self._rows[row].request
    self._slots = slots_lib.place(self._slots, self._lanes, rows, *self._settings(entries), axes=self.axes)

  def _decode(self, active: np.ndarray, steps: int):
    """One decode chunk of `steps` (<= chunk) steps over the `active` rows, scored when any of them asks for
    logprobs -> (tokens, count, scores), on device."""
    scored = any(active[i] and row.request.logprobs is not None for i, row in enumerate(self._rows) if row)
    tokens, count, self._slots, scores = slots_lib.decode_chunk(
        self.model, self.lm.params, self._slots, active, np.int32(steps), np.bool_(scored), steps=self.chunk,
        stop_tokens=self.stop_tokens, on_step=self._on_step if self.stream_steps else None)
    return tokens, count, scores if scored else None

  def _run_chunk(self) -> None:
    """One decode chunk over every decoding row; hands out text (as each step's tokens arrive, or at the chunk's end
    without stream_steps), frees finished and cancelled rows (rows whose prompt is still being fed sit it out)."""
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is not None and row.lane is None and row.request.cancelled:
          self._rows[i] = None
          self._finish(row.request, row.request.cancelled, row.returned, row)
      active = np.array([row is not None and row.lane is None for row in self._rows])
      steps = self.waiting_chunk if self._waiting else self.chunk
    self.metrics.occupancy.set(self.occupancy)
    if not active.any():
      return
    started = time.monotonic()
    self._active = active
    try:
      tokens, count, scores = self._decode(active, steps)
      tokens, count = np.asarray(tokens), int(count)
      scores = None if scores is None or self.stream_steps else slots_lib.Scores(*map(np.asarray, scores))
    finally:  # Every step of the chunk handed out (even of a failed one) before its rows are freed or reused.
      self._drain_steps()
    now = time.monotonic()
    self.metrics.chunk_seconds.observe(now - started)
    self.metrics.steps.inc(count)
    stamps = started + (now - started) / max(count, 1) * np.arange(1, count + 1)  # Per-chunk hand-out only.
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is None or not active[i]:
          continue
        if not self.stream_steps:
          mine = None if scores is None else slots_lib.Scores(*(table[i, :count] for table in scores))
          self._hand_out(row, tokens[i, :count], stamps, now, mine)
        if row.reason is not None:
          self._rows[i] = None

  def _drain_steps(self) -> None:
    """Waits until the hand-out thread has handed out every step queued so far; raises the error it kept, if any."""
    if not self.stream_steps:
      return
    handed_out = threading.Event()
    self._steps.put(handed_out)
    handed_out.wait()
    if self._hand_out_error is not None:
      error, self._hand_out_error = self._hand_out_error, None
      raise error

  def _on_step(self, tokens: np.ndarray, drawing: np.ndarray, *scores: np.ndarray) -> None:
    """One decode step's tokens [S] and scores, as they reach the host: queued for the hand-out thread, so that the
    device loop goes on at once instead of waiting for the text to be handed out."""
    self._steps.put((np.array(tokens), np.array(drawing), slots_lib.Scores(*map(np.array, scores)),
                     time.monotonic()))

  def _hand_out_steps(self) -> None:
    """The hand-out thread: each queued step's tokens go to the chunk's drawing rows; a queued Event is set once
    every step queued before it has been handed out; None ends the thread. An error is kept for the scheduler, which
    raises it at the chunk's end (and fails the requests in flight, as for a failed device call)."""
    while (item := self._steps.get()) is not None:
      if isinstance(item, threading.Event):
        item.set()
        continue
      tokens, drawing, scores, now = item
      try:
        with self._cv:
          for i in np.flatnonzero(drawing & self._active):
            row = self._rows[i]
            if row is not None and row.reason is None:
              self._hand_out(row, tokens[i:i + 1], (now,), now, slots_lib.Scores(*(t[i:i + 1] for t in scores)))
      except Exception as error:
        self._hand_out_error = self._hand_out_error or error

  def _hand_out(self, row: _Row, tokens: np.ndarray, stamps: Sequence[float], now: float,
                scores: slots_lib.Scores | None = None) -> None:
    """Adds a row's new tokens (with their scores when it asked for logprobs), sends the text they complete and,
    when the row is done, its Finished (under the lock)."""
    before, waiting_first = row.produced, row.available_at is None
    reason = row.add(tokens, self.stop_tokens[0], stamps, now, scores)
    self.metrics.tokens.inc(row.produced - before)
    if waiting_first and row.available_at is not None:
      self.metrics.ttft.observe(row.available_at - row.request.arrived)
    piece = row.piece(final=reason is not None)
    if piece is not None:
      _send(row.request, piece)
    if reason is not None:
      self._finish(row.request, reason, row.returned, row)

  def _finish(self, request: Request, reason: str, returned: int, row: _Row | None = None,
              error: str | None = None) -> None:
    """Sends the request its Finished and counts it, once: a cancelled request as its cancellation's reason (its
    answer is not delivered, even if its row ended first), a finished one never again."""
    if request.finished:
      return
    request.finished = True
    reason = request.cancelled or reason
    per_token = None if row is None else row.time_per_token()
    if per_token is not None:
      self.metrics.tpot.observe(per_token)
    self.metrics.prompt_tokens.inc(len(request.ids))
    self.metrics.finished.labels(reason).inc()
    _send(request, Finished(reason, len(request.ids), returned, error))

  def _fail_all(self, error: Exception) -> None:
    message = f"generation failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    with self._cv:
      for i, row in enumerate(self._rows):
        if row is not None:
          self._rows[i] = None
          self._finish(row.request, "error", row.returned, error=message)
      self._lane_rows = [None] * self.prefill_lanes
      self._slots = slots_lib.empty_slots(self.model, self.max_batch)
      if self.prefill_chunk:
        self._lanes = slots_lib.empty_lanes(self.model, self.prefill_lanes)
