"""Fixtures of the suite tests: one tiny tokenizer and model per session."""

from __future__ import annotations

import pytest
from suite_helpers import tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model(tok):
    return tiny_model(tok)
