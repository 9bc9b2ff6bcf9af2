"""``python -m astrai.eval compare A B [eval=[...]] [out=compare.json] [overrides]``.

Runs the same suites on two model directories, one model at a time (A is loaded,
evaluated and released before B is loaded), and reports per-metric paired statistics
(:mod:`astrai.eval.paired`) over the items both runs scored.

Common random numbers: every suite seeds its requests from its own ``seed`` and the item's
index alone (generation: prompt ``i`` draws with ``seed + i``; code: sample ``j`` of task
``i`` with ``seed + i * num_samples + j``; scoring suites draw nothing), never from the
model, the batch or the order the engine runs requests in. So request ``i`` of a suite
draws the same noise on A and on B, which couples the two runs item by item, and both
engines get the same context length (the longer of the two models' needs, capped by the
shorter context), so perplexity windows match too.

The configuration is ``conf/compare.yaml``: all of ``conf/eval.yaml`` (suites, engine,
device, dtype, ...) with the two models given as positional arguments instead of
``model_path``. Both directories are checked, and every suite's task file read, before any
model is loaded. ``adapter_a=DIR`` / ``adapter_b=DIR`` evaluate a LoRA adapter over that
side's model (``compare BASE BASE adapter_b=DIR``: what the adapter changes).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from astrai.eval.adapter import EvalAdapter, check_adapter
from astrai.eval.paired import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, compare_samples
from astrai.eval.report import write_json
from astrai.eval.suite import Suite, SuiteResult
from astrai.model.directory import model_dir_problem

__all__ = ["compare_results", "format_comparison", "main", "paired_metrics", "run"]

log = logging.getLogger("astrai.eval")

USAGE = (
    "usage: python -m astrai.eval compare A B [eval=[perplexity,...]] [out=compare.json] "
    "[suites.<name>.<option>=...] [engine=...] [adapter_a=DIR] [adapter_b=DIR] "
    "(A and B: model directories)"
)
#: per-sample fields that are no measurement of the model's quality: counts (`tokens`), and
#: per-document perplexity, whose mean is dominated by the worst documents (its log, `nll`,
#: is paired instead)
NOT_PAIRED = frozenset({"tokens", "ppl"})
#: a sample's identity (the file and line, or the task), checked to match between A and B
ID_FIELDS = ("where", "task_id")


def check_dirs(a: str | os.PathLike, b: str | os.PathLike) -> tuple[Path, Path]:
    """Both model directories, or a one-line SystemExit naming the one that is not one."""
    for label, path in (("A", a), ("B", b)):
        problem = model_dir_problem(path)
        if problem is not None:
            raise SystemExit(f"compare: model {label} {path}: {problem}")
    return Path(a).expanduser(), Path(b).expanduser()


def paired_metrics(a: SuiteResult, b: SuiteResult) -> dict[str, list[int]]:
    """For each of the suite's metrics that its samples carry as numbers, the indices of the
    items scored on both runs (a record without an `answer` has no `exact_match`), in the
    suite's order: the per-item scores the statistics pair."""
    names = {}
    for name in a.metrics:
        if name in NOT_PAIRED or name not in b.metrics:
            continue
        both = [
            i
            for i, (sa, sb) in enumerate(zip(a.samples, b.samples))
            if _number(sa.get(name)) and _number(sb.get(name))
        ]
        if both:
            names[name] = both
    return names


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def compare_results(
    results_a: Sequence[SuiteResult],
    results_b: Sequence[SuiteResult],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, dict[str, Any]]:
    """``{suite: {n, stats: {metric: compare_samples(...)}, samples: [paired records]}}``.

    Samples pair by position (a suite lists its items in a fixed order); their identity
    (`where` / `task_id`) must agree, else the runs did not score the same items."""
    by_name = {r.name: r for r in results_b}
    out: dict[str, dict[str, Any]] = {}
    for ra in results_a:
        rb = by_name.get(ra.name)
        if rb is None:
            raise ValueError(f"compare: suite {ra.name!r} ran on A but not on B")
        if len(ra.samples) != len(rb.samples):
            raise ValueError(
                f"compare: suite {ra.name!r} scored {len(ra.samples)} items on A and "
                f"{len(rb.samples)} on B"
            )
        records = []
        names = paired_metrics(ra, rb)
        for i, (sa, sb) in enumerate(zip(ra.samples, rb.samples)):
            record: dict[str, Any] = {"index": i}
            for key in ID_FIELDS:
                if key in sa or key in sb:
                    if sa.get(key) != sb.get(key):
                        raise ValueError(
                            f"compare: suite {ra.name!r} item {i}: {key} {sa.get(key)!r} on A, "
                            f"{sb.get(key)!r} on B"
                        )
                    record[key] = sa[key]
            record["a"] = {m: sa[m] for m in names if _number(sa.get(m))}
            record["b"] = {m: sb[m] for m in names if _number(sb.get(m))}
            records.append(record)
        stats = {
            m: compare_samples(
                [ra.samples[i][m] for i in items],
                [rb.samples[i][m] for i in items],
                resamples=resamples,
                seed=seed,
            )
            for m, items in names.items()
        }
        if not names:
            log.warning("%s: no per-sample metric to pair", ra.name)
        out[ra.name] = {"n": len(records), "stats": stats, "samples": records}
    return out


def _f(value: float, sign: str = "") -> str:
    return f"{value:{sign}.4f}" if abs(value) < 1e4 else f"{value:{sign}.4g}"


def _ci(ci: Sequence[float] | None) -> str:
    return "" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def _table(rows: list[tuple[str, ...]], right_from: int) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            f"{cell:<{w}}" if i < right_from else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_comparison(
    paired: Mapping[str, Mapping[str, Any]],
    results_a: Sequence[SuiteResult],
    results_b: Sequence[SuiteResult],
) -> str:
    """The paired table (per-sample means, B - A, paired 95% interval, McNemar's p, the
    unpaired interval), then every suite figure of A and B as the suites report them."""
    rows = [
        ("suite", "metric", "n", "A", "B", "B-A", "paired 95% CI", "p (McNemar)", "unpaired CI")
    ]
    for suite, entry in paired.items():
        for metric, s in entry["stats"].items():
            p = s.get("p")
            rows.append(
                (
                    suite,
                    metric,
                    str(s["n"]),
                    _f(s["a"]),
                    _f(s["b"]),
                    _f(s["diff"], "+"),
                    _ci(s["ci"]),
                    "" if p is None else f"{p:.4g}",
                    _ci(s.get("unpaired_ci")),
                )
            )
    by_name = {r.name: r for r in results_b}
    figures = [("suite", "metric", "A", "B", "B-A")]
    for ra in results_a:
        rb = by_name[ra.name]
        for metric, va in ra.metrics.items():
            vb = rb.metrics.get(metric)
            if vb is not None:
                figures.append((ra.name, metric, _f(va), _f(vb), _f(vb - va, "+")))
    return (
        "paired over items (A, B: means of the per-item scores; CI: "
        "paired bootstrap; unpaired CI: Newcombe, for 0/1 scores)\n"
        + _table(rows, 2)
        + "\n\nthe suites' figures\n"
        + _table(figures, 2)
    )


def check_adapters(cfg: Mapping[str, Any]) -> tuple[EvalAdapter | None, EvalAdapter | None]:
    """The LoRA adapters over A and B (`adapter_a`, `adapter_b`; None: the base), checked
    before any model loads; `adapter=` is refused (it would not say which side)."""
    if cfg.get("adapter"):
        raise SystemExit("compare: give the adapter of each side as adapter_a= / adapter_b=")
    out = []
    for key in ("adapter_a", "adapter_b"):
        try:
            out.append(check_adapter(str(cfg[key]), key) if cfg.get(key) else None)
        except ValueError as err:
            raise SystemExit(f"compare: {err}") from None
    return out[0], out[1]


def _context_cap(model_dir: Path) -> int | None:
    """The model's `max_position_embeddings` from its config.json (None: not stated)."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def _release() -> None:
    """Free the model just evaluated before the next one loads."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Check both directories and the suites, evaluate A then B, pair the samples, print
    the table and write `out`; returns the comparison (the JSON's content)."""
    from astrai.eval.runner import build_suites, evaluate_model

    dirs = check_dirs(str(cfg["a"]), str(cfg["b"]))  # before anything heavy is imported
    adapters = check_adapters(cfg)
    suites: dict[str, Suite] = build_suites(cfg.get("suites") or {})

    from astrai.data.storage import DataError
    from astrai.tokenizer import AutoTokenizer

    # both tokenizers stay alive: suites cache their encodings by the tokenizer's id()
    tokenizers = [AutoTokenizer.from_pretrained(d) for d in dirs]
    try:
        needs = [max(s.required_seq_len(t) for s in suites.values()) for t in tokenizers]
    except (DataError, ValueError) as err:
        raise SystemExit(str(err)) from None
    engine = dict(cfg["engine"])
    if not engine.get("max_seq_len"):  # one context for both: the same perplexity windows
        caps = [c for c in map(_context_cap, dirs) if c]
        engine["max_seq_len"] = min([max(*needs, 64), *caps])
    run_cfg = {**cfg, "engine": engine}

    runs = []
    for label, model_dir, tokenizer, need, adapter in zip("AB", dirs, tokenizers, needs, adapters):
        log.info("model %s: %s%s", label, model_dir, f" + {adapter.path}" if adapter else "")
        results, max_seq_len = evaluate_model(run_cfg, model_dir, tokenizer, suites, need, adapter)
        runs.append((results, max_seq_len))
        _release()
    (results_a, len_a), (results_b, len_b) = runs

    resamples = int(cfg.get("resamples") or BOOTSTRAP_RESAMPLES)
    seed = int(cfg.get("bootstrap_seed") or BOOTSTRAP_SEED)
    paired = compare_results(results_a, results_b, resamples=resamples, seed=seed)
    print(format_comparison(paired, results_a, results_b))
    samples = bool(cfg.get("samples", True))
    data = {
        "a": {
            "model_path": str(dirs[0]),
            "adapter": None if adapters[0] is None else str(adapters[0].path),
            "max_seq_len": len_a,
            "suites": {r.name: r.to_dict(samples=samples) for r in results_a},
        },
        "b": {
            "model_path": str(dirs[1]),
            "adapter": None if adapters[1] is None else str(adapters[1].path),
            "max_seq_len": len_b,
            "suites": {r.name: r.to_dict(samples=samples) for r in results_b},
        },
        "bootstrap": {"resamples": resamples, "seed": seed, "confidence": 0.95},
        "suites": paired,
    }
    if cfg.get("out"):
        path = write_json(cfg["out"], data)
        print(f"comparison -> {path}")
    return data


#: Hydra's flags that take a value (`--cfg job`): the value is no model directory
_FLAG_VALUES = frozenset(
    {"-c", "--cfg", "-p", "--package", "-cn", "--config-name", "-cp", "--config-path"}
    | {"-cd", "--config-dir", "--experimental-rerun"}
)


def split_args(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """The positional arguments (the model directories), the overrides (``key=value``) and
    Hydra's flags with their values (``--cfg job``, ``-m``), each in order."""
    positional, overrides, flags = [], [], []
    takes_value = False
    for arg in argv:
        if takes_value or arg.startswith("-"):
            flags.append(arg)
            takes_value = not takes_value and arg in _FLAG_VALUES
        elif "=" in arg:
            overrides.append(arg)
        else:
            positional.append(arg)
    return positional, overrides, flags


def _quote(path: str) -> str:
    """A path as a Hydra override value: quoted (commas, brackets and spaces stay text),
    its quotes and ``${`` escaped (no interpolation)."""
    return "'" + path.replace("'", "\\'").replace("${", "\\${") + "'"


def _cli(cfg: Any) -> None:
    from omegaconf import OmegaConf

    from astrai.runtime import setup_logging

    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    setup_logging(options.get("log_level"))
    run(options)


def main(argv: Sequence[str]) -> None:
    """The ``compare`` subcommand: `argv` is what follows ``compare`` on the command line."""
    positional, overrides, flags = split_args(argv)
    helping = any(a in ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info") for a in flags)
    if len(positional) != 2 and not helping:
        raise SystemExit(f"compare: expected two model directories, got {len(positional)}\n{USAGE}")
    if any(a.split("=", 1)[0].lstrip("+~") == "model_path" for a in overrides):
        raise SystemExit("compare: the models are the positional A and B, not model_path=")
    if len(positional) == 2:
        a, b = check_dirs(*positional)  # in a second, before Hydra, torch or a model
        overrides = [f"a={_quote(str(a))}", f"b={_quote(str(b))}", *overrides]

    import hydra

    from astrai.cli_keys import command_line
    from astrai.eval.runner import CONF_DIR

    # overrides before flags: Hydra's parser takes no override after `--cfg job`
    sys.argv[1:] = [*command_line("eval", overrides, config_name="compare"), *flags]
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="compare")(_cli)()
