"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own.

Engine state (running / waiting requests, KV-cache usage, prefix-cache hits, preemptions)
is read from the engine's latest stats snapshot at scrape time; latencies and token
counts are observed by the HTTP handlers, so TTFT counts from the moment the request
reached the server (queueing included), as a client sees it.

With `--api-servers N` each API process observes only its own requests, and a scrape
reaches one of them. The main process then gives every API process the same
`PROMETHEUS_MULTIPROC_DIR`: prometheus_client (which reads it at import) keeps each
process's counters and histograms in files there, and a scrape sums the files of all of
them, those of a process that has died included, as vLLM does. The sum is taken only
where llmfast made that directory (`SHARED_METRICS_ENV` says which), not from one a user's
environment happens to name (stale files of other runs).
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from llmfast.core.spec_decode import spec_rates

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's name for it
SHARED_METRICS_ENV = "LLMFAST_SHARED_METRICS_DIR"  # set with it by the launcher

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                       0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineStats:
    """A custom collector: gauges straight from the front's stats snapshot."""

    def __init__(self, front) -> None:
        self.front = front

    def collect(self):
        s = self.front.stats
        yield GaugeMetricFamily("llmfast_num_requests_running",
                                "Requests in the engine's running batch.", s.num_running_reqs)
        yield GaugeMetricFamily("llmfast_num_requests_waiting",
                                "Requests waiting to be scheduled.", s.num_waiting_reqs)
        yield GaugeMetricFamily("llmfast_kv_cache_usage_ratio",
                                "Fraction of usable KV-cache blocks held by requests.",
                                s.kv_cache_usage)
        yield GaugeMetricFamily("llmfast_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens "
                                "looked up, since start.", s.prefix_cache_hit_rate)
        yield CounterMetricFamily("llmfast_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries)
        yield CounterMetricFamily("llmfast_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield CounterMetricFamily("llmfast_num_preemptions", "Requests preempted.",
                                  s.num_preemptions)
        yield CounterMetricFamily("llmfast_engine_steps", "Engine steps taken.",
                                  self.front.num_steps)
        if s.spec_num_verify_steps:  # speculative decoding (--speculative-method)
            rate, length = spec_rates(s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                                      s.spec_num_verify_steps)
            yield CounterMetricFamily("llmfast_spec_decode_num_draft_tokens",
                                      "Draft tokens verified.", s.spec_num_draft_tokens)
            yield CounterMetricFamily("llmfast_spec_decode_num_accepted_tokens",
                                      "Draft tokens accepted.", s.spec_num_accepted_tokens)
            yield CounterMetricFamily("llmfast_spec_decode_num_verify_steps",
                                      "Request-steps that verified drafts.",
                                      s.spec_num_verify_steps)
            yield GaugeMetricFamily("llmfast_spec_decode_acceptance_rate",
                                    "Accepted / verified draft tokens, since start.", rate)
            yield GaugeMetricFamily("llmfast_spec_decode_mean_accepted_length",
                                    "Tokens emitted per verify step (accepted drafts + 1), "
                                    "since start.", length)


class ServerMetrics:
    def __init__(self, front) -> None:
        # What a scrape renders; in multiprocess mode the metrics below live in a registry
        # of their own (never rendered: their values are read back from the shared files).
        self.registry = CollectorRegistry()
        shared_dir = os.environ.get(SHARED_METRICS_ENV)
        if shared_dir and shared_dir == os.environ.get(METRICS_DIR_ENV):
            MultiProcessCollector(self.registry, path=shared_dir)
            r = CollectorRegistry()
        else:
            r = self.registry
        self.ttft = Histogram("llmfast_time_to_first_token_seconds",
                              "Time from receiving a request to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmfast_time_per_output_token_seconds",
                              "Mean time per output token after the first, per choice.",
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("llmfast_e2e_request_latency_seconds",
                             "Time from receiving a request to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmfast_prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.generation_tokens = Counter("llmfast_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.finished = Counter("llmfast_request_success", "Choices finished, by reason.",
                                ["finished_reason"], registry=r)
        self.aborted = Counter("llmfast_request_aborted",
                               "HTTP requests ended early (client gone, shutdown, error).",
                               registry=r)
        self.registry.register(_EngineStats(front))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, num_choices: int) -> RequestTracker:
        return RequestTracker(self, num_choices)


class RequestTracker:
    """Per HTTP request: first-token and finish times of each choice."""

    def __init__(self, metrics: ServerMetrics, num_choices: int) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.first_token = [None] * num_choices

    def on_delta(self, delta) -> None:
        m = self.metrics
        now = time.monotonic()
        if delta.num_new_tokens:
            m.generation_tokens.inc(delta.num_new_tokens)
            if self.first_token[delta.index] is None:
                self.first_token[delta.index] = now
                m.ttft.observe(now - self.start)
        if delta.finish_reason is not None:
            m.finished.labels(delta.finish_reason).inc()
            m.e2e.observe(now - self.start)
            first = self.first_token[delta.index]
            if first is not None and delta.num_output_tokens > 1:
                m.tpot.observe((now - first) / (delta.num_output_tokens - 1))
