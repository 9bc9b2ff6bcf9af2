"""What both sides of ``bench train_trl`` train on: one random-weight Qwen3-style Hugging Face
checkpoint with a word-level tokenizer (built here, nothing downloaded), and each workload's
token ids, so astrai and TRL see the same weights and the same tokens.

The tokenizer maps the word ``t<i>`` to id ``i`` (``<pad>`` 0, ``<eos>`` 1), so any id list
renders as text that TRL re-tokenises to exactly those ids (TRL's DPO and GRPO trainers take
text; SFT takes the ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PAD_ID, EOS_ID = 0, 1
PAD, EOS = "<pad>", "<eos>"


def build_checkpoint(root: Path, model: Mapping[str, Any], seed: int) -> Path:
    """A random Qwen3 checkpoint (fp32 safetensors + config) and its tokenizer in ``root``:
    the one directory astrai imports (``pretrained_model``) and TRL loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = int(model["vocab_size"])
    torch.manual_seed(seed)
    config = Qwen3Config(**dict(model), bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(root)
    words = {PAD: PAD_ID, EOS: EOS_ID, **{f"t{i}": i for i in range(2, vocab)}}
    word = Tokenizer(models.WordLevel(words, unk_token=PAD))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token=PAD, eos_token=EOS)
    tok.save_pretrained(root)
    return root


def text_of(ids: list[int]) -> str:
    """The text the word-level tokenizer encodes to ``ids`` (a leading space: it can follow
    another such text, as TRL concatenates prompt and completion)."""
    return "".join(f" {EOS}" if i == EOS_ID else f" t{i}" for i in ids)


def even_token_reward(record: Mapping[str, Any], completion: str) -> float:
    """The GRPO workload's reward (astrai's signature): the fraction of the completion's
    words that are even token ids; cheap, deterministic and varied within a group."""
    words = completion.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))


def trl_even_token_reward(completions: list[str], **_: Any) -> list[float]:
    """:func:`even_token_reward` with TRL's reward signature."""
    return [even_token_reward({}, c) for c in completions]


@dataclass(frozen=True)
class SFTData:
    """``batch_size`` sequences of ``seq_len`` ids; the loss is on the tokens after the
    first ``prompt_len`` (the assistant's)."""

    input_ids: list[list[int]]
    prompt_len: int


@dataclass(frozen=True)
class DPOData:
    """``batch_size`` (prompt, chosen, rejected) triples; each response ends with EOS."""

    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]


@dataclass(frozen=True)
class GRPOData:
    """``prompts`` of ``prompt_len`` ids, each sampled ``num_generations`` times."""

    prompts: list[list[int]]


def _ids(gen: torch.Generator, vocab: int, rows: int, length: int) -> list[list[int]]:
    return torch.randint(2, vocab, (rows, length), generator=gen).tolist()


def workload_data(cfg: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """Each workload's one batch (every step trains on it: both sides see the same tokens
    at every step, whatever order their loaders would draw rows in)."""
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    sft, dpo, grpo = cfg["sft"], cfg["dpo"], cfg["grpo"]
    response = int(dpo["response_len"]) - 1  # + EOS
    return {
        "sft": SFTData(
            _ids(gen, vocab, int(sft["batch_size"]), int(sft["seq_len"])), int(sft["prompt_len"])
        ),
        "dpo": DPOData(
            _ids(gen, vocab, int(dpo["batch_size"]), int(dpo["prompt_len"])),
            [[*r, EOS_ID] for r in _ids(gen, vocab, int(dpo["batch_size"]), response)],
            [[*r, EOS_ID] for r in _ids(gen, vocab, int(dpo["batch_size"]), response)],
        ),
        "grpo": GRPOData(_ids(gen, vocab, int(grpo["prompts"]), int(grpo["prompt_len"]))),
    }
