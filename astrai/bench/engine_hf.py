"""`transformers.generate` on our HF export, the reference of `bench engine`: left padding,
greedy, every request's asked-for length forced, batches of a configurable size; useful
tokens are the ones each request asked for (rows that keep generating for the longest
request of their batch do not count)."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from astrai.bench.common import as_list, percentile
from astrai.bench.engine_phases import Work, best
from astrai.model import Transformer, save_pretrained

logger = logging.getLogger(__name__)


def run_hf(hf_model: Any, work: Work, batch_size: int, pad_id: int) -> dict[str, float]:
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        def __init__(self) -> None:
            self.first: float | None = None

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    start = time.perf_counter()
    ttft, useful = [], 0
    for i in tqdm(
        range(0, len(work), batch_size), desc=f"transformers bs={batch_size}", leave=False
    ):
        chunk = work[i : i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        ids, mask = ids.to(hf_model.device), mask.to(hf_model.device)
        marker = FirstToken()
        new = max(n for _, n in chunk)
        with torch.no_grad():
            out = hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=LogitsProcessorList([marker]),
            )
        assert out.shape[1] == width + new
        ttft += [marker.first - start] * len(chunk)
        useful += sum(n for _, n in chunk)
    wall = time.perf_counter() - start
    return {
        "tokens": useful,
        "seconds": wall,
        "tokens_per_s": useful / wall,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
    }


def run_hf_sizes(
    cfg: dict[str, Any], model: Transformer, work: Work, device: torch.device
) -> dict[str, dict[str, float]]:
    """`transformers` on our HF export of `model` at every `cfg["hf_batch_sizes"]` (best of
    `cfg["repeats"]` runs each, and of every run of a size listed twice), keyed `bs=N`."""
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp, hf_format=True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=getattr(torch, cfg["dtype"])
        )
        hf = hf.to(device).eval()
    sizes = [len(work) if s == "all" else int(s) for s in as_list(cfg["hf_batch_sizes"])]
    out = best_per_size(sizes, lambda bs: run_hf(hf, work, bs, pad_id=0), cfg["repeats"])
    for name, result in out.items():
        logger.info("transformers %s: %s", name, result)
    return out


def best_per_size(
    sizes: list[int], run_one: Callable[[int], dict[str, float]], repeats: int
) -> dict[str, dict[str, float]]:
    """The best of `repeats` runs at each batch size, keyed `bs=N`; a size listed twice (8
    and `all` with 8 requests) is one entry, the best of all its runs, never the later one."""
    runs: dict[int, list[dict[str, float]]] = {}
    for bs in sizes:
        runs.setdefault(bs, []).extend(run_one(bs) for _ in range(repeats))
    return {f"bs={bs}": best(r) for bs, r in runs.items()}
