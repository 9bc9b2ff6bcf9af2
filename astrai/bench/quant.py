"""Quantization benchmark: decode speed and accuracy of `engine.quantization` and
`engine.kv_cache_dtype` against fp32.

    python -m astrai.bench quant [model=...] [batches=[1,2,4,16]] [out=report.json]
    python -m astrai.bench quant 'variants=[{},{kv_cache_dtype:int8}]' engine.max_prefill_tokens=32

Each of `variants` is a set of engine settings (the first, `{}` by default, the fp32
baseline). Decode: tokens/s of `engine_steps.measure_batch` (pure-decode steps of B running
requests, the loop thread off) for each variant at each of `batches`, `repeats` times
alternated between the values, the median kept. Accuracy, on the same weights: perplexity of
the first `ppl_docs` documents of the built-in stdlib corpus's val split (`builtin:stdlib/val`,
the eval perplexity suite's corpus), each its first `ppl_tokens` tokens scored by
`InferenceEngine.score`; and greedy agreement: `agree_prompts` prompts (the documents' first
`agree_prompt_tokens` tokens) each decoded `agree_tokens` tokens by both engines, the
fraction of positions holding the same token. Options: conf/bench/quant.yaml.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from typing import Any

from hydra.utils import instantiate

from astrai.bench.common import bench_model, report_header
from astrai.bench.engine_steps import measure_batch
from astrai.data.builtin import stdlib_corpus
from astrai.inference import InferenceEngine
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)


def _label(variant: dict[str, Any]) -> str:
    """`fp32` for the baseline, else the settings' values (`int8_weight_only`, `int8`)."""
    return "+".join(f"{k}={v}" for k, v in sorted(variant.items())) or "fp32"


def _documents(tokenizer: AutoTokenizer, count: int, length: int) -> list[list[int]]:
    docs = []
    for text in stdlib_corpus("val"):
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            docs.append(ids[:length])
        if len(docs) == count:
            break
    return docs


def _perplexity(engine: InferenceEngine, docs: list[list[int]]) -> float:
    results = engine.score([(d[:1], d[1:]) for d in docs])
    nll = -sum(r.logprob for r in results)
    return math.exp(nll / sum(len(d) - 1 for d in docs))


def accuracy(cfg: dict[str, Any], model: Transformer, tokenizer: AutoTokenizer) -> dict[str, Any]:
    """Perplexity per quantization value and greedy agreement of each with the first."""
    factory = instantiate(cfg["engine"])
    docs = _documents(tokenizer, max(cfg["ppl_docs"], cfg["agree_prompts"]), cfg["ppl_tokens"])
    prompts = [d[: cfg["agree_prompt_tokens"]] for d in docs[: cfg["agree_prompts"]]]
    out: dict[str, Any] = {"ppl_docs": len(docs[: cfg["ppl_docs"]]), "prompts": len(prompts)}
    greedy: dict[str, list[list[int]]] = {}
    for quant in cfg["variants"]:
        max_len = cfg["ppl_tokens"] + cfg["agree_tokens"] + 1
        with factory(model, tokenizer, start=False, max_seq_len=max_len, **quant) as engine:
            out[f"ppl_{_label(quant)}"] = _perplexity(engine, docs[: cfg["ppl_docs"]])
            results = engine.run_batch(
                prompts,
                max_tokens=cfg["agree_tokens"],
                temperature=0.0,
                ignore_eos=True,
                return_details=True,
            )
            greedy[_label(quant)] = [r.token_ids for r in results]
    base = _label(cfg["variants"][0])
    for quant in cfg["variants"][1:]:
        label = _label(quant)
        pairs = [(a, b) for x, y in zip(greedy[base], greedy[label]) for a, b in zip(x, y)]
        out[f"agreement_{label}"] = sum(a == b for a, b in pairs) / len(pairs)
        out[f"ppl_change_{label}"] = out[f"ppl_{label}"] / out[f"ppl_{base}"] - 1
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    if not cfg["variants"] or any(not isinstance(v, dict) for v in cfg["variants"]):
        raise SystemExit("variants: a list of engine settings, e.g. [{}, {kv_cache_dtype: int8}]")
    model, tokenizer, device = bench_model(cfg)
    report: dict[str, Any] = report_header(cfg, model, device)
    report["load"] = os.getloadavg()[0]
    factory = instantiate(cfg["engine"])
    runs: dict[str, dict[int, list[float]]] = {
        _label(q): {b: [] for b in cfg["batches"]} for q in cfg["variants"]
    }
    for _ in range(cfg["repeats"]):
        for batch in cfg["batches"]:
            for quant in cfg["variants"]:  # alternated: a shared machine's noise is shared
                got = measure_batch(
                    factory,
                    model,
                    tokenizer,
                    batch,
                    cfg["steps"],
                    prompt_len=cfg["prompt_len"],
                    **quant,
                )
                runs[_label(quant)][batch].append(got["tokens_per_s"])
                logger.info("%s batch %d: %.1f tokens/s", _label(quant), batch, got["tokens_per_s"])
    report["decode_tokens_per_s"] = {
        label: {b: statistics.median(v) for b, v in per.items()} for label, per in runs.items()
    }
    report["decode_runs"] = runs
    report["accuracy"] = accuracy(cfg, model, tokenizer)
    report["load_after"] = os.getloadavg()[0]
    return report


def format_report(report: dict[str, Any]) -> str:
    speeds = report["decode_tokens_per_s"]
    labels = list(speeds)
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M params), "
        f"{report['threads']} threads, load {report['load']:.2f} -> {report['load_after']:.2f}",
        "batch  " + "  ".join(f"{label:>18}" for label in labels) + "  speedup",
    ]
    for batch in speeds[labels[0]]:
        row = [speeds[label][batch] for label in labels]
        ratio = row[-1] / row[0]
        lines.append(f"{batch:>5}  " + "  ".join(f"{v:>18.1f}" for v in row) + f"  {ratio:.2f}x")
    acc = report["accuracy"]
    lines.append(", ".join(f"{k} {v:.4g}" for k, v in acc.items()))
    return "\n".join(lines)
