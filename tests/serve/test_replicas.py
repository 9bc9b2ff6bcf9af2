"""`python -m astrai.serve replicas=N` (astrai.serve.replicas) and its aggregated /metrics
(astrai.serve.metrics_aggregate): the plan (ports, GPUs, threads, the keys it refuses), the
aggregate against sums computed here, and real launches: two healthy replicas that SIGTERM
stops, and a replica that dies taking the group down with exit 1."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from replica_helpers import free_port_block, launch, refused, stop, wait_for_line

from astrai.serve.metrics_aggregate import aggregate
from astrai.serve.replicas import plan_replicas, replica_command, router_command

BASE = {"host": "127.0.0.1", "port": 8000, "device": "cpu", "threads": None}


def test_plan_ports_without_and_with_a_router():
    plan = plan_replicas({**BASE, "replicas": 3})
    assert plan.ports == [8000, 8001, 8002] and plan.metrics_port == 8003
    assert plan.address == "http://127.0.0.1:8000" and plan.router_port is None
    routed = plan_replicas({**BASE, "replicas": 2, "router": "vllm", "metrics_port": 9100})
    assert routed.router_port == 8000 and routed.ports == [8001, 8002]
    assert routed.metrics_port == 9100 and routed.address == "http://127.0.0.1:8000"


def test_plan_threads_share_the_cores_on_the_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = plan_replicas({**BASE, "replicas": 2})
    assert plan.visible_devices == [None, None]
    assert plan.threads == max(1, len(os.sched_getaffinity(0)) // 2)
    assert plan_replicas({**BASE, "replicas": 2, "threads": 3}).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # wins over the share, as for one server
    assert plan_replicas({**BASE, "replicas": 2}).threads is None


def test_plan_gives_each_replica_its_gpu_or_shares_with_a_warning():
    cuda = {**BASE, "device": "auto", "replicas": 2}
    plan = plan_replicas(cuda, gpus=["4", "5", "6"])
    assert plan.visible_devices == ["4", "5"] and not plan.warnings and plan.threads is None
    shared = plan_replicas({**cuda, "replicas": 3}, gpus=["0", "1"])
    assert shared.visible_devices == ["0", "1", "0"] and "share" in shared.warnings[0]
    pinned = plan_replicas({**cuda, "device": "cuda:1"}, gpus=["0", "1"])
    assert pinned.visible_devices == [None, None] and "cuda:1" in pinned.warnings[0]
    assert plan_replicas(cuda, gpus=[]).visible_devices == [None, None]  # auto without GPU
    with pytest.raises(SystemExit, match="device=cuda: no GPU"):
        plan_replicas({**cuda, "device": "cuda"}, gpus=[])


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("replicas", 0, "replicas: expected an int >= 1"),
        ("replicas", "two", "replicas: expected an int >= 1"),
        ("router", "nginx", "router: expected null or one of vllm, sglang"),
        ("router_policy", "sticky", "router_policy: expected one of"),
        ("port", 0, "port=0: replicas=2 needs a fixed first port"),
        ("metrics_port", 8001, "metrics_port=8001: a port a replica"),
        ("metrics_port", "x", "metrics_port: expected a port number or null, got 'x'"),
    ],
)
def test_plan_refuses_bad_keys_naming_them(key, value, said):
    with pytest.raises(SystemExit, match=re.escape(said)):
        plan_replicas({**BASE, "replicas": 2, key: value})
    with pytest.raises(SystemExit, match="metrics_port=7999: a port"):  # router metrics: 8000
        plan_replicas({**BASE, "replicas": 2, "router": "vllm", "metrics_port": 7999})


def test_replica_command_keeps_the_overrides_but_the_launchers():
    plan = plan_replicas({**BASE, "replicas": 2, "router": "vllm", "threads": 2})
    given = ["model_path=/m", "replicas=2", "router=vllm", "port=8000", "threads=2"]
    given += ["engine.max_batch_size=8", "+metrics_port=9000", "router_policy=random"]
    cmd = replica_command(given, plan, 1)
    assert cmd[:3] == [sys.executable, "-m", "astrai.serve"]
    assert cmd[3:] == ["model_path=/m", "engine.max_batch_size=8", "port=8002", "threads=2"]
    gpu = plan_replicas({**BASE, "device": "auto", "replicas": 2}, gpus=["0", "1"])
    assert replica_command(["device=auto"], gpu, 0)[3:] == ["port=8000", "device=cuda"]


def test_router_command_lists_every_replica():
    plan = plan_replicas({**BASE, "replicas": 2, "router": "vllm", "router_policy": "random"})
    cmd = router_command(plan, api_key="k")
    assert Path(cmd[0]).name == "vllm-router"
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 3] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert cmd[cmd.index("--policy") + 1] == "random" and cmd[cmd.index("--port") + 1] == "8000"
    assert cmd[cmd.index("--prometheus-port") + 1] == str(plan.metrics_port + 1)
    assert cmd[-2:] == ["--api-key", "k"]


def _registry(requests: dict[str, float], latencies: list[float], running: float) -> str:
    reg = CollectorRegistry()
    c = Counter("astrai_http_requests", "requests", ["protocol"], registry=reg)
    for protocol, n in requests.items():
        c.labels(protocol).inc(n)
    h = Histogram("astrai_e2e_seconds", "latency", buckets=(0.1, 1.0), registry=reg)
    for x in latencies:
        h.observe(x)
    Gauge("astrai_requests_running", "running", registry=reg).set(running)
    return generate_latest(reg).decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_aggregate_labels_each_replica_and_sums_the_additive_families():
    a = _registry({"chat": 3, "messages": 1}, [0.05, 0.5], running=2)
    b = _registry({"chat": 4}, [2.0], running=1)
    out = _samples(aggregate({"h:1": a, "h:2": b}))
    for replica, text in (("h:1", a), ("h:2", b)):  # every series, labelled, as it was
        for (name, labels), value in _samples(text).items():
            assert out[(name, tuple(sorted({**dict(labels), "replica": replica}.items())))] == value

    def total(name, **labels):
        return out[(name, tuple(sorted({**labels, "replica": "all"}.items())))]

    assert total("astrai_http_requests_total", protocol="chat") == 7
    assert total("astrai_http_requests_total", protocol="messages") == 1
    assert total("astrai_e2e_seconds_count") == 3
    assert total("astrai_e2e_seconds_sum") == pytest.approx(2.55)
    assert total("astrai_e2e_seconds_bucket", le="0.1") == 1
    assert total("astrai_e2e_seconds_bucket", le="1.0") == 2
    assert total("astrai_e2e_seconds_bucket", le="+Inf") == 3
    summed = {k for k in out if ("replica", "all") in k[1]}
    assert not any(name.endswith("_created") for name, _ in summed)
    assert not any(name == "astrai_requests_running" for name, _ in summed)  # a gauge


@pytest.mark.slow  # two server processes (~20 s on 2 loaded cores)
def test_two_replicas_start_healthy_and_sigterm_stops_both(model_dir, tmp_path):
    port, log = free_port_block(3), tmp_path / "launcher.log"
    proc = launch(model_dir, port, log)
    try:
        urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        wait_for_line(proc, log, "2 replicas ready on " + re.escape(", ".join(urls)))
        for url in urls:
            assert httpx.get(url + "/health").json()["status"] == "ok"
            assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == model_dir.name
        text = httpx.get(f"http://127.0.0.1:{port + 2}/metrics").text
        up = {
            s.labels["replica"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "astrai_replica_up"
        }
        assert up == {f"127.0.0.1:{port}": 1, f"127.0.0.1:{port + 1}": 1}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "replicas stopped" in log.read_text()
        assert all(refused(u) for u in urls)
    finally:
        stop(proc)


@pytest.mark.slow  # two server processes, one killed
def test_a_dying_replica_stops_the_group_with_exit_1(model_dir, tmp_path):
    port, log = free_port_block(3), tmp_path / "launcher.log"
    proc = launch(model_dir, port, log)
    try:
        m = wait_for_line(
            proc, log, rf"started replica 1 \(http://127.0.0.1:{port + 1}\): pid (\d+)"
        )
        wait_for_line(proc, log, "2 replicas ready on")
        os.kill(int(m.group(1)), signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
        said = log.read_text()
        assert f"replica 1 (http://127.0.0.1:{port + 1}) exited with code -9" in said
        assert refused(f"http://127.0.0.1:{port}")  # the survivor was stopped
    finally:
        stop(proc)


def test_the_slurm_servers_line_needs_a_key_and_plans_a_gpu_per_replica(model_dir):
    """docs/scaling.md "Rollout servers on SLURM": `replicas=4 host=0.0.0.0 port=8000` on a
    4-GPU node. Without `api_key` the launcher refuses before starting anything; with it,
    replica i listens on 8000+i and sees GPU i."""
    from serve_helpers import serve_config

    from astrai.serve.__main__ import launch_replicas

    line = [f"model_path={model_dir}", "replicas=4", "host=0.0.0.0", "port=8000"]
    with pytest.raises(SystemExit, match=r"host=0\.0\.0\.0: reachable .* api_key"):
        launch_replicas(serve_config(line))
    plan = plan_replicas(serve_config([*line, "api_key=sekret"]), gpus=["0", "1", "2", "3"])
    assert plan.urls == [f"http://127.0.0.1:{8000 + i}" for i in range(4)]  # as seen here
    assert plan.host == "0.0.0.0"  # what each replica listens on
    assert plan.visible_devices == ["0", "1", "2", "3"] and not plan.warnings


@pytest.mark.slow  # two server processes, the launcher killed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_takes_its_replicas_with_it(model_dir, tmp_path):
    port, log = free_port_block(3), tmp_path / "launcher.log"
    proc = launch(model_dir, port, log)
    try:
        wait_for_line(proc, log, "2 replicas ready on")
        proc.kill()  # SIGKILL: no handler forwards anything
        proc.wait()
        urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        deadline = time.monotonic() + 120  # a liveness bound, not a measured time
        while not all(refused(u) for u in urls):  # they stop gracefully, as on SIGTERM
            assert time.monotonic() < deadline, "replicas outlived their launcher"
            time.sleep(0.2)
        # uvicorn logs its last line after the socket closes: wait for it, not assume it
        while "Finished server process" not in log.read_text():
            assert time.monotonic() < deadline, f"no graceful stop: {log.read_text()[-2000:]}"
            time.sleep(0.2)
    finally:
        stop(proc)
