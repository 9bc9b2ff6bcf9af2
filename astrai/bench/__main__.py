"""``python -m astrai.bench <name> [key=value ...] [out=report.json]``: run one benchmark.

Hydra composes ``conf/bench.yaml`` with ``bench=<name>`` (the benchmark's options and
defaults, ``conf/bench/<name>.yaml``) and the ``key=value`` overrides in Hydra's syntax
(``n=5``, ``skip_hf=true``, ``hf_batch_sizes=[1,all]``, ``model=qwen3-0.6b``,
``engine=paged``; ``model_path=<dir>`` is short for ``model=pretrained model.path=<dir>``,
as in training). ``out=<path>`` also writes the report as JSON; ``log_level=debug`` shows
third-party warnings too.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from astrai.bench import BENCHMARKS
from astrai.cli_keys import command_line
from astrai.runtime import setup_logging

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
USAGE = "usage: python -m astrai.bench <name> [key=value ...] [out=report.json]"


def typed_like(defaults: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with each scalar option converted to its default's type (`tokenizer=123` is the
    string "123", `ratio=1` the float 1.0); a value that does not convert, or an option the
    defaults lack (`+key=value`), is an error."""
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        raise SystemExit(f"unknown option {unknown[0]!r}; options: {', '.join(sorted(defaults))}")
    out = dict(cfg)
    for key, default in defaults.items():
        value = cfg[key]
        if default is None or value is None or isinstance(default, (list, dict)):
            continue
        if isinstance(default, str) and not isinstance(value, str):
            out[key] = str(value)
        elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            out[key] = float(value)
        elif type(value) is not type(default):
            raise SystemExit(f"option {key}={value!r}: expected {type(default).__name__}")
    return out


def bench_config(name: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """The options of benchmark `name` with `overrides`, resolved; an unknown benchmark, an
    unknown option or a badly typed value is a `SystemExit` naming it."""
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    choice = f"bench={name}"
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            defaults = OmegaConf.to_container(compose("bench", [choice]), resolve=True)
            cfg = OmegaConf.to_container(
                compose("bench", [choice, *(overrides or [])]), resolve=True
            )
    except (HydraException, OmegaConfBaseException) as err:
        raise SystemExit(f"{name}: {err}\n{USAGE}") from None
    assert isinstance(defaults, dict) and isinstance(cfg, dict)
    return typed_like(defaults, cfg)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark that `argv` (default: the command line) names; returns its report."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\nbenchmarks: {', '.join(sorted(BENCHMARKS))}")
        raise SystemExit(0 if argv else 2)
    name, overrides = argv[0], command_line("bench", argv[1:])
    cfg = bench_config(name, overrides)
    out_path = cfg.pop("out")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    module = importlib.import_module(BENCHMARKS[name])
    # after the import: a benchmark that imports Lightning gets its lines once too
    setup_logging(cfg.pop("log_level"))  # threads: each benchmark's own `threads` option
    report = module.run(cfg)
    print(module.format_report(report))
    if out_path is not None:
        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
