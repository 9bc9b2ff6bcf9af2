"""Suites on one model: build them from config, load the model, run them through one engine.

`python -m astrai.eval` (one model) and `python -m astrai.eval compare` (two, one after the
other) both run this.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.eval.adapter import EvalAdapter, lora_settings
from astrai.eval.suite import Suite, SuiteResult

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

__all__ = ["CONF_DIR", "build_suites", "evaluate", "evaluate_model", "load_adapter"]

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

log = logging.getLogger("astrai.eval")


def build_suites(nodes: Mapping[str, Any]) -> dict[str, Suite]:
    """Instantiate the ``suites`` config nodes (a node without ``name`` takes its key);
    a bad option or task file is a SystemExit naming the suite and the problem."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    suites = {}
    for key, node in nodes.items():
        if node is None:
            continue
        try:
            suite = instantiate(node) if "name" in node else instantiate(node, name=key)
        except InstantiationException as err:
            raise SystemExit(f"suites.{key}: {err.__cause__ or err}") from None
        if not isinstance(suite, Suite):
            raise SystemExit(f"suites.{key}: {type(suite).__name__} is not an astrai.eval.Suite")
        suites[key] = suite
    if not suites:
        raise SystemExit("no suites selected: pass eval=[perplexity,multiple_choice,...]")
    return suites


def evaluate(
    engine: InferenceEngine,
    suites: Mapping[str, Suite],
    *,
    progress: bool = False,
    adapter: str | None = None,
) -> list[SuiteResult]:
    """Run every suite on `engine`, in order, every request naming `adapter` (an adapter
    the engine has loaded; None: the base model). Sets each suite's `adapter`."""
    results = []
    for suite in suites.values():
        suite.adapter = adapter
        log.info("running %s%s", suite, "" if adapter is None else f" on adapter {adapter!r}")
        result = suite.run(engine, progress=progress)
        log.info("%s done in %.1f s", suite.name, result.seconds)
        results.append(result)
    return results


def evaluate_model(
    cfg: Mapping[str, Any],
    model_dir: Path,
    tokenizer: AutoTokenizer,
    suites: Mapping[str, Suite],
    need: int,
    adapter: EvalAdapter | None = None,
) -> tuple[list[SuiteResult], int]:
    """Load `model_dir` (`device`, `dtype`, `backend`, `threads` of `cfg`), build the
    `engine` (context `need`, capped by the model's, unless `engine.max_seq_len` is set),
    run `suites`; the results and the engine's context. With `adapter` (checked by
    `check_adapter`) the engine serves it from one slot and every request names it. The
    model is released on return, so a caller can evaluate another next (`compare`)."""
    from hydra.utils import instantiate

    from astrai.runtime import set_threads

    set_threads(cfg.get("threads"))  # after the cheap checks: it imports torch
    import torch

    from astrai.model import AutoModel

    if cfg.get("backend"):
        os.environ["ASTR_BACKEND"] = str(cfg["backend"])
    device = str(cfg.get("device") or "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None
    model = AutoModel.from_pretrained(model_dir, device=device, dtype=dtype).eval()
    options: dict[str, Any] = {}
    if not cfg["engine"].get("max_seq_len"):
        options["max_seq_len"] = min(max(need, 64), model.config.max_position_embeddings)
    if adapter is not None:
        options["lora"] = lora_settings(cfg["engine"].get("lora"), adapter)
    with instantiate(cfg["engine"])(model, tokenizer, start=False, **options) as engine:
        if adapter is not None:
            load_adapter(engine, adapter)
        results = evaluate(
            engine,
            suites,
            progress=bool(cfg.get("progress", True)),
            adapter=None if adapter is None else adapter.name,
        )
    return results, engine.max_seq_len


def load_adapter(engine: InferenceEngine, adapter: EvalAdapter) -> None:
    """Load `adapter` on `engine`; a mismatch with the base (another model's adapter, a
    rank or target the engine refuses) is a SystemExit naming `adapter` and the file."""
    from astrai.inference.adapters import AdapterError

    try:
        engine.load_adapter(adapter.name, adapter.path)
    except AdapterError as err:
        raise SystemExit(f"adapter={adapter.path}: {err}") from None
