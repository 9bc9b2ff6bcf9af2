"""Helpers shared by the data tests (not collected: no test_ prefix)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_lines(path: Path, lines: list[Any]) -> Path:
    """JSONL with one entry per item; strings are written verbatim (to plant bad lines)."""
    with open(path, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path
