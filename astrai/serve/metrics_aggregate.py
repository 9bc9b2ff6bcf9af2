"""One `/metrics` for N replicas (`python -m astrai.serve replicas=N`, astrai.serve.replicas).

Each replica keeps its own Prometheus `/metrics` (astrai.serve.metrics). `aggregate` reads
their texts with prometheus_client's own parser and writes one exposition: every series
once per replica with a `replica="<host:port>"` label, and, for the additive families
(counters, histograms, summaries), one more series labelled `replica="all"`: the sum over
the replicas (`*_created` timestamps are not summed). Gauges stay per replica: a sum of
ratios (KV usage, hit rates) means nothing; PromQL sums the additive ones it wants
(`sum(astrai_requests_running)`), and `{replica!="all"}` leaves the totals out of a sum.

`MetricsAggregator` serves it on its own port from a thread of the launcher: each scrape
fetches the replicas' `/metrics` then and answers with the aggregate (a replica that does
not answer is left out, and `astrai_replica_up{replica=...}` says 0 for it).
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("astrai.serve")

ADDITIVE = frozenset({"counter", "histogram", "summary"})
ALL = "all"  # the `replica` label of the sums


def aggregate(texts: Mapping[str, str]) -> str:
    """`texts`: replica name -> its `/metrics` text. One exposition: each sample labelled
    with its replica, and the sum over replicas of every additive family's samples
    (`replica="all"`)."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value)
                if family.type in ADDITIVE and not sample.name.endswith("_created"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    totals = sums.setdefault(family.name, {})
                    totals[key] = totals.get(key, 0.0) + sample.value
    for name, totals in sums.items():
        for (sample_name, labels), value in totals.items():
            families[name].add_sample(sample_name, {**dict(labels), "replica": ALL}, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry).decode()


class _Fixed:
    """A collector that yields the given families (for `generate_latest`)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def scrape(urls: Sequence[str], timeout: float = 5.0) -> dict[str, str | None]:
    """Each replica's `/metrics` text by its `host:port` (None: it did not answer)."""
    out: dict[str, str | None] = {}
    for url in urls:
        name = url.split("://", 1)[-1].rstrip("/")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
                out[name] = r.read().decode()
        except OSError as err:
            logger.warning("metrics of replica %s: %s", name, err)
            out[name] = None
    return out


def aggregate_urls(urls: Sequence[str]) -> str:
    """Scrape `urls` now and aggregate what answered, with `astrai_replica_up` per replica."""
    texts = scrape(urls)
    up = "# HELP astrai_replica_up 1 when the replica answered this scrape.\n"
    up += "# TYPE astrai_replica_up gauge\n"
    up += "".join(
        f'astrai_replica_up{{replica="{name}"}} {0 if text is None else 1}\n'
        for name, text in texts.items()
    )
    return aggregate({n: t for n, t in texts.items() if t is not None}) + up


class MetricsAggregator:
    """`GET /metrics` on `host:port` from a daemon thread: the aggregate of `urls`."""

    def __init__(self, urls: Sequence[str], host: str, port: int) -> None:
        replicas = list(urls)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics here (the replicas serve the API)")
                    return
                body = aggregate_urls(replicas).encode()
                self.send_response(200)
                self.send_header("content-type", CONTENT_TYPE_LATEST)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="astrai-metrics", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self, started: bool = True) -> None:
        """Close the socket (and end the thread, when `started`)."""
        if started:
            self.server.shutdown()
        self.server.server_close()
