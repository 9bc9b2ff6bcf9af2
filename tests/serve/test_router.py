"""Two replicas behind vLLM's router (`python -m astrai.serve replicas=2 router=vllm`,
docs/serving.md "Data-parallel serving"): it spreads 64 requests over both, keeps a prompt
group (requests sharing a long prefix, sent at once; an `n>1` request) on one replica, the
real `openai` and `anthropic` SDKs work through it unchanged (the same answers as a replica
gives directly, created and streamed), and the aggregated /metrics is the replicas' sum.
Requests per replica are read from each replica's own /metrics."""

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_helpers import free_port_block, launch, refused, stop, wait_for_line

pytestmark = pytest.mark.slow  # two server processes and the router (~30 s on 2 cores)

ANSWERED = "astrai_http_requests_total"


@pytest.fixture(scope="module")
def group(model_dir, tmp_path_factory):
    """(router url, [replica urls], aggregated metrics url, launcher process)."""
    port = free_port_block(5)  # router, 2 replicas, aggregated metrics, router metrics
    log = tmp_path_factory.mktemp("router") / "launcher.log"
    proc = launch(model_dir, port, log, "router=vllm")
    try:
        wait_for_line(proc, log, r"vllm-router \(cache_aware\) on ")
        replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
        yield f"http://127.0.0.1:{port}", replicas, f"http://127.0.0.1:{port + 3}/metrics", proc
    finally:
        stop(proc)


def answered(url: str, protocol: str) -> float:
    """Requests of `protocol` this replica answered with 200 (its own /metrics)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == ANSWERED and s.labels == {"protocol": protocol, "status": "200"}:
                return s.value
    return 0.0


def per_replica(replicas, send, items, protocol="openai_completions", threads=8) -> list[float]:
    """Send every item (`threads` at a time); how many each replica answered."""
    before = [answered(u, protocol) for u in replicas]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(send, items))
    return [answered(u, protocol) - b for u, b in zip(replicas, before)]


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": "x", "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_router_spreads_64_requests_over_both_replicas(group):
    router, replicas, _, _ = group
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghij klmnop") for _ in range(60)) for _ in range(64)]
    counts = per_replica(replicas, lambda p: complete(router, p), prompts)
    assert sum(counts) == 64
    assert min(counts) > 0, counts  # both replicas served


def test_a_prompt_group_stays_on_one_replica(group):
    router, replicas, _, _ = group
    rng = random.Random(1)
    for g in range(3):
        prefix = "".join(rng.choice("qrstuvwxyz ") for _ in range(400))
        group_prompts = [f"{prefix} member {i}" for i in range(8)]
        first = per_replica(replicas, lambda p: complete(router, p), group_prompts[:1])
        rest = per_replica(replicas, lambda p: complete(router, p), group_prompts[1:])
        assert sorted(first) == [0, 1] and rest == [7 * x for x in first], (g, first, rest)
    # an n>1 request (a GRPO group in one request) is one replica's: 4 samples, 1 request
    counts = per_replica(replicas, lambda _: complete(router, "x", n=4, max_tokens=3), [0])
    assert sorted(counts) == [0, 1]


def test_openai_sdk_through_the_router_equals_a_replica(group):
    router, replicas, _, _ = group
    messages = [{"role": "user", "content": "Name a prime."}]
    answers = []
    for url in (router, replicas[0]):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(
                model="x", messages=messages, max_tokens=8, temperature=0
            )
            stream = client.chat.completions.create(
                model="x", messages=messages, max_tokens=8, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            text = client.completions.create(
                model="x", prompt="def main():", max_tokens=8, temperature=0
            )
            models = [m.id for m in client.models.list()]
        assert streamed == chat.choices[0].message.content
        answers.append((chat.choices[0].message.content, text.choices[0].text, models))
    assert answers[0] == answers[1]
    assert answers[0][0]  # a non-empty answer


def test_anthropic_sdk_through_the_router_equals_a_replica(group):
    router, replicas, _, _ = group
    messages = [{"role": "user", "content": "Name a colour."}]
    answers = []
    for url in (router, replicas[0]):
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as client:
            # this SDK version has no temperature argument: greedy through extra_body
            greedy = {"extra_body": {"temperature": 0}}
            msg = client.messages.create(model="x", messages=messages, max_tokens=8, **greedy)
            with client.messages.stream(
                model="x", messages=messages, max_tokens=8, **greedy
            ) as stream:
                streamed = stream.get_final_text()
        assert msg.content[0].text == streamed
        answers.append((streamed, msg.stop_reason, msg.usage.input_tokens))
    assert answers[0] == answers[1]


def test_aggregated_metrics_are_the_sum_of_the_replicas(group):
    _, replicas, metrics, _ = group
    complete(replicas[0], "one more")  # both replicas have served requests by now
    own = [
        {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(httpx.get(u + "/metrics").text)
            if f.type == "counter"
            for s in f.samples
            if not s.name.endswith("_created")
        }
        for u in replicas
    ]
    total = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))): s.value
        for f in text_string_to_metric_families(httpx.get(metrics).text)
        for s in f.samples
        if s.labels.get("replica") == "all" and f.type == "counter"
    }
    keys = set(own[0]) | set(own[1])
    assert keys and set(total) == keys
    for key in keys:
        assert total[key] == own[0].get(key, 0.0) + own[1].get(key, 0.0), key
    assert total[("astrai_engine_requests_total", ())] > 64


def test_sigint_stops_the_router_and_the_replicas(group):
    router, replicas, _, proc = group
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert all(refused(u) for u in (router, *replicas))
