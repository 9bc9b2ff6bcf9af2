"""Fixtures for the training tests.

Tokenizers and prepared data are cached for the whole session in one data dir (their cache
key includes the settings), so each is built once; every run writes under its own tmp_path.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("astrai-data")
