"""The server's Prometheus metrics, in a registry of their own (several servers can live in one process), every one
labelled with the served model's name (`model_name`, as vLLM labels its metrics)."""

from __future__ import annotations

import prometheus_client as prom

# Seconds: from a few milliseconds (a warm chunk of a tiny model) to a minute (a long queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Labelled:
  """A metric with further labels, its model_name bound: `labels(*values)` takes the other labels' values."""

  def __init__(self, metric, model_name: str):
    self.metric, self.model_name = metric, model_name

  def labels(self, *values: str):
    return self.metric.labels(self.model_name, *values)


class ServerMetrics:
  """Requests by HTTP status, prompts by finish reason, prompt and generated tokens, decode steps, batch occupancy and
  slots, queue depth, compiled programs, and histograms of time to first token, per-token latency, decode chunk time
  and admission time, all labelled model_name=`model_name`."""

  def __init__(self, model_name: str):
    self.model_name = model_name
    self.registry = prom.CollectorRegistry()

    def metric(kind, name: str, doc: str, labels: tuple[str, ...] = (), **options):
      made = kind(name, doc, ["model_name", *labels], registry=self.registry, **options)
      return _Labelled(made, model_name) if labels else made.labels(model_name)

    c, g, h = prom.Counter, prom.Gauge, prom.Histogram
    self.requests = metric(c, "ltm_requests", "Completion and chat requests answered, by HTTP status", ("status",))
    self.finished = metric(c, "ltm_finished_requests", "Prompts that finished, each once, by reason (stop, length, "
                           "cancelled, timeout, error)", ("reason",))
    self.tokens = metric(c, "ltm_generated_tokens", "Tokens generated")
    self.steps = metric(c, "ltm_decode_steps", "Decode steps run (every decoding row draws at most one token a step)")
    self.prompt_tokens = metric(c, "ltm_prompt_tokens", "Prompt tokens of finished requests")
    self.occupancy = metric(g, "ltm_batch_occupancy", "Decoding rows in use in the latest chunk")
    self.slots = metric(g, "ltm_batch_slots", "Decoding rows (the decode batch)")
    self.queue_depth = metric(g, "ltm_queue_depth", "Requests waiting for a decoding row")
    self.programs = metric(g, "ltm_compiled_programs", "Programs compiled at start-up")
    self.ttft = metric(h, "ltm_time_to_first_token_seconds", "From arrival to the first generated token",
                       buckets=LATENCY_BUCKETS)
    self.tpot = metric(h, "ltm_time_per_output_token_seconds",
                       "Per-token latency of a request after its first token: (last - first returned token's time) / "
                       "(returned tokens - 1), each token timed at its own decode step (its chunk's time split evenly "
                       "among the chunk's steps), so the waits between chunks count", buckets=LATENCY_BUCKETS)
    self.chunk_seconds = metric(h, "ltm_decode_chunk_seconds", "One on-device loop of decode steps",
                                buckets=LATENCY_BUCKETS)
    self.admission_seconds = metric(h, "ltm_admission_seconds", "Prefill between decode chunks: one round's admit, "
                                    "feed_lanes and place calls, until their results are ready",
                                    buckets=LATENCY_BUCKETS)

  def render(self) -> tuple[bytes, str]:
    """(the Prometheus text exposition, its content type)."""
    return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
