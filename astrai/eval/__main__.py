"""``python -m astrai.eval model_path=<dir> [eval=[arithmetic,code]] [out=results.json]``.

Hydra composes ``conf/eval.yaml``: the suites come from the ``eval`` group (``conf/eval/``,
each file one suite under ``suites.<name>``; ``eval=[perplexity,multiple_choice]`` picks
them, ``suites.code.num_samples=10`` sets an option), the engine from the ``engine`` group.
The model directory is checked first, then every suite reads and checks its task file and
tokenises its items, all before torch and the model are imported, so a wrong
``model_path`` or a bad file fails in a second with one line naming it. One engine
(sized by the longest suite) runs all of them; the results print as a table and, with
``out=<path>``, are written as JSON with every sample.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.eval.report import format_table, write_results
from astrai.eval.suite import Suite, SuiteResult
from astrai.model.directory import check_model_dir

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine

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
    engine: InferenceEngine, suites: Mapping[str, Suite], *, progress: bool = False
) -> list[SuiteResult]:
    """Run every suite on `engine`, in order."""
    results = []
    for suite in suites.values():
        log.info("running %s", suite)
        result = suite.run(engine, progress=progress)
        log.info("%s done in %.1f s", suite.name, result.seconds)
        results.append(result)
    return results


def run(cfg: Mapping[str, Any]) -> list[SuiteResult]:
    """Check suites, load the model, evaluate, print the table and write `out`."""
    model_dir = check_model_dir(str(cfg["model_path"]))  # before anything heavy is imported
    suites = build_suites(cfg.get("suites") or {})

    from hydra.utils import instantiate

    from astrai.data.storage import DataError
    from astrai.tokenizer import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        need = max(suite.required_seq_len(tokenizer) for suite in suites.values())
    except (DataError, ValueError) as err:
        raise SystemExit(str(err)) from None

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
    sizes = {}
    if not cfg["engine"].get("max_seq_len"):
        sizes["max_seq_len"] = min(max(need, 64), model.config.max_position_embeddings)
    with instantiate(cfg["engine"])(model, tokenizer, start=False, **sizes) as engine:
        results = evaluate(engine, suites, progress=bool(cfg.get("progress", True)))
    print(format_table(results))
    if cfg.get("out"):
        meta = {"model_path": str(model_dir), "max_seq_len": engine.max_seq_len}
        path = write_results(cfg["out"], results, samples=bool(cfg.get("samples")), meta=meta)
        print(f"results -> {path}")
    return results


def _cli(cfg: Any) -> None:
    from omegaconf import OmegaConf

    from astrai.runtime import setup_logging

    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    setup_logging(options.get("log_level"))  # quiet third parties; debug shows everything
    run(options)


def main() -> None:
    import hydra

    from astrai.cli_keys import command_line

    sys.argv[1:] = command_line("eval", sys.argv[1:])  # model.path= -> model_path=; typos named

    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="eval")(_cli)()


if __name__ == "__main__":
    main()
