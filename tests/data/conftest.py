"""Shared fixtures: small real tokenizers, trained once per session on local text."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.data.builtin import arithmetic_problems, sft_records, stdlib_corpus
from astrai.tokenizer import AutoTokenizer

VOCAB_SIZE = 512


def _training_texts() -> list[str]:
    texts = list(stdlib_corpus("train", max_files=12))
    for record in sft_records(arithmetic_problems(200, seed=1)):
        texts += [m["content"] for m in record["messages"]]
    return texts


@pytest.fixture(scope="session")
def tok() -> AutoTokenizer:
    return AutoTokenizer.train(_training_texts(), VOCAB_SIZE)


@pytest.fixture(scope="session")
def tok_dir(tok: AutoTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def other_tok() -> AutoTokenizer:
    """A different vocabulary, hence a different fingerprint."""
    return AutoTokenizer.train(_training_texts(), VOCAB_SIZE - 64)
