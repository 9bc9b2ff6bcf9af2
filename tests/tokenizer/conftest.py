"""Shared fixtures: one small byte-level BPE trained once per session on local text."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest
from tokenizer_cases import VOCAB_SIZE, corpus_texts

from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="session")
def tok() -> AutoTokenizer:
    return AutoTokenizer.train(corpus_texts(), VOCAB_SIZE)


@pytest.fixture(scope="session")
def saved_dir(tok: AutoTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("astrai_tok")
    tok.save_pretrained(path)
    return path
