"""The vLLM side of `bench engine`'s vLLM peer, run by the side venv's python as a script:
``python -P vllm_child.py REQUEST.json RESULT.json``. It imports only the standard library
and vLLM (never astrai, whose torch is another build), so that the two never meet.

REQUEST: ``{"model": HF dir, "work": [[prompt ids, max_tokens], ...], "max_model_len": int,
"dtype": str, "repeats": int}``. RESULT: the best of ``repeats`` timed runs (tokens/s) as
``tokens, seconds, tokens_per_s, ttft_p50, ttft_p99`` (TTFT from vLLM's per-request
metrics, from the start of the run), ``token_ids`` per request, ``vllm_version``; or
``{"missing": why}`` with exit code `MISSING` when vLLM does not import. With ``"points":
[{"name": str, "work": [...]}, ...]`` instead of ``"work"`` (the scaling benchmark), one
engine runs every point and RESULT is ``{"points": [figures per point, with "rss_bytes",
the resident memory of this process and its workers after the point], "vllm_version"}``. Every request is
greedy with ``min_tokens = max_tokens`` and EOS ignored, all handed to one `LLM.generate`
after the engine started and one untimed warm-up generate, with the prefix cache emptied
before each timed run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MISSING = 3  # exit code: vLLM does not import here


def _percentile(values: list[float], q: float) -> float:
    """`astrai.bench.common.percentile` (nearest rank), which this script cannot import."""
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _run(llm: Any, prompts: list[Any], params: list[Any]) -> dict[str, Any]:
    # vLLM's prefix cache stays on (its default) but starts empty, as astrai's engines do in
    # every run: an earlier repeat's prompts must not spare this one its prefill
    llm.reset_prefix_cache()
    start_wall, start = time.time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(i) for i in ids)
    # arrival_time is wall-clock; first_token_latency counts from it (needs log stats on)
    ttft = [
        o.metrics.arrival_time + o.metrics.first_token_latency - start_wall
        for o in outs
        if getattr(o, "metrics", None) is not None and o.metrics.first_token_latency > 0
    ]
    out: dict[str, Any] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if ttft:
        out |= {"ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99)}
    out["token_ids"] = ids
    return out


def _tree_rss() -> int:
    """Resident bytes of this process and its descendants (vLLM's engine core is a child)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry.name)
        parents[pid] = int(fields.get("PPid", "0").strip())
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    tree, frontier = set(), [os.getpid()]
    while frontier:
        pid = frontier.pop()
        tree.add(pid)
        frontier.extend(c for c, parent in parents.items() if parent == pid and c not in tree)
    return sum(rss.get(pid, 0) for pid in tree)


def _params(sampling: Any, work: list[Any]) -> list[Any]:
    return [sampling(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0) for _, n in work]


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        Path(result_path).write_text(json.dumps({"missing": f"{type(err).__name__}: {err}"}))
        return MISSING
    llm = LLM(
        model=request["model"],
        skip_tokenizer_init=True,
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        disable_log_stats=False,  # per-request metrics: the TTFT
        seed=0,
    )
    warm = SamplingParams(max_tokens=2, min_tokens=2, ignore_eos=True, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], [warm], use_tqdm=False)
    repeats = max(1, int(request["repeats"]))
    version = getattr(vllm, "__version__", "unknown")
    if "points" in request:
        points = []
        for point in request["points"]:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in point["work"]]
            params = _params(SamplingParams, point["work"])
            runs = [_run(llm, prompts, params) for _ in range(repeats)]
            best = max(runs, key=lambda r: r["tokens_per_s"])
            best.pop("token_ids")
            points.append({"name": point["name"], **best, "rss_bytes": _tree_rss()})
        Path(result_path).write_text(json.dumps({"points": points, "vllm_version": version}))
        return 0
    work = request["work"]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in work]
    runs = [_run(llm, prompts, _params(SamplingParams, work)) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tokens_per_s"])
    best["vllm_version"] = version
    Path(result_path).write_text(json.dumps(best))
    return 0


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    sys.exit(main(sys.argv[1], sys.argv[2]))
