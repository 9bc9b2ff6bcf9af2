"""`/metrics`: the server's figures in Prometheus text format (`prometheus_client`).

Each app has its own `CollectorRegistry` (never the process-global one), so several
servers or tests in one process do not collide. Two sources feed it:

- `EngineCollector` reads `engine.get_stats()` at scrape time (queue, running requests,
  KV usage, prefix cache, preemptions, tokens in and out, the engine's TTFT and
  inter-token latency histograms), so `/metrics` and `get_stats()` report the same numbers.
- `HTTPMetrics` counts API requests by protocol and status and times them end to end (from
  the request to the last byte of the response, a stream included); the monitoring
  endpoints (`/health`, `/metrics`, `/stats`) are not counted, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine

PREFIX = "astrai"
MONITORING_PATHS = frozenset({"/health", "/metrics", "/stats"})
# Request path -> the `protocol` label; everything else is "other".
PROTOCOLS = {
    "/v1/chat/completions": "openai_chat",
    "/v1/completions": "openai_completions",
    "/v1/messages": "anthropic_messages",
}
# Seconds from the request to the end of its response: a cached short answer to a long
# generation on a CPU.
E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip

# get_stats() key -> (metric name without prefix, help). Gauges are current values,
# counters only grow for the engine's lifetime.
_GAUGES = {
    "active_tasks": ("requests_running", "Requests being computed (prefill or decode)."),
    "waiting_queue": ("requests_waiting", "Requests queued for admission (incl. preempted)."),
    "kv_usage": (
        "kv_cache_usage_ratio",
        "Fraction of KV slots held by requests (paged: pages in use; contiguous: rows in use).",
    ),
    "kv_capacity_tokens": ("kv_cache_capacity_tokens", "KV slots of the pool, in tokens."),
    "kv_allocated_bytes": (
        "kv_cache_allocated_bytes",
        "Bytes the KV pool's storage holds now (0 while the engine sleeps).",
    ),
    "is_sleeping": ("engine_sleeping", "1 while the engine sleeps (engine.enable_sleep_mode)."),
    "spec_mean_accepted_length": (
        "spec_decode_mean_accepted_length",
        "Tokens a request gains per verification: 1 + accepted proposals / verifications.",
    ),
    "prefix_hit_rate": (
        "prefix_cache_hit_rate",
        "Prompt tokens found in the radix prefix cache / tokens looked up (0: no cache).",
    ),
}
_COUNTERS = {
    "total_tasks": ("engine_requests", "Requests submitted to the engine (incl. rejected)."),
    "total_prompt_tokens": ("prompt_tokens", "Prompt tokens of admitted requests."),
    "cached_prompt_tokens": (
        "prompt_tokens_cached",
        "Prompt tokens served from the prefix cache at admission.",
    ),
    "total_tokens": ("generation_tokens", "Tokens generated."),
    "preemptions": (
        "preemptions",
        "Running requests preempted (KV freed, requeued) because the pool ran out.",
    ),
    "steps": ("engine_steps", "Engine steps (one batched forward round each)."),
    # speculative decoding (engine.speculative; vLLM's names): 0 while it is off
    "spec_num_drafts": ("spec_decode_num_drafts", "Verifications of proposed tokens."),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "Tokens proposed for verification."),
    "spec_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Proposed tokens accepted (the target model sampled the same).",
    ),
}
_HISTOGRAMS = {
    "ttft_seconds": (
        "time_to_first_token_seconds",
        "Seconds from queuing a request in the engine to its first token.",
    ),
    "itl_seconds": (
        "inter_token_latency_seconds",
        "Seconds between consecutive tokens of one request.",
    ),
}


def protocol_of(path: str) -> str:
    """The `protocol` label of a request path."""
    return PROTOCOLS.get(path, "other")


class EngineCollector(Collector):
    """Engine figures, read from `engine.get_stats()` at every scrape."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.get_stats()
        yield GaugeMetricFamily(
            f"{PREFIX}_engine_ready",
            "1 while the engine accepts requests.",
            value=float(bool(stats.get("ready"))),
        )
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(stats.get(key) or 0))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(stats.get(key) or 0))
        finished = CounterMetricFamily(
            f"{PREFIX}_engine_requests_finished",
            "Engine requests finished, by finish reason.",
            labels=["finish_reason"],
        )
        for reason, n in sorted(stats.get("finished_requests", {}).items()):
            finished.add_metric([reason], float(n))
        yield finished
        for key, (name, doc) in _HISTOGRAMS.items():
            yield _histogram(f"{PREFIX}_{name}", doc, stats.get(key))


def _histogram(name: str, doc: str, snap: dict[str, Any] | None) -> HistogramMetricFamily:
    """A histogram family from an `astrai.inference.metrics.BucketCounts` snapshot."""
    snap = snap or {"buckets": [], "sum": 0.0, "count": 0}
    buckets = [(_bound(le), float(n)) for le, n in snap["buckets"]]
    buckets.append(("+Inf", float(snap["count"])))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(snap["sum"]))


def _bound(le: float) -> str:
    return repr(float(le))


class HTTPMetrics:
    """The app's registry: request counts and end-to-end latency, plus the engine's figures."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_http_requests",
            "API requests answered, by protocol and HTTP status (monitoring endpoints excluded).",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{PREFIX}_http_request_duration_seconds",
            "Seconds from an API request to the last byte of its response.",
            ["protocol"],
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine))

    def observe(self, path: str, status: int, seconds: float) -> None:
        """Count one finished request (monitoring endpoints are skipped)."""
        if path in MONITORING_PATHS:
            return
        protocol = protocol_of(path)
        self.requests.labels(protocol=protocol, status=str(status)).inc()
        self.latency.labels(protocol=protocol).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
