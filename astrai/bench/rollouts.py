"""GRPO rollout benchmark: completions per second of one prompt's ``G`` samples prefilled once
(group prefill, ``SamplingParams.n``) against ``G`` separate requests.

Workload: ``batches`` rollout batches of ``prompts`` built-in arithmetic prompts (the chat
template's rendering, as ``tiny_grpo`` trains on) x ``num_generations`` completions, sampled
at ``temperature`` for up to ``max_new_tokens`` tokens, as ``GRPOModule.rollout`` asks for
them (``few_shot`` worked problems before each prompt make the shared prompt longer, as a
few-shot or system prompt does). Every mode draws with the same seeds (completion ``j`` of prompt ``i``: ``seed + i * G
+ j``), so all generate the same completions and the comparison is of the engine alone:

- ``group``: ``run_batch(prompts, n=G)`` on the engine group's engine (GRPO's rollouts);
- ``separate``: ``run_batch`` of the ``G``-times-expanded prompt list, one request per
  completion, on the same engine;
- ``contiguous``: ``separate`` on the contiguous KV cache (GRPO's rollouts before group
  prefill).

The model is the ``model`` group's: an export (``model_path=<dir>``, e.g.
``outputs/tiny_sft_start/latest/export``, the start of tiny_grpo, whose completions have
realistic lengths; its own tokenizer renders the prompts) or a preset with random weights. Options: ``conf/bench/rollouts.yaml``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from astrai.bench.common import as_list, report_header

logger = logging.getLogger(__name__)

MODES = ("group", "separate", "contiguous")
ENGINE_KEYS = ("cache_mode", "page_size", "max_batch_size", "max_seq_len")


def _model(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """The model group's model, with its own tokenizer when it is an export (the prompts must
    read as it was trained on them)."""
    from astrai.bench.common import bench_model
    from astrai.tokenizer import AutoTokenizer

    model, tokenizer, _ = bench_model(cfg)
    path = cfg["model"].get("path")
    return model, AutoTokenizer.from_pretrained(path) if path else tokenizer


def prompts_of(
    tokenizer: Any, count: int, batches: int, seed: int, few_shot: int = 0
) -> list[list[list[int]]]:
    """`batches` lists of `count` arithmetic prompts, rendered as a user turn after
    `few_shot` worked problems (user and assistant turns, the same for every prompt)."""
    from astrai.data.builtin import arithmetic_problems, prompt_records, sft_records

    records = prompt_records(arithmetic_problems(count * batches, seed, split="train"))
    shots = [
        m
        for r in sft_records(arithmetic_problems(few_shot, seed + 1, split="val"))
        for m in r["messages"]
    ]
    ids = [
        tokenizer.apply_chat_template(
            [*shots, {"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
        )
        for r in records
    ]
    return [ids[b * count : (b + 1) * count] for b in range(batches)]


def _engine(cfg: dict[str, Any], model: Any, tokenizer: Any, mode: str) -> Any:
    from astrai.inference import InferenceEngine

    options = {k: v for k, v in cfg["engine"].items() if k not in ("_target_", "_partial_")}
    if mode == "contiguous":
        options["cache_mode"] = "contiguous"
    return InferenceEngine(model, tokenizer, start=False, **options)


def run_mode(cfg: dict[str, Any], model: Any, tokenizer: Any, mode: str, batches) -> dict:
    """One mode's best (of `repeats`) pass over every batch: completions/s and token counts."""
    import torch

    from astrai.inference import SamplingParams

    g = cfg["num_generations"]
    params = SamplingParams(
        max_tokens=cfg["max_new_tokens"],
        temperature=cfg["temperature"],
        logprobs_mode="scaled",
        n=g if mode == "group" else 1,
    )
    best: dict[str, Any] | None = None
    for _ in range(max(1, cfg["repeats"])):
        engine = _engine(cfg, model, tokenizer, mode)
        completions = tokens = 0
        started = time.perf_counter()
        with torch.inference_mode():
            for b, prompts in enumerate(batches):
                if mode != "group":
                    prompts = [p for p in prompts for _ in range(g)]
                seed = cfg["seed"] + b * len(batches[0]) * g
                results = engine.run_batch(prompts, params, seed=seed, return_details=True)
                completions += len(results)
                tokens += sum(len(r.token_ids) for r in results)
                engine.update_weights(version=b + 1)  # as GRPO's step: the cache is dropped
        seconds = time.perf_counter() - started
        stats = engine.get_stats()
        engine.shutdown()
        row = {
            "mode": mode,
            "completions": completions,
            "tokens": tokens,
            "seconds": seconds,
            "completions_per_s": completions / seconds,
            "tokens_per_s": tokens / seconds,
            "prompt_tokens": stats["total_prompt_tokens"],
            "cached_prompt_tokens": stats["cached_prompt_tokens"],
        }
        if best is None or row["seconds"] < best["seconds"]:
            best = row
    assert best is not None
    return best


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    modes = [str(m) for m in as_list(cfg["modes"])]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; choose from {MODES}")
    model, tokenizer = _model(cfg)
    batches = prompts_of(tokenizer, cfg["prompts"], cfg["batches"], cfg["seed"], cfg["few_shot"])
    rows = {m: run_mode(cfg, model, tokenizer, m, batches) for m in modes}
    report: dict[str, Any] = {
        **report_header(cfg, model, next(model.parameters()).device),
        "engine": {k: cfg["engine"].get(k) for k in ENGINE_KEYS},
        "load": os.getloadavg(),
        "prompt_len": sum(len(p) for b in batches for p in b) / sum(len(b) for b in batches),
        "rows": rows,
    }
    if "group" in rows:
        for other in ("separate", "contiguous"):
            if other in rows:
                speedup = rows["group"]["completions_per_s"] / rows[other]["completions_per_s"]
                report[f"group_vs_{other}"] = speedup
    return report


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"GRPO rollouts: {c['batches']} batches x {c['prompts']} prompts x "
        f"{c['num_generations']} completions, up to {c['max_new_tokens']} tokens at "
        f"T={c['temperature']}, {c['few_shot']} shots, prompts of {report['prompt_len']:.0f} "
        f"tokens on average ({report['model']}); engine {report['engine']}; load "
        f"{report['load'][0]:.2f}",
        f"{'mode':<11} {'compl/s':>8} {'tok/s':>8} {'seconds':>8} {'prompt':>7} {'cached':>7}",
    ]
    for row in report["rows"].values():
        lines.append(
            f"{row['mode']:<11} {row['completions_per_s']:>8.1f} {row['tokens_per_s']:>8.1f} "
            f"{row['seconds']:>8.2f} {row['prompt_tokens']:>7} {row['cached_prompt_tokens']:>7}"
        )
    for key in ("group_vs_separate", "group_vs_contiguous"):
        if key in report:
            lines.append(f"{key}: {report[key]:.2f}x")
    return "\n".join(lines)
