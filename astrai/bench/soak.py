"""Soak: ``python -m astrai.bench serve soak=10`` (minutes): a long-running server keeps its
memory and latency flat.

A real ``python -m astrai.serve`` subprocess serves the benchmark's model (random weights,
saved to a temporary directory) with `soak_adapters` random LoRA adapters and speculative
decoding (`soak_speculative`, ngram by default), on the benchmark's engine group. For
`soak` minutes, `soak_clients` concurrent clients (one spawned process, so their SSE
parsing does not disturb the probe) send a mix of requests: OpenAI streams, structured
outputs (`response_format` json_schema), logprobs with top_logprobs, n > 1, adapter
requests, Anthropic messages (streamed and not), and streams (of up to 512 tokens) whose
client disconnects 0-0.1 s after the first event. Meanwhile this process samples the server's resident memory
(``/proc/<pid>/status`` VmRSS) every `soak_sample_s` seconds and sends one fixed probe
request (greedy, fixed length) every `soak_probe_s` seconds. When traffic stops it waits
for the server to be idle and reads ``/stats``.

Reported per window of `soak_window_s` seconds (a minute by default): peak RSS and the
probe's p95 latency. Verdict (targets of issue #44):

- RSS flat: peak RSS of the last window at most `soak_rss_growth` (10%) above that of the
  second window (the first is warm-up);
- probe p95 flat: the last window's p95 at most `soak_p95_ratio` (1.5x) the second's;
- KV released: no running or waiting request and ``kv_used_tokens`` 0 once idle
  (prefix-cached pages nobody holds are not counted by the engine);
- disconnects were real: ``finished_requests["cancelled"]`` at least the number of streams
  the clients dropped (each asked for 512 tokens, far more than fit in its wait).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from astrai.bench.common import free_port, percentile, wait_healthy

logger = logging.getLogger(__name__)

KINDS = (
    "openai_stream",
    "structured",
    "logprobs",
    "n",
    "adapter",
    "disconnect",
    "anthropic",
    "anthropic_stream",
)
PROBE = "Count the words of this sentence, one by one, out loud."
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "light",
    "seven",
    "orange",
    "market",
    "window",
    "paper",
    "engine",
    "garden",
    "silver",
    "number",
    "yellow",
    "forest",
    "bridge",
]
SCHEMA_FIELDS = ("name", "city", "color", "count")


def check_options(cfg: dict[str, Any]) -> None:
    """Every soak option checked before anything is built: one line naming the option."""
    minutes = cfg["soak"]
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0:
        raise SystemExit(f"soak={minutes!r}: expected the soak's length in minutes (> 0)")
    for key in ("soak_window_s", "soak_sample_s", "soak_probe_s", "soak_rss_growth"):
        if not isinstance(cfg[key], (int, float)) or cfg[key] <= 0:
            raise SystemExit(f"{key}={cfg[key]!r}: expected a positive number")
    if cfg["soak_p95_ratio"] < 1:
        raise SystemExit(f"soak_p95_ratio={cfg['soak_p95_ratio']!r}: expected >= 1")
    for key in ("soak_clients", "soak_adapters"):
        if cfg[key] < 1:
            raise SystemExit(f"{key}={cfg[key]!r}: expected a positive int")
    if 60 * minutes < 3 * cfg["soak_window_s"]:
        raise SystemExit(
            f"soak={minutes}: shorter than three windows of soak_window_s={cfg['soak_window_s']}"
            " (the first is warm-up; growth is measured from the second to the last)"
        )
    if cfg["soak_env"] is not None and not isinstance(cfg["soak_env"], dict):
        raise SystemExit(f"soak_env={cfg['soak_env']!r}: expected a mapping NAME: value")


def hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar (strings quoted, mappings and lists in flow form)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def server_command(
    cfg: dict[str, Any], model_dir: Path, adapters: dict[str, Path], port: int
) -> list[str]:
    """The ``python -m astrai.serve`` command line: the benchmark's engine group (every key,
    so the server runs exactly it), speculation and the adapters on top."""
    engine = {k: v for k, v in cfg["engine"].items() if k not in ("_target_", "_partial_")}
    if engine.get("speculative") is None:
        engine["speculative"] = cfg["soak_speculative"]
    args = [
        sys.executable,
        "-m",
        "astrai.serve",
        f"model_path={hydra_value(str(model_dir))}",
        f"port={port}",
        "model_name=soak",
        f"device={cfg['device']}",
        f"lora_modules={hydra_value({k: str(v) for k, v in adapters.items()})}",
        *(f"engine.{k}={hydra_value(v)}" for k, v in engine.items()),
    ]
    if cfg["threads"]:
        args.append(f"threads={int(cfg['threads'])}")
    return args


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


# ---------------------------------------------------------------------------- traffic
def _prompt(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 40))]
    if rng.random() < 0.5:  # repetitive text: n-gram speculation finds drafts in it
        words = (words[:6] * 8)[: rng.randint(12, 48)]
    return " ".join(words)


def _body(kind: str, rng: random.Random, spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Route and JSON body of one request of `kind`."""
    messages = [{"role": "user", "content": _prompt(rng)}]
    temperature = rng.choice([0.0, 0.8])
    if kind.startswith("anthropic"):
        body = {
            "model": rng.choice(["soak", *spec["adapters"]]),
            "messages": messages,
            "max_tokens": rng.randint(4, 48),
            "temperature": temperature,
            "stream": kind == "anthropic_stream",
        }
        return "/v1/messages", body
    body = {"messages": messages, "max_tokens": rng.randint(4, 48), "temperature": temperature}
    if kind in ("openai_stream", "disconnect", "adapter"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "adapter":
        body["model"] = rng.choice(spec["adapters"])
    elif kind == "disconnect":  # far more tokens than it waits for before it leaves
        body["max_tokens"] = 512
        body["logit_bias"] = {str(t): -100 for t in spec["stop_ids"]}
    elif kind == "structured":
        field = rng.choice(SCHEMA_FIELDS)
        schema = {
            "type": "object",
            "properties": {field: {"type": "string", "maxLength": 12}},
            "required": [field],
            "additionalProperties": False,
        }
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": f"soak_{field}", "strict": True, "schema": schema},
        }
        body["max_tokens"] = 48
    elif kind == "logprobs":
        body |= {"logprobs": True, "top_logprobs": rng.randint(1, 5)}
    elif kind == "n":
        body |= {"n": rng.randint(2, 3), "temperature": 0.8}
    return "/v1/chat/completions", body


async def _one(
    client: Any, route: str, body: dict[str, Any], leave_after: float | None = None
) -> str:
    """Send one request; its outcome: ``ok``, ``disconnected`` or ``http <status>``. With
    `leave_after`, the client closes the stream that many seconds after its first event
    (by time, not by chunks: tokens without text send no chunk)."""
    if not body.get("stream"):
        r = await client.post(route, json=body)
        return "ok" if r.status_code == 200 else f"http {r.status_code}"
    async with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"http {r.status_code}"
        async for line in r.aiter_lines():
            if leave_after is not None and line.startswith("data: "):
                await asyncio.sleep(leave_after)  # the server keeps generating meanwhile
                return "disconnected"
    return "ok"


async def _traffic_async(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    import httpx

    deadline = spec["deadline"]
    counts: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    done_at: list[float] = []

    async def worker(i: int) -> None:
        rng = random.Random(spec["seed"] * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.time() < deadline:
                kind = rng.choice(KINDS)
                route, body = _body(kind, rng, spec)
                leave = rng.uniform(0.0, 0.1) if kind == "disconnect" else None
                t0 = time.perf_counter()
                try:
                    outcome = await _one(client, route, body, leave)
                except httpx.HTTPError as err:
                    outcome = f"error {type(err).__name__}"
                if outcome == "disconnected":
                    left_after.append(time.perf_counter() - t0)
                counts[kind][outcome] = counts[kind].get(outcome, 0) + 1
                done_at.append(time.time())

    left_after: list[float] = []
    await asyncio.gather(*(worker(i) for i in range(spec["clients"])))
    return {"counts": counts, "done_at": done_at, "left_after": left_after}


def _traffic(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a spawned process: the mixed clients, until `spec["deadline"]` (epoch s)."""
    return asyncio.run(_traffic_async(url, spec))


# ---------------------------------------------------------------------------- measuring
async def _measure(url: str, pid: int, cfg: dict[str, Any], spec: dict[str, Any]) -> dict:
    """RSS samples and probe latencies, both (epoch seconds, value), until the deadline."""
    import httpx

    samples: list[tuple[float, float]] = []
    probes: list[tuple[float, float]] = []
    probe_errors: list[str] = []
    body = {
        "messages": [{"role": "user", "content": PROBE}],
        "max_tokens": 16,
        "temperature": 0,
        "logit_bias": {str(t): -100 for t in spec["stop_ids"]},  # always 16 tokens
    }

    async def sample() -> None:
        width, logged = cfg["soak_window_s"], 0
        while time.time() < spec["deadline"]:
            samples.append((time.time(), rss_mib(pid)))
            done = int((time.time() - spec["start"]) // width)
            if done > logged:  # a window ended: progress for long soaks
                row = windows(spec["start"] + logged * width, width, width, samples, probes)[0]
                logger.info("soak window %d: %s", logged + 1, row)
                logged = done
            await asyncio.sleep(cfg["soak_sample_s"])

    async def probe() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.time() < spec["deadline"]:
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    probes.append((time.time(), time.perf_counter() - t0))
                else:
                    probe_errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                await asyncio.sleep(max(0.0, cfg["soak_probe_s"] - (time.perf_counter() - t0)))

    await asyncio.gather(sample(), probe())
    return {"samples": samples, "probes": probes, "probe_errors": probe_errors}


def windows(
    start: float, length: float, width: float, samples: list, probes: list
) -> list[dict[str, Any]]:
    """Per window of `width` seconds from `start`: RSS peak and median, probe p95 and p50."""
    out = []
    for i in range(max(1, round(length / width))):
        lo, hi = start + i * width, start + (i + 1) * width
        rss = [v for t, v in samples if lo <= t < hi]
        lat = [v for t, v in probes if lo <= t < hi]
        out.append(
            {
                "window": i + 1,
                "rss_peak_mib": max(rss) if rss else None,
                "rss_median_mib": percentile(rss, 0.5) if rss else None,
                "probe_p95_s": percentile(lat, 0.95) if lat else None,
                "probe_p50_s": percentile(lat, 0.5) if lat else None,
                "probes": len(lat),
            }
        )
    return out


def verdict(rows: list[dict[str, Any]], after: dict[str, Any], cfg: dict[str, Any]) -> dict:
    """The soak's pass/fail figures from its windows and the idle server's stats."""
    second, last = rows[1], rows[-1]

    def ratio(key: str) -> float | None:  # None: a window without a sample or probe
        if second[key] is None or last[key] is None:
            return None
        return last[key] / second[key]

    growth, p95 = ratio("rss_peak_mib"), ratio("probe_p95_s")
    idle = after["active_tasks"] == 0 and after["waiting_queue"] == 0
    return {
        "rss_growth": None if growth is None else growth - 1,
        "rss_flat": growth is not None and growth - 1 < cfg["soak_rss_growth"],
        "probe_p95_ratio": p95,
        "probe_flat": p95 is not None and p95 <= cfg["soak_p95_ratio"],
        "kv_released": idle and after["kv_used_tokens"] == 0,
        "disconnects_cancelled": after["cancelled"] >= after["disconnects"],
    }


# ---------------------------------------------------------------------------- the run
def _idle_stats(url: str, timeout: float = 120) -> dict[str, Any]:
    """``/stats`` once nothing runs or waits (or after `timeout` seconds, as it is then)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/stats", timeout=30).json()
        if stats["active_tasks"] == 0 and stats["waiting_queue"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def _prepare(cfg: dict[str, Any], root: Path) -> tuple[Path, dict[str, Path], list[int], Any]:
    """The model directory, the adapters, the stop ids and the report header."""
    from astrai.bench.common import bench_model, report_header
    from astrai.bench.lora import make_adapters
    from astrai.model import save_pretrained

    model, tokenizer, device = bench_model(cfg)
    model_dir = save_pretrained(model, root / "model", tokenizer=tokenizer)
    paths = make_adapters(
        model,
        cfg["soak_adapters"],
        rank=cfg["lora_rank"],
        targets=list(cfg["lora_targets"]),
        root=root,
        seed=cfg["seed"],
    )
    adapters = {f"soak-lora-{i}": p for i, p in enumerate(paths)}
    return model_dir, adapters, list(tokenizer.stop_ids), report_header(cfg, model, device)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The soak of the module docstring; returns its report."""
    import httpx

    check_options(cfg)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe
    length = 60.0 * cfg["soak"]
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="astrai-soak-") as tmp:
        root = Path(tmp)
        model_dir, adapters, stop_ids, header = _prepare(cfg, root)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = root / "server.log"
        env = {**os.environ, **{str(k): str(v) for k, v in (cfg["soak_env"] or {}).items()}}
        command = server_command(cfg, model_dir, adapters, port)
        logger.info("starting the server: %s", " ".join(command))
        with log.open("w") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(proc, url, log=log)
            rss_start = rss_mib(proc.pid)
            spec = {
                "adapters": list(adapters),
                "stop_ids": stop_ids,
                "clients": cfg["soak_clients"],
                "seed": cfg["seed"],
            }
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                pool.apply(_traffic, (url, {**spec, "deadline": time.time() + 1}))  # warm up
                start = time.time()
                spec |= {"start": start, "deadline": start + length}
                pending = pool.apply_async(_traffic, (url, spec))
                measured = asyncio.run(_measure(url, proc.pid, cfg, spec))
                traffic = pending.get()
                load = os.getloadavg()
            if proc.poll() is not None:
                raise RuntimeError(f"the server died: {log.read_text()[-3000:]}")
            stats = _idle_stats(url)
            rss_idle = rss_mib(proc.pid)
            health = httpx.get(url + "/health").status_code
        finally:  # SIGTERM: a background shell makes its jobs ignore SIGINT
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server_log_tail = log.read_text(errors="replace")[-2000:]
    rows = windows(start, length, cfg["soak_window_s"], measured["samples"], measured["probes"])
    counts = traffic["counts"]
    disconnects = counts["disconnect"].get("disconnected", 0)
    finished = stats.get("finished_requests", {})
    after = {
        "active_tasks": stats["active_tasks"],
        "waiting_queue": stats["waiting_queue"],
        "kv_used_tokens": stats["kv_used_tokens"],
        "kv_usage": stats["kv_usage"],
        "prefix_cached_tokens": stats.get("prefix_cached_tokens"),
        "finished_requests": finished,
        "cancelled": finished.get("cancelled", 0),
        "disconnects": disconnects,
        # seconds from sending to leaving, seen by the disconnecting clients
        "disconnect_after_s": _spread(traffic["left_after"]),
        "health": health,
        "rss_idle_mib": rss_idle,
        "spec": {k: v for k, v in stats.items() if k.startswith("spec_")},
    }
    return {
        **header,
        "soak_minutes": cfg["soak"],
        "load_average_start": list(load_start),
        "load_average_end": list(load),
        "rss_start_mib": rss_start,
        "requests": {k: dict(sorted(v.items())) for k, v in counts.items()},
        "requests_total": len(traffic["done_at"]),
        "probe_errors": measured["probe_errors"][:5],
        "windows": rows,
        "rss_samples": [[round(t - start, 2), v] for t, v in measured["samples"]],
        "after": after,
        "verdict": verdict(rows, after, cfg),
        "server_log_tail": server_log_tail,
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {q: percentile(values, p) for q, p in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))}


def _pct(value: float | None) -> str:
    return "n/a (a window without samples)" if value is None else f"{100 * value:+.1f}%"


def _times(value: float | None) -> str:
    return "n/a (a window without probes)" if value is None else f"{value:.2f}x"


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"soak {report['soak_minutes']} min: model {report['model']} "
        f"({report['parameters'] / 1e6:.1f}M params) on {report['device']}, "
        f"{cfg['soak_clients']} mixed clients, {report['requests_total']} requests; "
        f"load average {report['load_average_start'][0]:.2f} at the start, "
        f"{report['load_average_end'][0]:.2f} at the end",
        f"{'window':>6} {'RSS peak MiB':>13} {'median':>8} {'probe p50 s':>12} "
        f"{'p95 s':>7} {'probes':>6}",
    ]
    for w in report["windows"]:

        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        lines.append(
            f"{w['window']:>6} {num(w['rss_peak_mib'], '13.1f')} "
            f"{num(w['rss_median_mib'], '8.1f')} {num(w['probe_p50_s'], '12.3f')} "
            f"{num(w['probe_p95_s'], '7.3f')} {w['probes']:>6}"
        )
    for kind, outcomes in report["requests"].items():
        lines.append(f"  {kind:17} {outcomes}")
    a, v = report["after"], report["verdict"]
    lines += [
        f"idle after traffic: {a['active_tasks']} running, {a['waiting_queue']} waiting, "
        f"kv_used_tokens {a['kv_used_tokens']}, RSS {a['rss_idle_mib']:.1f} MiB; "
        f"{a['disconnects']} streams dropped by clients, {a['cancelled']} tasks cancelled",
        f"RSS growth window 2 -> last: {_pct(v['rss_growth'])} "
        f"(target < {100 * cfg['soak_rss_growth']:.0f}%): {'PASS' if v['rss_flat'] else 'FAIL'}",
        f"probe p95 last / window 2: {_times(v['probe_p95_ratio'])} "
        f"(target <= {cfg['soak_p95_ratio']}x): {'PASS' if v['probe_flat'] else 'FAIL'}",
        f"KV released with nothing running: {'PASS' if v['kv_released'] else 'FAIL'}; "
        f"disconnects cancelled: {'PASS' if v['disconnects_cancelled'] else 'FAIL'}",
    ]
    return "\n".join(lines)
