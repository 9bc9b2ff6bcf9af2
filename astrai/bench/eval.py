"""Evaluation benchmark: lm-eval log-likelihood throughput of `--model astrai` vs `--model hf`.

Workload: `questions` multiple-choice questions of `choices` answers each, every answer a
`loglikelihood` request `(context, answer)` as lm-eval's multiple-choice tasks issue them.
Contexts are `context_min..context_max`-token windows of Python stdlib source, answers
`choice_min..choice_max`-token windows (the true continuation and random others), so a
question's requests share their context, as in HellaSwag or ARC. Both models load the same
random-weight model from one HF-format directory and answer the same `Instance`s through
lm-eval's `loglikelihood` (tokenization included); each system's best run counts, and
every `repeats` run of astrai starts with an empty prefix cache. The report also gives the
largest log-likelihood difference between the two (a sanity check, not a test).
Options: ``conf/bench/eval.yaml``; the engine is the engine group's (``engine.*``).
"""

from __future__ import annotations

import logging
import random
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from astrai.bench.common import as_list, bench_model, report_header
from astrai.model import save_pretrained
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

# Keys of the engine group that are not InferenceEngine keywords AstraiLM takes.
_NOT_ENGINE_OPTIONS = ("_target_", "_partial_", "max_seq_len")


def _corpus_ids(tokenizer: AutoTokenizer, need: int) -> list[int]:
    """At least `need` token ids of stdlib source (files the bench tokenizer did not see)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(stdlib.glob("*.py"))[40:]:
        ids += tokenizer.encode(path.read_text(errors="ignore"))
        if len(ids) >= need:
            return ids
    raise RuntimeError(f"the stdlib holds fewer than {need} tokens of source")


def check_options(cfg: dict[str, Any]) -> None:
    """ValueError naming the first inconsistent workload option (before any model is built)."""
    for low, high in (("context_min", "context_max"), ("choice_min", "choice_max")):
        if not 1 <= cfg[low] <= cfg[high]:
            raise ValueError(f"{low}={cfg[low]}, {high}={cfg[high]}: need 1 <= {low} <= {high}")
    if cfg["questions"] < 1 or cfg["choices"] < 2:
        raise ValueError(f"questions={cfg['questions']}, choices={cfg['choices']}: need >= 1, >= 2")
    if cfg["context_max"] + cfg["choice_max"] + 1 > cfg["max_length"]:
        raise ValueError(
            f"max_length={cfg['max_length']} < context_max + choice_max + 1: requests would be "
            "truncated"
        )


def workload(cfg: dict[str, Any], tokenizer: AutoTokenizer) -> list[tuple[str, str]]:
    """`questions * choices` `(context, " " + answer)` text pairs (lm-eval's target
    delimiter; answers of only whitespace are drawn again), a question's answers adjacent."""
    check_options(cfg)
    rng = random.Random(cfg["seed"])
    window = cfg["context_max"] + cfg["choice_max"]
    corpus = _corpus_ids(tokenizer, 8 * window + 64 * cfg["choice_max"])

    def answer(at: int | None) -> str:
        while True:
            at = rng.randrange(len(corpus) - cfg["choice_max"]) if at is None else at
            n = rng.randint(cfg["choice_min"], cfg["choice_max"])
            text = tokenizer.decode(corpus[at : at + n]).strip()
            if text:
                return " " + text
            at = None

    pairs = []
    for _ in range(cfg["questions"]):
        start = rng.randrange(len(corpus) - window)
        n = rng.randint(cfg["context_min"], cfg["context_max"])
        context = tokenizer.decode(corpus[start : start + n])
        answers = [answer(start + n)] + [answer(None) for _ in range(cfg["choices"] - 1)]
        pairs += [(context, a) for a in answers]
    return pairs


def _token_lengths(tokenizer: AutoTokenizer, context: str, answer: str) -> tuple[int, int]:
    """Tokens of the context (bos included) and of the answer after it, as lm-eval splits."""
    n = len(tokenizer.encode(context, add_special_tokens=True))
    return n, len(tokenizer.encode(context + answer, add_special_tokens=True)) - n


def _timed(lm: Any, requests: list[Any]) -> tuple[dict[str, float], list[tuple[float, bool]]]:
    lm.loglikelihood(requests[:2], disable_tqdm=True)  # warm-up (other contexts than timed)
    start = time.perf_counter()
    results = lm.loglikelihood(requests[2:], disable_tqdm=True)
    wall = time.perf_counter() - start
    n = len(requests) - 2
    return {"requests": n, "seconds": wall, "requests_per_s": n / wall}, results


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Both lm-eval models on the workload of conf/bench/eval.yaml, in this process."""
    from lm_eval.api.instance import Instance

    from astrai.eval.harness import AstraiLM

    check_options(cfg)
    model, tokenizer, device = bench_model(cfg)
    pairs = workload(cfg, tokenizer)
    # Two warm-up questions first: their contexts differ from every timed one.
    warm = [(f"warm-up {i}: def f(x): return x", " + 1") for i in range(2)]
    requests = [
        Instance("loglikelihood", {}, pair, i, ("bench_eval", i, 1))
        for i, pair in enumerate(warm + pairs)
    ]
    report: dict[str, Any] = report_header(cfg, model, device)
    engine_options = {k: v for k, v in cfg["engine"].items() if k not in _NOT_ENGINE_OPTIONS}
    common = dict(dtype=cfg["dtype"], device=str(device), max_length=cfg["max_length"])
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, tokenizer=tokenizer, hf_format=True)
        del model
        runs, astrai_results = [], None
        for _ in range(cfg["repeats"]):  # a fresh engine each time: an empty prefix cache
            lm = AstraiLM(pretrained=tmp, batch_size=cfg["batch_size"], **common, **engine_options)
            figures, astrai_results = _timed(lm, requests)
            figures["cached_prompt_tokens"] = lm.engine.get_stats()["cached_prompt_tokens"]
            runs.append(figures)
            del lm
        report["astrai"] = max(runs, key=lambda r: r["requests_per_s"])
        logger.info("astrai: %s", report["astrai"])
        lengths = [_token_lengths(tokenizer, c, a) for c, a in pairs]
        report["workload"] = {
            "questions": cfg["questions"],
            "requests": len(pairs),
            "context_tokens_mean": sum(c for c, _ in lengths) / len(lengths),
            "answer_tokens_mean": sum(a for _, a in lengths) / len(lengths),
        }
        if not cfg["skip_hf"]:
            from lm_eval.models.huggingface import HFLM

            report["hf"] = {}
            diffs: dict[str, float] = {}
            flips: dict[str, int] = {}
            for bs in [int(s) for s in as_list(cfg["hf_batch_sizes"])]:
                hf = HFLM(pretrained=tmp, batch_size=bs, **common)
                runs = []
                for _ in range(cfg["repeats"]):
                    figures, hf_results = _timed(hf, requests)
                    runs.append(figures)
                report["hf"][f"bs={bs}"] = max(runs, key=lambda r: r["requests_per_s"])
                logger.info("hf bs=%d: %s", bs, report["hf"][f"bs={bs}"])
                diffs[f"bs={bs}"] = max(
                    abs(a[0] - b[0]) for a, b in zip(astrai_results, hf_results)
                )
                flips[f"bs={bs}"] = sum(a[1] != b[1] for a, b in zip(astrai_results, hf_results))
                del hf
            report["max_abs_logprob_diff"] = max(diffs.values())
            report["greedy_disagreements"] = max(flips.values())
            best = max(report["hf"].values(), key=lambda r: r["requests_per_s"])
            report["speedup_vs_hf"] = report["astrai"]["requests_per_s"] / best["requests_per_s"]
    return report


def format_report(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M params) on "
        f"{report['device']}, {report['threads']} threads",
        f"workload: {w['questions']} questions, {w['requests']} loglikelihood requests, "
        f"context {w['context_tokens_mean']:.0f} + answer {w['answer_tokens_mean']:.1f} tokens "
        "on average",
    ]
    a = report["astrai"]
    lines.append(
        f"astrai        {a['requests_per_s']:8.1f} req/s  ({a['requests']} in {a['seconds']:.1f}s, "
        f"{a['cached_prompt_tokens']} prompt tokens from the prefix cache)"
    )
    for name, r in report.get("hf", {}).items():
        lines.append(
            f"hf {name:>10} {r['requests_per_s']:8.1f} req/s  ({r['requests']} in {r['seconds']:.1f}s)"
        )
    if "speedup_vs_hf" in report:
        lines.append(
            f"max |astrai - hf| log-likelihood {report['max_abs_logprob_diff']:.2e}, "
            f"greedy flags differing: {report['greedy_disagreements']}"
        )
        lines.append(f"ratio astrai / best hf: {report['speedup_vs_hf']:.2f}x (target >= 2.0x)")
    return "\n".join(lines)
