"""Serving benchmark: output tokens/s through HTTP streaming vs the offline engine.

One engine, one workload, one run. `requests` chat prompts of `prompt_min..prompt_max`
words each ask for `output_min..output_max` tokens, greedy, all sent at t=0 (saturation).
The stop tokens get a logit bias of -100, a plain OpenAI request field, so every request
runs to its `max_tokens` on both paths and the token counts are identical. The offline
side submits the same prompt ids straight to the engine; the HTTP side streams
`/v1/chat/completions` from a client in a separate process (so the client's SSE parsing
does not compete with the server for the GIL). Reported: tokens/s of both, their ratio
(target >= 0.9) and TTFT p50/p99 (HTTP TTFT: request sent to first content chunk, seen by
the client). With `structured=true` the HTTP workload runs once more with
`response_format: json_schema` (a schema no answer completes within its `max_tokens`, so
the token counts stay equal), and the offline side once more with the same constraint
(`SamplingParams.structured`): the structured-output overhead, as the ratios of the HTTP
figures (target >= 0.8) and of the offline ones (also per CPU second of this process,
which other processes on a shared machine disturb less than wall time). Options:
``conf/bench/serve.yaml``; the engine is the engine group's (``engine.*``). With
``lora=[1,4,16]`` (or ``lora=16``, ``lora=true``) the LoRA throughput benchmark runs instead:
base-only against requests spread over that many adapters (:mod:`astrai.bench.lora`). With
``soak=<minutes>`` a soak runs instead: a server under mixed traffic keeps its memory and
latency flat (:mod:`astrai.bench.soak`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import random
import time
from typing import Any

from astrai.bench.common import bench_model, model_name, percentile, report_header, throughput

logger = logging.getLogger(__name__)

# One string of at least 4096 characters: no answer of the workload can close it, so a
# constrained request runs to its max_tokens like a plain one (equal token counts), while
# every step still computes its grammar mask.
STRUCTURED_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "minLength": 4096}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}


async def _stream_all(url: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def one(body: dict[str, Any]) -> tuple[float | None, int, str | None]:
            t0 = time.perf_counter()
            first, tokens, error = None, 0, None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return None, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        error = data["error"]["message"]
                    for c in data.get("choices", ()):
                        if first is None and c["delta"].get("content"):
                            first = time.perf_counter() - t0
                    if data.get("usage") and not data["choices"]:
                        tokens = data["usage"]["completion_tokens"]
            return first, tokens, error

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - start
    errors = [e for _, _, e in results if e]
    ttft = [t for t, _, _ in results if t is not None]
    tokens = sum(n for _, n, _ in results)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50": percentile(ttft, 0.5) if ttft else None,
        "ttft_p99": percentile(ttft, 0.99) if ttft else None,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
    }


def _client(url: str, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs in a spawned process: all requests at once, SSE parsed with plain httpx."""
    return asyncio.run(_stream_all(url, bodies))


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Offline and HTTP throughput on the workload of conf/bench/serve.yaml; with `lora`,
    the LoRA throughput benchmark instead (astrai/bench/lora.py); with `soak`, the soak
    (astrai/bench/soak.py)."""
    if cfg.get("soak") is not None:
        from astrai.bench.soak import run as run_soak

        return run_soak(cfg)
    if cfg.get("lora") not in (None, False):
        from astrai.bench.lora import run as run_lora

        return run_lora(cfg)
    # Imported here: the spawned client process imports this module and needs none of them.
    from hydra.utils import instantiate

    from astrai.inference.structured import StructuredOutput
    from astrai.serve import ServerThread, ServeSettings, create_app

    model, tokenizer, device = bench_model(cfg)

    rng = random.Random(cfg["seed"])
    words = [w for w in tokenizer.decode(range(300, 1200)).split() if w.isalpha()] or ["word"]
    prompts = [
        " ".join(
            rng.choice(words) for _ in range(rng.randint(cfg["prompt_min"], cfg["prompt_max"]))
        )
        for _ in range(cfg["requests"])
    ]
    outputs = [rng.randint(cfg["output_min"], cfg["output_max"]) for _ in prompts]
    bias = {t: -100.0 for t in tokenizer.stop_ids}
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in prompts
    ]
    max_len = max(len(p) + n for p, n in zip(ids, outputs)) + 1
    engine = instantiate(cfg["engine"])(model, tokenizer, max_seq_len=max_len)
    report: dict[str, Any] = {
        **report_header(cfg, model, device),
        "workload": {
            "requests": len(prompts),
            "prompt_tokens": sum(map(len, ids)),
            "output_tokens": sum(outputs),
        },
    }

    def offline(structured: Any = None) -> dict[str, Any]:
        grammar = engine.runner.grammar_rows
        start, cpu, masks = time.perf_counter(), time.process_time(), grammar.seconds
        results = [
            engine.submit(p, max_tokens=n, temperature=0.0, logit_bias=bias, structured=structured)
            for p, n in zip(ids, outputs)
        ]
        for r in results:
            r.wait_completion()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        ttft = [r.task.first_token_at - start for r in results]
        tokens = sum(len(r.token_ids) for r in results)
        return {
            **throughput(tokens, wall, ttft),
            # this process's CPU time (llguidance's mask threads included): less sensitive
            # than wall time to other processes on a shared machine
            "tokens_per_cpu_s": tokens / cpu,
            # share of the wall time spent computing and applying grammar masks
            "grammar_share": (grammar.seconds - masks) / wall,
        }

    bodies = [
        {
            "messages": [{"role": "user", "content": p}],
            "max_tokens": n,
            "temperature": 0,
            "logit_bias": {str(t): b for t, b in bias.items()},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for p, n in zip(prompts, outputs)
    ]
    try:
        engine.generate("warm up", max_tokens=2, temperature=0.0)
        app = create_app(engine, ServeSettings(model_name=model_name(cfg)))
        with (
            ServerThread(app) as server,
            multiprocessing.get_context("spawn").Pool(1) as pool,
        ):
            pool.apply(_client, (server.url, bodies[:2]))  # warm up the client and the server
            structured = [dict(b, response_format=STRUCTURED_FORMAT) for b in bodies]
            schema = StructuredOutput.json_schema(STRUCTURED_FORMAT["json_schema"]["schema"])
            if cfg.get("structured"):  # compile the schema and the mask kernel first
                pool.apply(_client, (server.url, structured[:2]))
            offline_runs, http_runs, structured_runs, offline_structured = [], [], [], []
            for i in range(cfg["repeats"]):
                offline_runs.append(offline())
                logger.info("offline run %d: %s", i, offline_runs[-1])
                # (server-side latencies: /metrics, astrai.serve.metrics)
                http_runs.append(pool.apply(_client, (server.url, bodies)))
                logger.info("http run %d: %s", i, http_runs[-1])
                if cfg.get("structured"):
                    structured_runs.append(pool.apply(_client, (server.url, structured)))
                    logger.info("structured run %d: %s", i, structured_runs[-1])
                    offline_structured.append(offline(schema))
                    logger.info("offline structured run %d: %s", i, offline_structured[-1])
    finally:
        engine.shutdown()
    report["offline"] = max(offline_runs, key=lambda r: r["tokens_per_s"])
    report["http"] = max(http_runs, key=lambda r: r["tokens_per_s"])
    report["ratio"] = report["http"]["tokens_per_s"] / report["offline"]["tokens_per_s"]
    if structured_runs:
        best = max(structured_runs, key=lambda r: r["tokens_per_s"])
        report["http_structured"] = best
        report["structured_ratio"] = best["tokens_per_s"] / report["http"]["tokens_per_s"]
        best = max(offline_structured, key=lambda r: r["tokens_per_s"])
        report["offline_structured"] = best
        plain = report["offline"]
        report["offline_structured_ratio"] = best["tokens_per_s"] / plain["tokens_per_s"]
        report["offline_structured_cpu_ratio"] = (
            best["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"]
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    if "windows" in report:  # soak=...
        from astrai.bench.soak import format_report as format_soak

        return format_soak(report)
    if "rows" in report:  # lora=...
        from astrai.bench.lora import format_report as format_lora

        return format_lora(report)
    w = report["workload"]
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M params) on "
        f"{report['device']}, {report['threads']} threads; {w['requests']} requests, "
        f"{w['prompt_tokens']} prompt / {w['output_tokens']} output tokens, all at t=0"
    ]
    for name in ("offline", "http", "offline_structured", "http_structured"):
        if name not in report:
            continue
        r = report[name]
        lines.append(
            f"{name:18} {r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50']:.2f}s "
            f"p99 {r['ttft_p99']:.2f}s  ({r['tokens']} tokens in {r['seconds']:.1f}s)"
        )
    h = report["http"]
    if h.get("server_ttft_p50") is not None:
        lines.append(
            f"         HTTP TTFT measured in the server (request queued -> first token): "
            f"p50 {h['server_ttft_p50']:.2f}s p99 {h['server_ttft_p99']:.2f}s"
        )
    for name in ("http", "http_structured"):
        if report.get(name, {}).get("errors"):
            lines.append(f"{name} errors: {report[name]['errors']} ({report[name]['first_error']})")
    lines.append(f"ratio http / offline: {report['ratio']:.3f} (target >= 0.9)")
    if "structured_ratio" in report:
        lines.append(
            f"ratio http json_schema / http: {report['structured_ratio']:.3f} (target >= 0.8)"
        )
        lines.append(
            f"ratio offline json_schema / offline: {report['offline_structured_ratio']:.3f} "
            f"(tokens per CPU second: {report['offline_structured_cpu_ratio']:.3f}); grammar "
            f"masks took {100 * report['offline_structured']['grammar_share']:.1f}% of its wall"
        )
    return "\n".join(lines)
