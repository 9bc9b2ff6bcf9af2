"""Engine runs for `bench engine` beyond the one-point throughput: the synchronous scheduler
loop, the `generate_async` path, prefill and decode speeds, and the prefix cache's cost.

Methods (every run: greedy, EOS ignored, all requests queued at t=0, after a warm-up):

- **sync**: every request is submitted to an engine whose background loop is off, then
  `engine.step()` runs on the calling thread until nothing is left: `run_batch`'s loop, with
  the mixed output lengths that `run_batch`'s single `max_tokens` cannot express.
- **async**: the server's path. One asyncio loop starts a `generate_async` stream per
  request at once (the engine's loop thread runs them) and consumes every stream to its end.
- **prefill and decode tokens/s**: the sync run times each `engine.step()`. A step in
  which some request gets its first token is a prefill step (prompt chunks, plus the decode
  rows running beside them); any other step is a decode step. Prefill tokens/s = prompt
  tokens / time of the prefill steps; decode tokens/s = tokens sampled in decode steps /
  their time. The counts come from the requests' own tasks, so no engine timers are needed.
- **prefix-cache overhead at 0% hits**: the sync run through the paged KV cache with the
  radix prefix cache and with the no-op prefix cache (`prefix_cache=False`:
  `NoPrefixCache`), on distinct random prompts that share no complete page; the radix run
  reports its hit rate (0) and the tokens its tree indexed (> 0: it did its work). Overhead = no-op tokens/s / radix
  tokens/s - 1 (target < 2%), on the best of `repeats` alternated runs of each.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from astrai.bench.common import throughput
from astrai.inference import InferenceEngine
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer

Work = list[tuple[list[int], int]]
EngineFactory = Callable[..., InferenceEngine]


def workload(cfg: dict[str, Any], vocab: int) -> Work:
    """`cfg["requests"]` (random prompt, output length) pairs: distinct prompts, mixed lengths."""
    rng = random.Random(cfg["seed"])
    return [
        (
            [
                rng.randrange(16, vocab)
                for _ in range(rng.randint(cfg["prompt_min"], cfg["prompt_max"]))
            ],
            rng.randint(cfg["output_min"], cfg["output_max"]),
        )
        for _ in range(cfg["requests"])
    ]


def max_len(work: Work) -> int:
    """The engine context that fits every request of `work` (prompt, output, one spare)."""
    return max(len(p) + n for p, n in work) + 1


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of repeated runs (tokens/s): damps a shared machine's noise."""
    return max(runs, key=lambda r: r["tokens_per_s"])


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


def run_sync(
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    work: Work,
    **engine_kw: Any,
) -> dict[str, Any]:
    """`work` through the scheduler loop on the calling thread (see the module docstring)."""
    engine_kw.setdefault("max_seq_len", max_len(work))
    with engine(model, tokenizer, start=False, **engine_kw) as eng:
        eng.run_batch([[1, 2, 3]], max_tokens=2, temperature=0.0)  # warm-up
        before = eng.get_stats()
        start = time.perf_counter()
        results = [eng.submit(p, max_tokens=n, temperature=0.0, ignore_eos=True) for p, n in work]
        waiting = [r.task for r in results]  # no first token yet
        prefill_s = decode_s = 0.0
        decode_tokens = sampled = 0
        while eng.scheduler.has_work():
            t0 = time.perf_counter()
            eng.step()
            seconds = time.perf_counter() - t0
            now = sum(len(r.task.output_ids) for r in results)
            if any(t.first_token_at is not None for t in waiting):
                prefill_s += seconds
                waiting = [t for t in waiting if t.first_token_at is None]
            else:
                decode_s += seconds
                decode_tokens += now - sampled
            sampled = now
        wall = time.perf_counter() - start
        after = eng.get_stats()
    for r in results:
        r.raise_if_failed()
    tokens = sum(len(r.token_ids) for r in results)
    prompt_tokens = _delta(before, after, "total_prompt_tokens")
    cached = _delta(before, after, "cached_prompt_tokens")
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        # tokens the radix tree indexed by the end (None: the no-op prefix cache)
        "prefix_indexed_tokens": after.get("prefix_cached_tokens"),
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "decode_tokens": decode_tokens,
    }


async def _consume(eng: InferenceEngine, work: Work, start: float) -> list[float | None]:
    async def one(prompt: list[int], n: int) -> float | None:
        first = None
        async for _ in eng.generate_async(prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
            if first is None:
                first = time.perf_counter() - start
        return first

    return await asyncio.gather(*(one(p, n) for p, n in work))


def run_async(
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    work: Work,
    **engine_kw: Any,
) -> dict[str, Any]:
    """`work` through `generate_async`, every stream opened at once from one asyncio loop.
    Tokens are the scheduler's count of sampled tokens (a stream yields text, not ids); the
    first-delta time is a TTFT that misses tokens whose text is still incomplete."""
    engine_kw.setdefault("max_seq_len", max_len(work))
    with engine(model, tokenizer, **engine_kw) as eng:
        eng.generate([[1, 2, 3]], max_tokens=2, temperature=0.0)  # warm-up
        before = eng.get_stats()
        start = time.perf_counter()
        firsts = asyncio.run(_consume(eng, work, start))
        wall = time.perf_counter() - start
        after = eng.get_stats()
    tokens = _delta(before, after, "total_tokens")
    ttft = [f for f in firsts if f is not None] or [wall]
    return throughput(tokens, wall, ttft)


def phases(sync: dict[str, Any]) -> dict[str, Any]:
    """Prefill and decode tokens/s of a `run_sync` report (None: no step of that kind)."""
    prefill_s, decode_s = sync["prefill_seconds"], sync["decode_seconds"]
    return {
        "prefill_tokens": sync["prompt_tokens"],
        "prefill_seconds": prefill_s,
        "prefill_tokens_per_s": sync["prompt_tokens"] / prefill_s if prefill_s > 0 else None,
        "decode_tokens": sync["decode_tokens"],
        "decode_seconds": decode_s,
        "decode_tokens_per_s": sync["decode_tokens"] / decode_s if decode_s > 0 else None,
        "decode_steps_share": decode_s / sync["seconds"],
    }


def prefix_overhead(
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    work: Work,
    repeats: int,
    **engine_kw: Any,
) -> dict[str, Any]:
    """The radix prefix cache's cost on `work` (distinct prompts: 0% hits) against the no-op
    prefix cache, both paged, alternated `repeats` times; see the module docstring."""
    engine_kw["cache_mode"] = "paged"
    runs: dict[str, list[dict[str, Any]]] = {"radix": [], "no_cache": []}
    for _ in range(repeats):
        for name, radix in (("radix", True), ("no_cache", False)):
            runs[name].append(
                run_sync(engine, model, tokenizer, work, prefix_cache=radix, **engine_kw)
            )
    radix, none = best(runs["radix"]), best(runs["no_cache"])
    return {
        "radix": radix,
        "no_cache": none,
        "radix_hit_rate": radix["prefix_hit_rate"],
        "overhead": none["tokens_per_s"] / radix["tokens_per_s"] - 1.0,
    }
