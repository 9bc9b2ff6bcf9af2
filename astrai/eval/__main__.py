"""``python -m astrai.eval model_path=<dir> [adapter=<dir>] [eval=[arithmetic,code]] [out=results.json]``.

Hydra composes ``conf/eval.yaml``: the suites come from the ``eval`` group (``conf/eval/``,
each file one suite under ``suites.<name>``; ``eval=[perplexity,multiple_choice]`` picks
them, ``suites.code.num_samples=10`` sets an option), the engine from the ``engine`` group.
The model directory is checked first, then every suite reads and checks its task file and
tokenises its items, all before torch and the model are imported, so a wrong
``model_path`` or a bad file fails in a second with one line naming it. One engine
(sized by the longest suite) runs all of them; the results print as a table and, with
``out=<path>``, are written as JSON with every sample. ``adapter=<dir>`` evaluates a LoRA
adapter over the base `model_path` (served from an engine slot, every request naming it:
:mod:`astrai.eval.adapter`); its directory is checked with the model's.

``python -m astrai.eval compare A B [overrides]`` runs the same suites on two model
directories and reports paired differences (:mod:`astrai.eval.compare`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from astrai.eval.adapter import check_adapter
from astrai.eval.report import format_table, write_results
from astrai.eval.runner import CONF_DIR, build_suites, evaluate_model
from astrai.eval.suite import SuiteResult
from astrai.model.directory import check_model_dir

log = logging.getLogger("astrai.eval")


def run(cfg: Mapping[str, Any]) -> list[SuiteResult]:
    """Check suites, load the model, evaluate, print the table and write `out`."""
    model_dir = check_model_dir(str(cfg["model_path"]))  # before anything heavy is imported
    adapter = None
    if cfg.get("adapter"):
        try:
            adapter = check_adapter(str(cfg["adapter"]))
        except ValueError as err:
            raise SystemExit(str(err)) from None
    suites = build_suites(cfg.get("suites") or {})

    from astrai.data.storage import DataError
    from astrai.tokenizer import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        need = max(suite.required_seq_len(tokenizer) for suite in suites.values())
    except (DataError, ValueError) as err:
        raise SystemExit(str(err)) from None

    results, max_seq_len = evaluate_model(cfg, model_dir, tokenizer, suites, need, adapter)
    print(format_table(results))
    if cfg.get("out"):
        meta = {
            "model_path": str(model_dir),
            "adapter": None if adapter is None else str(adapter.path),
            "max_seq_len": max_seq_len,
        }
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

    if sys.argv[1:2] == ["compare"]:  # python -m astrai.eval compare A B [overrides]
        from astrai.eval.compare import main as compare_main

        return compare_main(sys.argv[2:])
    sys.argv[1:] = command_line("eval", sys.argv[1:])  # model.path= -> model_path=; typos named

    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="eval")(_cli)()


if __name__ == "__main__":
    main()
