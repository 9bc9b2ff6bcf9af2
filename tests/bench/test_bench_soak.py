"""`python -m astrai.bench serve soak=...`: the soak's machinery. A short soak against a real
`python -m astrai.serve` subprocess checks the report, that every kind of request was served,
that the disconnecting clients really left (the server cancelled their tasks) and that the
KV cache is empty once traffic stops; the figures' pure parts (windows, verdict, options,
the server's command line) are checked on their own. No wall-clock thresholds: whether
RSS and latency stay flat is the 10-minute record's verdict (experiments/bench/soak.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from astrai.bench.__main__ import bench_config, main
from astrai.bench.soak import KINDS, format_report, hydra_value, server_command, verdict, windows


@pytest.mark.slow  # a server subprocess and 30 s of traffic
def test_a_short_soak_reports_every_window_and_releases_the_kv(tmp_path):
    out = tmp_path / "soak.json"
    report = main(
        [
            "serve",
            "model=tiny",
            "soak=0.5",
            "soak_window_s=10",
            "soak_sample_s=1",
            "soak_probe_s=1",
            "soak_clients=4",
            "soak_adapters=2",
            "lora_rank=4",
            "engine=paged",
            "engine.max_batch_size=8",
            "threads=1",
            f"out={out}",
        ]
    )
    saved = json.loads(out.read_text())
    assert saved["windows"] == report["windows"] and len(saved["windows"]) == 3
    for w in saved["windows"]:
        assert w["rss_peak_mib"] >= w["rss_median_mib"] > 0
        assert w["probes"] > 0 and w["probe_p95_s"] >= w["probe_p50_s"] > 0
    assert saved["rss_samples"] and all(rss > 0 for _, rss in saved["rss_samples"])
    assert not saved["probe_errors"]
    # every kind of request ran and was served (disconnecting streams left early)
    for kind in KINDS:
        outcomes = saved["requests"][kind]
        expected = "disconnected" if kind == "disconnect" else "ok"
        assert set(outcomes) == {expected} and outcomes[expected] > 0, (kind, outcomes)
    after = saved["after"]
    # the server saw the clients leave: it cancelled (at least) each dropped stream
    assert after["disconnects"] == saved["requests"]["disconnect"]["disconnected"]
    assert after["cancelled"] >= after["disconnects"] > 0
    # idle: nothing running or waiting, no KV held by any request, still healthy
    assert (after["active_tasks"], after["waiting_queue"], after["kv_used_tokens"]) == (0, 0, 0)
    assert after["health"] == 200
    assert after["spec"]["spec_num_drafts"] > 0  # speculation was on
    v = saved["verdict"]
    assert v["kv_released"] is True and v["disconnects_cancelled"] is True
    assert isinstance(v["rss_growth"], float) and isinstance(v["rss_flat"], bool)
    assert isinstance(v["probe_p95_ratio"], float) and isinstance(v["probe_flat"], bool)
    text = format_report(report)
    assert "RSS growth window 2 -> last" in text and "target < 10%" in text


def test_windows_and_verdict():
    samples = [(t, 100.0 + t) for t in range(30)]  # RSS grows 1 MiB/s
    probes = [(t + 0.5, 0.1 if t < 20 else 0.3) for t in range(30)]
    rows = windows(0.0, 30.0, 10.0, samples, probes)
    assert [r["rss_peak_mib"] for r in rows] == [109.0, 119.0, 129.0]
    assert [r["probes"] for r in rows] == [10, 10, 10]
    after = {
        "active_tasks": 0,
        "waiting_queue": 0,
        "kv_used_tokens": 0,
        "cancelled": 3,
        "disconnects": 3,
    }
    cfg = {"soak_rss_growth": 0.10, "soak_p95_ratio": 1.5}
    v = verdict(rows, after, cfg)
    assert v["rss_growth"] == pytest.approx(129 / 119 - 1) and v["rss_flat"] is True
    assert v["probe_p95_ratio"] == pytest.approx(3.0) and v["probe_flat"] is False
    assert v["kv_released"] and v["disconnects_cancelled"]
    assert not verdict(rows, {**after, "kv_used_tokens": 16}, cfg)["kv_released"]
    assert not verdict(rows, {**after, "cancelled": 2}, cfg)["disconnects_cancelled"]
    assert not verdict(rows, after, {**cfg, "soak_rss_growth": 0.05})["rss_flat"]


@pytest.mark.parametrize(
    "value",
    [None, True, 3, 0.25, "ngram", "/tmp/a b/it's", {"method": "ngram", "k": [1, 2]}, [1, "x"]],
)
def test_values_reach_the_server_as_given(value):
    parsed = OverridesParser.create().parse_overrides([f"key={hydra_value(value)}"])[0]
    assert parsed.value() == value


def test_the_server_runs_the_benchmarks_engine_with_speculation_and_adapters(tmp_path):
    cfg = bench_config("serve", ["soak=1", "engine=paged", "engine.max_batch_size=8"])
    command = server_command(cfg, tmp_path / "model", {"a": tmp_path / "a"}, 8123)
    assert command[1:3] == ["-m", "astrai.serve"]
    assert "engine.cache_mode='paged'" in command and "engine.max_batch_size=8" in command
    assert "port=8123" in command
    assert any(c.startswith("engine.speculative={method:'ngram'") for c in command)
    assert f"lora_modules={{a:'{tmp_path / 'a'}'}}" in command
    given = bench_config("serve", ["soak=1", "engine.speculative={method: ngram}"])
    command = server_command(given, Path("m"), {}, 1)
    assert "engine.speculative={method:'ngram'}" in command  # the engine group's wins


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["soak=0"], "soak=0"),
        (["soak=true"], "soak=True"),
        (["soak=2"], "soak=2: shorter than three windows"),
        (["soak=3", "soak_clients=0"], "soak_clients=0"),
        (["soak=3", "soak_p95_ratio=0.5"], "soak_p95_ratio=0.5"),
        (["soak=3", "soak_env=[A]"], "soak_env=['A']"),
    ],
)
def test_bad_options_are_named_before_anything_is_built(overrides, named, monkeypatch):
    import astrai.bench.soak as soak

    def never(*args, **kwargs):
        pytest.fail("the model was built")

    monkeypatch.setattr(soak, "_prepare", never)
    with pytest.raises(SystemExit, match=named.replace("[", r"\[").replace("]", r"\]")):
        main(["serve", "model=tiny", *overrides])


def test_a_window_without_probes_fails_the_verdict_instead_of_crashing():
    rows = windows(0.0, 30.0, 10.0, [(t, 100.0) for t in range(30)], [(1.0, 0.1), (25.0, 0.1)])
    assert rows[1]["probe_p95_s"] is None
    after = {"active_tasks": 0, "waiting_queue": 0, "kv_used_tokens": 0}
    v = verdict(
        rows,
        {**after, "cancelled": 0, "disconnects": 0},
        {"soak_rss_growth": 0.1, "soak_p95_ratio": 1.5},
    )
    assert v["probe_p95_ratio"] is None and v["probe_flat"] is False and v["rss_flat"] is True
