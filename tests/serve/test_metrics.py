"""`/metrics`: parsed by `prometheus_client`'s own parser, counters equal to what was sent
(checked against the usage the real SDKs report), and the same numbers as
`engine.get_stats()`.

The session engine is shared with other tests, so engine figures are compared as the
difference between two scrapes around the requests of a test.
"""

from __future__ import annotations

import threading

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import wait_idle

from astrai.serve import ServerThread, create_app

MSGS = [{"role": "user", "content": "Count to ten"}]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `/metrics`, keyed by (sample name, sorted labels)."""
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(url: str) -> dict[str, str]:
    """Metric family name -> type."""
    text = httpx.get(f"{url}/metrics").text
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def metrics_server(engine):
    """A server of its own (a fresh app registry) over the session engine."""
    with ServerThread(create_app(engine)) as srv:
        yield srv


def test_metric_families_and_types(metrics_server):
    types = families(metrics_server.url)
    expected = {
        "astrai_http_requests": "counter",
        "astrai_http_request_duration_seconds": "histogram",
        "astrai_time_to_first_token_seconds": "histogram",
        "astrai_inter_token_latency_seconds": "histogram",
        "astrai_requests_waiting": "gauge",
        "astrai_requests_running": "gauge",
        "astrai_kv_cache_usage_ratio": "gauge",
        "astrai_prefix_cache_hit_rate": "gauge",
        "astrai_preemptions": "counter",
        "astrai_prompt_tokens": "counter",
        "astrai_generation_tokens": "counter",
    }
    missing = {k: v for k, v in expected.items() if types.get(k) != v}
    assert not missing, types


def test_counters_match_the_requests_sent(metrics_server, engine):
    url = metrics_server.url
    wait_idle(engine)  # no work left over from another test in the deltas
    before = scrape(url)
    stats_before = engine.get_stats()
    usages = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as oai:
        for k in range(3):
            r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=3 + k)
            usages.append((r.usage.prompt_tokens, r.usage.completion_tokens))
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(model="astrai", messages=MSGS, temperature=5)
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60) as ant:
        for k in range(2):
            m = ant.messages.create(model="astrai", messages=MSGS, max_tokens=4 + k)
            usages.append((m.usage.input_tokens, m.usage.output_tokens))
    httpx.get(f"{url}/health")  # monitoring endpoints are not counted
    after = scrape(url)
    stats = engine.get_stats()

    requests = "astrai_http_requests_total"
    assert delta(before, after, requests, protocol="openai_chat", status="200") == 3
    assert delta(before, after, requests, protocol="openai_chat", status="400") == 1
    assert delta(before, after, requests, protocol="anthropic_messages", status="200") == 2
    assert not [k for k in after if k[0] == requests and ("protocol", "other") in k[1]]
    e2e = "astrai_http_request_duration_seconds_count"
    assert delta(before, after, e2e, protocol="openai_chat") == 4
    assert delta(before, after, e2e, protocol="anthropic_messages") == 2

    n = len(usages)
    tokens_out = sum(out for _, out in usages)
    assert all(out >= 1 for _, out in usages)
    assert delta(before, after, "astrai_generation_tokens_total") == tokens_out
    assert delta(before, after, "astrai_prompt_tokens_total") == sum(p for p, _ in usages)
    # One first token per request, one gap per further token.
    assert delta(before, after, "astrai_time_to_first_token_seconds_count") == n
    assert delta(before, after, "astrai_inter_token_latency_seconds_count") == tokens_out - n
    assert delta(before, after, "astrai_engine_requests_total") == n  # the 400 never got there
    assert stats["total_tokens"] - stats_before["total_tokens"] == tokens_out
    assert stats["ttft_seconds"]["count"] - stats_before["ttft_seconds"]["count"] == n


def test_metrics_equal_engine_stats(metrics_server, engine, oai):
    oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=4)
    wait_idle(engine)
    samples = scrape(metrics_server.url)
    stats = engine.get_stats()  # nothing runs in between: the same numbers
    pairs = {
        "astrai_generation_tokens_total": stats["total_tokens"],
        "astrai_prompt_tokens_total": stats["total_prompt_tokens"],
        "astrai_prompt_tokens_cached_total": stats["cached_prompt_tokens"],
        "astrai_preemptions_total": stats["preemptions"],
        "astrai_engine_requests_total": stats["total_tasks"],
        "astrai_requests_running": stats["active_tasks"],
        "astrai_requests_waiting": stats["waiting_queue"],
        "astrai_kv_cache_usage_ratio": stats["kv_usage"],
        "astrai_time_to_first_token_seconds_count": stats["ttft_seconds"]["count"],
        "astrai_time_to_first_token_seconds_sum": stats["ttft_seconds"]["sum"],
        "astrai_inter_token_latency_seconds_count": stats["itl_seconds"]["count"],
        "astrai_inter_token_latency_seconds_sum": stats["itl_seconds"]["sum"],
    }
    for name, expected in pairs.items():
        assert value(samples, name) == pytest.approx(expected), name
    for key, family in (
        ("ttft_seconds", "time_to_first_token"),
        ("itl_seconds", "inter_token_latency"),
    ):
        snap = stats[key]
        name = f"astrai_{family}_seconds_bucket"
        buckets = sorted(
            (float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == name
        )
        assert buckets[-1] == (float("inf"), snap["count"])
        assert [(float(le), float(c)) for le, c in snap["buckets"]] == buckets[:-1]
        counts = [c for _, c in buckets]
        assert counts == sorted(counts)  # cumulative
    for reason, n in stats["finished_requests"].items():
        assert value(samples, "astrai_engine_requests_finished_total", finish_reason=reason) == n
    assert stats["ttft_p50"] is not None and stats["ttft_p50"] > 0


def test_streamed_request_is_counted_once(metrics_server, engine):
    url = metrics_server.url
    wait_idle(engine)
    before = scrape(url)
    body = {"messages": MSGS, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        chunks = "".join(r.iter_text())
    assert r.status_code == 200 and chunks.rstrip().endswith("data: [DONE]")
    after = scrape(url)
    requests = "astrai_http_requests_total"
    assert delta(before, after, requests, protocol="openai_chat", status="200") == 1
    assert delta(before, after, "astrai_time_to_first_token_seconds_count") == 1


def test_metrics_is_open_while_the_api_needs_a_key(engine):
    from astrai.serve import ServeSettings

    with ServerThread(create_app(engine, ServeSettings(api_key="secret"))) as srv:
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        r = httpx.get(f"{srv.url}/metrics")
        assert r.status_code == 200 and "astrai_engine_ready 1.0" in r.text
        # The 401 is counted (as `other`): refused API calls are API traffic.
        samples = scrape(srv.url)
        assert value(samples, "astrai_http_requests_total", protocol="other", status="401") == 1


def test_two_apps_have_separate_registries(engine):
    with ServerThread(create_app(engine)) as a, ServerThread(create_app(engine)) as b:
        httpx.get(f"{a.url}/v1/models")
        counted = value(scrape(a.url), "astrai_http_requests_total", protocol="other", status="200")
        assert counted == 1
        assert (
            value(scrape(b.url), "astrai_http_requests_total", protocol="other", status="200") == 0
        )


def test_offline_run_batch_is_measured_too(engine, metrics_server):
    """TTFT and inter-token latency come from the engine: `run_batch` (no HTTP) counts."""
    wait_idle(engine)
    before, scraped = engine.get_stats(), scrape(metrics_server.url)
    out = engine.run_batch([[5, 6, 7], [8, 9], [10, 11, 12, 13]], max_tokens=6, temperature=0)
    after = engine.get_stats()
    tokens = sum(len(ids) for ids in out)
    assert after["ttft_seconds"]["count"] - before["ttft_seconds"]["count"] == 3
    assert after["itl_seconds"]["count"] - before["itl_seconds"]["count"] == tokens - 3
    assert after["total_tokens"] - before["total_tokens"] == tokens
    now = scrape(metrics_server.url)
    assert delta(scraped, now, "astrai_generation_tokens_total") == tokens
    assert delta(scraped, now, "astrai_http_requests_total", protocol="other", status="200") == 0


def test_gauges_while_the_engine_is_busy(engine, metrics_server, monkeypatch):
    """The loop is held inside a forward: one request runs (its KV row held), two more
    wait; /metrics shows exactly that, then everything returns to zero."""
    wait_idle(engine)
    entered, release = threading.Event(), threading.Event()
    forward = engine.model.forward_packed

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(60), "the test never released the engine"
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward_packed", held)
    try:
        first = engine.submit([5, 6, 7, 8], max_tokens=3, temperature=0)
        assert entered.wait(60)
        queued = [engine.submit([9, 10, i], max_tokens=3, temperature=0) for i in (11, 12)]
        busy = scrape(metrics_server.url)
    finally:
        release.set()
    first.wait_completion(timeout=60)
    for r in queued:
        r.wait_completion(timeout=60)
    assert value(busy, "astrai_requests_running") == 1
    assert value(busy, "astrai_requests_waiting") == 2
    rows = engine.get_stats()["kv_capacity_tokens"] // engine.max_seq_len
    assert value(busy, "astrai_kv_cache_usage_ratio") == pytest.approx(1 / rows)  # one row
    wait_idle(engine)
    idle = scrape(metrics_server.url)
    assert value(idle, "astrai_requests_running") == value(idle, "astrai_requests_waiting") == 0
    assert value(idle, "astrai_kv_cache_usage_ratio") == 0
