"""Shared pieces of the suite tests: a tiny model, its dense-forward reference, a scripted
engine for tests that need known completions, and a JSONL writer."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from tiny_parts import STDLIB_VOCAB, stdlib_texts, tiny_transformer

from astrai.inference import BatchResult, InferenceEngine, SamplingParams
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer


def tiny_tokenizer() -> AutoTokenizer:
    texts = [*stdlib_texts(), *["Question: What is 2 + 3?\nAnswer: 5\n"] * 5]
    return AutoTokenizer.train(texts, vocab_size=STDLIB_VOCAB)


def tiny_model(tokenizer: AutoTokenizer, max_positions: int = 512) -> Transformer:
    return tiny_transformer(len(tokenizer), max_positions)


def engine_for(model: Transformer, tokenizer: AutoTokenizer, **kwargs: Any) -> InferenceEngine:
    """A synchronous engine (no loop thread); paged with small pages by default, so scoring
    choices of one question goes through the prefix cache."""
    options = dict(start=False, max_batch_size=8, max_seq_len=256, cache_mode="paged", page_size=4)
    return InferenceEngine(model, tokenizer, **{**options, **kwargs})


@torch.no_grad()
def dense_logprobs(model: Transformer, ids: Sequence[int]) -> torch.Tensor:
    """`log p(ids[t] | ids[:t])` for t >= 1 from one plain dense forward (float64 out)."""
    logits = model(torch.tensor([list(ids)]))[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    """Rows as JSONL; a str row is written as is (for malformed lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class ScriptedEngine:
    """Stands in for an engine in tests that need known completions: `run_batch` answers
    each prompt with `reply(prompt_text, seed)` and records the calls."""

    def __init__(self, tokenizer: AutoTokenizer, reply: Callable[[str, int], str]) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.calls: list[dict[str, Any]] = []
        self.max_seq_len = 4096

    def run_batch(
        self,
        prompt_ids_list: Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        seed: int = 0,
        **options: Any,
    ) -> list[BatchResult]:
        """`InferenceEngine.run_batch`'s signature; `calls` records each call's settings."""
        settings = {f.name: getattr(params, f.name) for f in fields(params or SamplingParams())}
        self.calls.append({"n": len(prompt_ids_list), "seed": seed, **settings, **options})
        out = []
        for i, ids in enumerate(prompt_ids_list):
            text = self.reply(self.tokenizer.decode(ids), seed + i)
            out.append(BatchResult(self.tokenizer.encode(text), None, "stop"))
        return out
