"""LoRA throughput: ``python -m astrai.bench serve lora=[1,4,16]`` (``lora=16``, ``lora=true``).

What serving many adapters over one base costs. One workload, run on the engine offline (no
HTTP, whose client and event loop would only add noise to a ratio of engine speeds):
`requests` prompts of `lora_prompt_len` random tokens, each generating `lora_output_len`
tokens, greedy, EOS ignored, all queued at t=0 and run as one batch (the engine's
`max_batch_size` is raised to `requests` if lower) by `engine.step()` on the calling thread.
The same workload runs

- ``base``: every request on the base model, the engine built without LoRA;
- ``base_lora_engine``: every request on the base model, the engine built with LoRA (the
  cost of enabling it when no request uses an adapter);
- ``adapters_<k>`` for each k of `lora`: request i uses adapter i mod k, k random adapters
  of rank `lora_rank` over `lora_targets` (B random and non-zero), the engine's `max_loras`
  = k so the whole batch fits in its slots.

Each case reports tokens/s (best of `repeats`, the cases alternated within a round) and its
ratio to ``base``; ``changed_vs_base`` is the share of requests whose greedy output differs
from the base's (the adapters are applied, not skipped). Target: ``adapters_4`` >= 0.8x.
"""

from __future__ import annotations

import copy
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from astrai.bench.common import as_list, bench_model, report_header

logger = logging.getLogger(__name__)

DEFAULT_COUNTS = [1, 4, 16]
TARGET_ADAPTERS, TARGET_RATIO = 4, 0.8


def adapter_counts(value: Any) -> list[int]:
    """The adapter counts of the `lora` option: ``true`` is [1, 4, 16]; an int, a list or a
    comma string of positive ints otherwise."""
    if value is True:
        return list(DEFAULT_COUNTS)
    try:
        counts = [int(v) for v in as_list(value)]
    except (TypeError, ValueError):
        counts = []
    if not counts or any(c < 1 for c in counts) or isinstance(value, bool):
        raise ValueError(f"lora={value!r}: expected true, a positive int or a list of them")
    return sorted(set(counts))


def make_adapters(
    model: Any, count: int, *, rank: int, targets: list[str], root: Path, seed: int
) -> list[Path]:
    """`count` random rank-`rank` adapters over `targets` of `model` (a copy is wrapped;
    `model` is untouched), saved in PEFT layout under `root`."""
    import torch

    from astrai.model import LoRAConfig, inject_lora, save_lora
    from astrai.model.lora import LoRALinear

    wrapped = inject_lora(
        copy.deepcopy(model), LoRAConfig(r=rank, lora_alpha=2.0 * rank, target_modules=targets)
    )
    layers = [m for m in wrapped.modules() if isinstance(m, LoRALinear)]
    paths = []
    with torch.no_grad():
        for i in range(count):
            gen = torch.Generator().manual_seed(seed + i)
            for layer in layers:  # A as kaiming-uniform-like, B non-zero (not a no-op)
                a, b = layer.lora_A.weight, layer.lora_B.weight
                a.copy_((torch.rand(a.shape, generator=gen) * 2 - 1) / a.shape[1] ** 0.5)
                b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
            paths.append(save_lora(wrapped, root / f"adapter-{i}"))
    return paths


def run_case(
    factory: Any,
    model: Any,
    tokenizer: Any,
    work: list[list[int]],
    output_len: int,
    adapters: list[Path] | None,
    lora: dict[str, int] | None,
) -> dict[str, Any]:
    """`work` on an engine from `factory` (with `lora` settings, or none), request i on
    adapter i mod len(adapters) (None: the base); after a warm-up, timed to the last token."""
    max_len = max(map(len, work)) + output_len + 1
    with factory(model, tokenizer, start=False, max_seq_len=max_len, lora=lora) as eng:
        names = []
        for i, path in enumerate(adapters or []):
            names.append(f"a{i}")
            eng.load_adapter(names[-1], path)
        # warm-up: a short request per adapter (each moves into its slot), or one on the base
        for name in names or [None]:
            eng.submit(work[0][:8], max_tokens=2, temperature=0.0, adapter=name)
        while eng.scheduler.has_work():
            eng.step()
        start = time.perf_counter()
        results = [
            eng.submit(
                prompt,
                max_tokens=output_len,
                temperature=0.0,
                ignore_eos=True,
                adapter=names[i % len(names)] if names else None,
            )
            for i, prompt in enumerate(work)
        ]
        steps = 0
        while eng.scheduler.has_work():
            eng.step()
            steps += 1
        wall = time.perf_counter() - start
    for r in results:
        r.raise_if_failed()
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "steps": steps,
        "outputs": [list(r.token_ids) for r in results],
    }


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Base-only and multi-adapter throughput on one workload (see the module docstring)."""
    from hydra.utils import instantiate

    counts = adapter_counts(cfg["lora"])  # a bad value is refused before any work
    rank, targets = int(cfg["lora_rank"]), list(cfg["lora_targets"])
    if rank < 1 or not targets:
        raise ValueError(
            f"lora_rank must be >= 1 and lora_targets non-empty, got {rank}, {targets}"
        )
    model, tokenizer, device = bench_model(cfg)
    engine_cfg = dict(cfg["engine"])
    n = int(cfg["requests"])
    if int(engine_cfg.get("max_batch_size") or 0) < n:
        logger.info("engine.max_batch_size raised to %d: the workload is one batch", n)
        engine_cfg["max_batch_size"] = n
    engine_cfg.pop("lora", None)  # each case sets its own
    factory = instantiate(engine_cfg)
    rng = random.Random(cfg["seed"])
    vocab = model.config.vocab_size
    work = [[rng.randrange(16, vocab) for _ in range(cfg["lora_prompt_len"])] for _ in range(n)]
    output_len = int(cfg["lora_output_len"])
    report: dict[str, Any] = {
        **report_header(cfg, model, device),
        "workload": {
            "requests": n,
            "prompt_tokens": n * len(work[0]),
            "output_tokens": n * output_len,
            "rank": rank,
            "targets": targets,
        },
    }
    with tempfile.TemporaryDirectory(prefix="astrai-lora-bench-") as tmp:
        paths = make_adapters(
            model, max(counts), rank=rank, targets=targets, root=Path(tmp), seed=cfg["seed"]
        )
        cases: dict[str, tuple[list[Path] | None, dict[str, int] | None]] = {
            "base": (None, None),
            "base_lora_engine": (None, _lora(max(counts), rank)),
        }
        for k in counts:
            cases[f"adapters_{k}"] = (paths[:k], _lora(k, rank))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
        for round_ in range(int(cfg["repeats"])):
            for name, (adapters, lora) in cases.items():
                result = run_case(factory, model, tokenizer, work, output_len, adapters, lora)
                logger.info("round %d %s: %.1f tok/s", round_, name, result["tokens_per_s"])
                runs[name].append(result)
    base_outputs = runs["base"][0]["outputs"]
    rows = {}
    for name, results in runs.items():
        best = max(results, key=lambda r: r["tokens_per_s"])
        changed = sum(o != b for o, b in zip(best["outputs"], base_outputs)) / n
        rows[name] = {
            **{k: v for k, v in best.items() if k != "outputs"},
            "all_tokens_per_s": [r["tokens_per_s"] for r in results],
            "changed_vs_base": changed,
        }
    base = rows["base"]["tokens_per_s"]
    for row in rows.values():
        row["ratio_vs_base"] = row["tokens_per_s"] / base
    report["rows"] = rows
    target = rows.get(f"adapters_{TARGET_ADAPTERS}")
    report["target"] = {
        "adapters": TARGET_ADAPTERS,
        "min_ratio": TARGET_RATIO,
        "ratio": None if target is None else target["ratio_vs_base"],
        "met": None if target is None else target["ratio_vs_base"] >= TARGET_RATIO,
    }
    return report


def _lora(max_loras: int, rank: int) -> dict[str, int]:
    return {"max_loras": max_loras, "max_lora_rank": rank, "max_cpu_loras": max(max_loras, 8)}


def format_report(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M params) on "
        f"{report['device']}, {report['threads']} threads; {w['requests']} requests x "
        f"{w['prompt_tokens'] // w['requests']} prompt / {w['output_tokens'] // w['requests']} "
        f"output tokens, one batch; adapters of rank {w['rank']} on {','.join(w['targets'])}"
    ]
    for name, r in report["rows"].items():
        lines.append(
            f"{name:18} {r['tokens_per_s']:8.1f} tok/s  {r['ratio_vs_base']:.3f}x base  "
            f"({r['tokens']} tokens in {r['seconds']:.1f}s, {r['steps']} steps; outputs "
            f"changed vs base: {r['changed_vs_base']:.0%})"
        )
    t = report["target"]
    if t["ratio"] is not None:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(
            f"{t['adapters']} adapters / base: {t['ratio']:.3f}x (target >= {t['min_ratio']}x: "
            f"{verdict})"
        )
    return "\n".join(lines)
