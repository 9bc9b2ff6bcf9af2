"""``python -m astrai.bench <name> [key=value ...] [out=report.json]``: run one benchmark.

Values are parsed as YAML scalars (``n=5``, ``skip_hf=true``, ``ratio=0.5``) and checked
against the benchmark's ``DEFAULTS``; ``out=<path>`` also writes the report as JSON.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from astrai.bench import BENCHMARKS

USAGE = "usage: python -m astrai.bench <name> [key=value ...] [out=report.json]"


def parse_overrides(args: list[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """``key=value`` strings to a dict, typed like the defaults; unknown keys are an error."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {arg!r}\n{USAGE}")
        if key not in defaults:
            raise SystemExit(f"unknown option {key!r}; options: {', '.join(sorted(defaults))}")
        value = yaml.safe_load(raw) if raw else ""
        default = defaults[key]
        if isinstance(default, str) and not isinstance(value, str):
            value = raw  # e.g. "1,8,all" or "123" for a string option
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif default is not None and not isinstance(value, type(default)):
            raise SystemExit(f"option {key}={raw!r}: expected {type(default).__name__}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\nbenchmarks: {', '.join(sorted(BENCHMARKS))}")
        raise SystemExit(0 if argv else 2)
    name, args = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    out_path = None
    rest = []
    for arg in args:
        if arg.startswith("out="):
            out_path = Path(arg[len("out=") :])
        else:
            rest.append(arg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    module = importlib.import_module(BENCHMARKS[name])
    overrides = parse_overrides(rest, getattr(module, "DEFAULTS", {}))
    report = module.main(overrides)
    formatter = getattr(module, "format_report", None)
    print(formatter(report) if formatter else json.dumps(report, indent=2))
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
