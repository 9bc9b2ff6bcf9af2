"""Suite results as a readable table and as a JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from astrai.eval.suite import SuiteResult

__all__ = ["format_table", "results_dict", "write_json", "write_results"]


def _value(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_table(results: Sequence[SuiteResult]) -> str:
    """One line per (suite, metric, value), then each suite's wall-clock seconds."""
    rows = [("suite", "metric", "value")]
    for result in results:
        rows += [(result.name, k, _value(v)) for k, v in result.metrics.items()]
        rows.append((result.name, "seconds", f"{result.seconds:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_dict(
    results: Sequence[SuiteResult], *, samples: bool = True, meta: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{**meta, "suites": {name: {metrics, seconds[, samples]}}}``."""
    return {
        **dict(meta or {}),
        "suites": {r.name: r.to_dict(samples=samples) for r in results},
    }


def write_results(
    path: str | os.PathLike,
    results: Sequence[SuiteResult],
    *,
    samples: bool = True,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write :func:`results_dict` as JSON atomically (:func:`write_json`)."""
    return write_json(path, results_dict(results, samples=samples, meta=meta))


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """`data` as JSON, atomically (a temporary file, then a rename): an interrupted write
    leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
