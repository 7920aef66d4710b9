"""The server's Prometheus metrics, in a registry of their own (several servers can live in one process)."""

from __future__ import annotations

import prometheus_client as prom

# Seconds: from a few milliseconds (a warm chunk of a tiny model) to a minute (a long queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
  """Requests by HTTP status, prompts by finish reason, prompt and generated tokens, decode steps, batch occupancy and
  slots, queue depth, compiled programs, and histograms of time to first token, per-token latency, decode chunk time
  and admission time."""

  def __init__(self):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    self.requests = prom.Counter("ltm_requests", "Completion and chat requests answered, by HTTP status", ["status"],
                                 registry=r)
    self.finished = prom.Counter("ltm_finished_requests", "Prompts that finished, each once, by reason (stop, "
                                 "length, cancelled, timeout, error)", ["reason"], registry=r)
    self.tokens = prom.Counter("ltm_generated_tokens", "Tokens generated", registry=r)
    self.steps = prom.Counter("ltm_decode_steps", "Decode steps run (every decoding row draws at most one token a "
                              "step)", registry=r)
    self.prompt_tokens = prom.Counter("ltm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
    self.occupancy = prom.Gauge("ltm_batch_occupancy", "Decoding rows in use in the latest chunk", registry=r)
    self.slots = prom.Gauge("ltm_batch_slots", "Decoding rows (the decode batch)", registry=r)
    self.queue_depth = prom.Gauge("ltm_queue_depth", "Requests waiting for a decoding row", registry=r)
    self.programs = prom.Gauge("ltm_compiled_programs", "Programs compiled at start-up", registry=r)
    self.ttft = prom.Histogram("ltm_time_to_first_token_seconds", "From arrival to the first generated token",
                               buckets=LATENCY_BUCKETS, registry=r)
    self.tpot = prom.Histogram("ltm_time_per_output_token_seconds",
                               "Per-token latency of a request after its first token: (last - first returned "
                               "token's time) / (returned tokens - 1), each token timed at its own decode step (its "
                               "chunk's time split evenly among the chunk's steps), so the waits between chunks count",
                               buckets=LATENCY_BUCKETS, registry=r)
    self.chunk_seconds = prom.Histogram("ltm_decode_chunk_seconds", "One on-device loop of decode steps",
                                        buckets=LATENCY_BUCKETS, registry=r)
    self.admission_seconds = prom.Histogram(
        "ltm_admission_seconds", "Prefill between decode chunks: one round's admit, feed_lanes and place calls, until "
        "their results are ready", buckets=LATENCY_BUCKETS, registry=r)

  def render(self) -> tuple[bytes, str]:
    """(the Prometheus text exposition, its content type)."""
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
