"""Scaling curves: how astrai's costs grow with the work, beside vLLM's CPU build.

Four curves on one model (conf/bench/scaling.yaml), each point a workload of random prompt
ids, greedy, EOS ignored, every request at t=0 (astrai: `InferenceEngine` as `bench engine`
runs it; vLLM: one child process, one `LLM` for every point, astrai/bench/vllm_child.py):

- throughput (tokens/s) vs concurrent requests;
- TTFT vs prompt length (one request, one new token: the prefill);
- decode step time vs context length (one request: ``(time - TTFT) / (new tokens - 1)``);
- memory vs concurrent requests: the resident bytes of the process (vLLM: with its engine
  core and workers) after each concurrency point. vLLM reserves its KV space up front
  (``VLLM_CPU_KVCACHE_SPACE``), astrai's paged pool is sized by ``engine.kv_tokens``, so
  the report also gives astrai's KV bytes in use at the point's peak.

`plots=DIR` draws each curve (both sides, log-scaled x) as a PNG with matplotlib.
"""

from __future__ import annotations

import logging
import random
import resource
import time
from pathlib import Path
from typing import Any

from hydra.utils import instantiate

from astrai.bench.common import as_list, bench_model, report_header, throughput
from astrai.bench.engine_phases import Work
from astrai.bench.engine_vllm import run_child, selected_peers
from astrai.inference import InferenceEngine
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

CURVES = ("concurrency", "prompt_length", "context")


def points(cfg: dict[str, Any], vocab: int) -> list[dict[str, Any]]:
    """Every point of the four curves: `{"curve", "x", "name", "work"}`."""
    rng = random.Random(cfg["seed"])

    def prompt(n: int) -> list[int]:
        return [rng.randrange(16, vocab) for _ in range(n)]

    out = []
    for n in as_list(cfg["concurrency"]):
        work = [(prompt(cfg["concurrency_prompt"]), cfg["concurrency_output"]) for _ in range(n)]
        out.append({"curve": "concurrency", "x": int(n), "work": work})
    for n in as_list(cfg["prompt_lengths"]):
        out.append({"curve": "prompt_length", "x": int(n), "work": [(prompt(int(n)), 1)]})
    for n in as_list(cfg["contexts"]):
        out.append(
            {"curve": "context", "x": int(n), "work": [(prompt(int(n)), cfg["context_output"])]}
        )
    for p in out:
        p["name"] = f"{p['curve']}={p['x']}"
    return out


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_astrai_point(eng: InferenceEngine, work: Work) -> dict[str, Any]:
    """`work` submitted at once to a running engine: its figures, RSS and peak KV in use."""
    eng.pool.reset_peak_used_tokens()  # the engine is idle between points
    start = time.perf_counter()
    results = [eng.submit(p, max_tokens=n, temperature=0.0, ignore_eos=True) for p, n in work]
    for r in results:
        r.wait_completion()
    wall = time.perf_counter() - start
    ttft = [r.task.first_token_at - start for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    return {
        **throughput(tokens, wall, ttft),
        "rss_bytes": _rss_bytes(),
        "kv_bytes_in_use": eng.pool.peak_used_tokens * eng.pool.bytes_per_token,
    }


def run_astrai(
    cfg: dict[str, Any], model: Transformer, tokenizer: AutoTokenizer, grid: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One engine for every point (as vLLM's child), best of `repeats` runs per point."""
    context = max(len(p) + n for point in grid for p, n in point["work"]) + 1
    engine = instantiate(cfg["engine"])
    out = []
    with engine(model, tokenizer, max_seq_len=context) as eng:
        eng.generate([[1, 2, 3]], max_tokens=2, temperature=0.0)  # warm-up
        for point in grid:
            runs = [run_astrai_point(eng, point["work"]) for _ in range(cfg["repeats"])]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            logger.info(
                "astrai %s: %.1f tok/s, TTFT p50 %.3f s",
                point["name"],
                best["tokens_per_s"],
                best["ttft_p50"],
            )
            out.append({"name": point["name"], **best})
    return out


def derived(point: dict[str, Any], figures: dict[str, Any]) -> dict[str, float]:
    """The curve's y value(s) of one side's figures at `point`."""
    if point["curve"] == "concurrency":
        return {"tokens_per_s": figures["tokens_per_s"], "rss_mib": figures["rss_bytes"] / 2**20}
    if point["curve"] == "prompt_length":
        return {"ttft_s": figures["ttft_p50"]}
    steps = max(1, figures["tokens"] - 1)
    return {"decode_step_ms": (figures["seconds"] - figures["ttft_p50"]) / steps * 1e3}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    peers = selected_peers(cfg)
    unknown = [p for p in peers if p != "vllm"]
    if unknown:
        raise SystemExit(f"peers: {unknown[0]!r} is not a scaling peer; use [vllm] or []")
    model, tokenizer, device = bench_model(cfg)
    grid = points(cfg, model.config.vocab_size)
    report: dict[str, Any] = report_header(cfg, model, device)
    ours = run_astrai(cfg, model, tokenizer, grid)
    theirs: dict[str, dict[str, Any]] = {}
    if "vllm" in peers:
        context = max(len(p) + n for point in grid for p, n in point["work"]) + 1
        payload = {
            "points": [
                {"name": p["name"], "work": [[list(ids), n] for ids, n in p["work"]]} for p in grid
            ],
            "max_model_len": context,
        }
        result = run_child(cfg, model, payload, "scaling")
        if "note" in result:
            report["vllm_note"] = result["note"]
        else:
            report["vllm_version"] = result["vllm_version"]
            theirs = {p["name"]: p for p in result["points"]}
    report["points"] = [
        {
            "curve": point["curve"],
            "x": point["x"],
            "astrai": {**mine, **derived(point, mine)},
            **(
                {"vllm": {**theirs[point["name"]], **derived(point, theirs[point["name"]])}}
                if point["name"] in theirs
                else {}
            ),
        }
        for point, mine in zip(grid, ours)
    ]
    if cfg["plots"]:
        report["plots"] = plot(report, Path(cfg["plots"]))
    return report


PLOTS = {  # curve -> (y key, y label, file name, log-scaled y)
    "concurrency": [
        ("tokens_per_s", "output tokens/s", "scaling-throughput.png", False),
        ("rss_mib", "resident memory (MiB)", "scaling-memory.png", False),
    ],
    "prompt_length": [("ttft_s", "TTFT (s)", "scaling-ttft.png", True)],
    "context": [("decode_step_ms", "decode step (ms)", "scaling-decode.png", False)],
}
X_LABELS = {
    "concurrency": "concurrent requests",
    "prompt_length": "prompt length (tokens)",
    "context": "context length (tokens)",
}


def plot(report: dict[str, Any], folder: Path) -> list[str]:
    """One PNG per curve (astrai and vLLM where it ran); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for curve, specs in PLOTS.items():
        rows = [p for p in report["points"] if p["curve"] == curve]
        if not rows:
            continue
        for key, label, name, log_y in specs:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for side, style in (("astrai", "o-"), ("vllm", "s--")):
                pts = [(p["x"], p[side][key]) for p in rows if side in p]
                if pts:
                    ax.plot(*zip(*pts), style, label="vLLM-CPU" if side == "vllm" else side)
            ax.set_xscale("log", base=2)
            if log_y:
                ax.set_yscale("log")
            ax.set_xlabel(X_LABELS[curve])
            ax.set_ylabel(label)
            ax.set_title(f"{report['model']}: {label} vs {X_LABELS[curve]}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = folder / name
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(str(path))
    return written


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"scaling curves, {report['model']} ({report.get('vllm_version') or report.get('vllm_note', 'astrai only')})"
    ]
    lines.append("| curve | x | astrai | vLLM-CPU | astrai / vLLM |")
    lines.append("|---|---:|---:|---:|---:|")
    for p in report["points"]:
        for key, _, _, _ in PLOTS[p["curve"]]:
            ours = p["astrai"][key]
            theirs = p.get("vllm", {}).get(key)
            if theirs is None:
                ratio = "-"
            elif key == "tokens_per_s":
                ratio = f"{ours / theirs:.2f}x"
            else:  # lower is better: theirs / ours reads as a speed-up
                ratio = f"{theirs / ours:.2f}x"
            cell = "-" if theirs is None else f"{theirs:.3g}"
            lines.append(f"| {key} | {p['x']} | {ours:.3g} | {cell} | {ratio} |")
    for path in report.get("plots", []):
        lines.append(f"plot: {path}")
    return "\n".join(lines)
