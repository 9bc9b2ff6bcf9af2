"""Latency figures the engine measures itself: time to first token and inter-token latency.

They are measured where the tokens are made (the scheduler calls `on_submit` / `on_token`
/ `on_finish`), so offline users (`run_batch`, `generate`) get them as well as the HTTP
server, and `engine.get_stats()` and the server's `/metrics` report the same numbers.
TTFT runs from the moment a request is queued to its first sampled token; inter-token
latency is the gap between consecutive tokens of one request (a preempted request's gap
includes its recomputation, as its client sees it). The engine does not import
`prometheus_client`: `astrai.serve.metrics` turns `snapshot()` into Prometheus histograms.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from typing import Any

from astrai.inference.task import Task

# Seconds. TTFT spans a fast GPU prefill (ms) to a long queue wait on a CPU (minutes);
# inter-token latency spans a GPU decode step (ms) to a loaded CPU step (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
RECENT = 1000  # observations kept for the p50 / p99 figures


class BucketCounts:
    """A fixed-bucket histogram: observed on the loop thread, read from any thread."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bucket
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.recent.append(value)

    def snapshot(self) -> dict[str, Any]:
        """`buckets`: `[upper bound, cumulative count]` pairs, as Prometheus exposes them
        (the `+Inf` bucket is `count`; JSON has no infinity); `sum`; `p50` / `p99` of the
        latest observations."""
        counts = list(self.counts)
        cumulative, total = [], 0
        for bound, n in zip(self.buckets, counts):
            total += n
            cumulative.append([bound, total])
        total += counts[-1]
        recent = sorted(self.recent)

        def pct(q: float) -> float | None:
            return recent[min(len(recent) - 1, round(q * (len(recent) - 1)))] if recent else None

        return {
            "buckets": cumulative,
            "sum": self.sum,
            "count": total,
            "p50": pct(0.5),
            "p99": pct(0.99),
        }


class EngineMetrics:
    """TTFT and inter-token latency histograms, and finished requests by finish reason."""

    def __init__(self) -> None:
        self.ttft = BucketCounts(TTFT_BUCKETS)
        self.itl = BucketCounts(ITL_BUCKETS)
        self.finished: dict[str, int] = {}
        self._lock = threading.Lock()

    def on_submit(self, task: Task, now: float) -> None:
        task.queued_at = now

    def on_token(self, task: Task, now: float) -> None:
        """A token of `task` was sampled at `now` (perf_counter seconds)."""
        if task.queued_at is None:  # queued before the metrics existed: nothing to measure from
            return
        if task.last_token_at is None:
            self.ttft.observe(now - task.queued_at)
        else:
            self.itl.observe(now - task.last_token_at)
        task.last_token_at = now

    def on_finish(self, task: Task) -> None:
        reason = task.finish_reason or "unknown"
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def stats(self) -> dict[str, Any]:
        ttft, itl = self.ttft.snapshot(), self.itl.snapshot()
        with self._lock:
            finished = dict(self.finished)
        return {
            "ttft_p50": ttft["p50"],
            "ttft_p99": ttft["p99"],
            "itl_p50": itl["p50"],
            "itl_p99": itl["p99"],
            "ttft_seconds": ttft,
            "itl_seconds": itl,
            "finished_requests": finished,
        }
