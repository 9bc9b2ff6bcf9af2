"""Batch generation: `python -m astrai.generate model_path=<dir> input=<jsonl> output=<jsonl>`.

Each input line is a JSON object with `prompt` (raw text) or `messages` (a chat, rendered
with the model's chat template and a generation prompt); optional per-line `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed` override the config. All lines are submitted at
once (continuous batching) to one `InferenceEngine`, built from the `engine` group
(conf/engine/: `engine=contiguous`, `engine.max_batch_size=64`). The output holds exactly
one line per input line, in order: the input's fields plus `completion`, `finish_reason`
and token counts, or `error` naming what was wrong with that line. A bad line never stops
the others. The output is written to a temporary file and renamed when complete; when any
line failed the command names them and exits with status 1 (the good lines are written).

A line's own `max_tokens` is held to the context as the server holds a request's: beyond
what fits after its prompt, the line fails naming both numbers (`max_tokens_policy=error`,
the default) or generates until the context is full (`clamp`, finish_reason length). The
config's `max_tokens`, the default of lines without one, is capped to what fits.
`model_path`, `input`, `output` and the settings are checked before torch and the model are
imported, so a wrong or missing one fails in a second with one line; the engine's `lora` and
`speculative` blocks before the model loads.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from astrai.cli_keys import command_line
from astrai.inference.engine_options import check_engine_blocks
from astrai.inference.params import MAX_TOKENS_POLICIES, SamplingParams, check_choice
from astrai.model.directory import check_model_dir

if TYPE_CHECKING:  # imported in `_run`, after the checks
    from astrai.inference import GenerateResult, InferenceEngine
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
PER_LINE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def _prompt_of(record: Any, tokenizer: AutoTokenizer) -> str | list[int]:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        # ids, not text: encoding the rendered text would parse special tokens typed
        # into the messages as control tokens
        return tokenizer.apply_chat_template(
            record["messages"], tools=record.get("tools"), add_generation_prompt=True, tokenize=True
        )
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise ValueError("field 'prompt' must be a non-empty string")
        return record["prompt"]
    raise ValueError("missing field: each line needs 'prompt' or 'messages'")


def generate_file(
    engine: InferenceEngine,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    sampling: SamplingParams | Mapping[str, Any],
    *,
    progress: bool = True,
    max_tokens_policy: str = "error",
) -> dict[str, Any]:
    """Generate for every line of `input_path` into `output_path`; returns the counts and
    `failed_lines` (the 1-based numbers of the lines whose row holds an `error`).

    `sampling` holds every line's defaults (a `SamplingParams`, or its fields; its
    `max_tokens` capped to the context); a line's own `PER_LINE` fields override them, and
    its own `max_tokens` follows `max_tokens_policy` (`error`: beyond the context the line
    fails, naming it; `clamp`: generate until the context is full)."""
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams(**sampling)
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file not found: {input_path}")
    lines = input_path.read_text(encoding="utf-8").splitlines()
    entries: list[tuple[dict | None, GenerateResult | str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            entries.append((None, f"line {number}: empty line"))
            continue
        try:
            record = json.loads(line)
            prompt = _prompt_of(record, engine.tokenizer)
            own = {k: record[k] for k in PER_LINE if k in record}
            policy = max_tokens_policy if "max_tokens" in record else "clamp"
            entries.append(
                (record, engine.submit(prompt, sampling, **own, max_tokens_policy=policy))
            )
        except (json.JSONDecodeError, ValueError, TypeError) as err:
            logger.warning("%s line %d: %s", input_path, number, err)
            entries.append((None, f"line {number}: {err}"))
    counts: dict[str, Any] = {"lines": len(lines), "ok": 0, "errors": 0, "completion_tokens": 0}
    failed: list[int] = []
    tmp = output_path.with_name(f".{output_path.name}.tmp")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w", encoding="utf-8") as out:
        for number, (record, result) in enumerate(
            tqdm(entries, desc="generate", disable=not progress), start=1
        ):
            if isinstance(result, str):
                row: dict[str, Any] = {"line": number, "error": result}
            else:
                try:
                    text = result.wait_completion()
                    row = {
                        **record,
                        "completion": text,
                        "finish_reason": result.finish_reason,
                        "prompt_tokens": len(result.task.prompt_ids),
                        "completion_tokens": len(result.token_ids),
                    }
                    counts["completion_tokens"] += len(result.token_ids)
                except ValueError as err:  # rejected by the engine (e.g. prompt too long)
                    param = result.task.error_param  # max_tokens: the line's own field
                    field = f"{param}: " if param == "max_tokens" else ""
                    row = {"line": number, "error": f"line {number}: {field}{err}"}
            counts["errors" if "error" in row else "ok"] += 1
            if "error" in row:
                failed.append(number)
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, output_path)
    counts["failed_lines"] = failed
    return counts


def _required(cfg: DictConfig) -> None:
    """`input=` and `output=` are given: one line naming each missing one (Hydra would raise
    MissingMandatoryValue when the value is first read, after the model loaded)."""
    missing = [key for key in ("input", "output") if OmegaConf.is_missing(cfg, key)]
    if missing:
        keys = " ".join(f"{key}=<file.jsonl>" for key in missing)
        raise SystemExit(
            f"generate: {keys} required (input: one request a line; output: one result a line)"
        )


def _run(cfg: DictConfig) -> None:
    _required(cfg)
    model_dir = check_model_dir(str(cfg.model_path))  # the cheap checks, before torch
    if not Path(cfg.input).is_file():
        raise SystemExit(f"input={cfg.input}: file not found (a JSONL file, one request a line)")
    try:
        policy = check_choice("max_tokens_policy", cfg.max_tokens_policy, MAX_TOKENS_POLICIES)
        sampling = SamplingParams(
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            seed=cfg.seed,
        ).validate()
    except ValueError as err:
        raise SystemExit(str(err)) from None

    from hydra.utils import instantiate

    from astrai.model import AutoModel
    from astrai.runtime import configure
    from astrai.tokenizer import AutoTokenizer

    configure(cfg)  # log level, quiet third parties, torch threads
    check_engine_blocks(OmegaConf.to_container(cfg.engine, resolve=True))  # type: ignore[arg-type]
    model = AutoModel.from_pretrained(model_dir, device=cfg.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with instantiate(cfg.engine)(model, tokenizer) as engine:
        counts = generate_file(
            engine,
            cfg.input,
            cfg.output,
            sampling,
            progress=cfg.progress,
            max_tokens_policy=policy,
        )
    print(
        f"generated {counts['ok']} of {counts['lines']} lines "
        f"({counts['errors']} errors, {counts['completion_tokens']} tokens) -> {cfg.output}"
    )
    if counts["failed_lines"]:  # a batch job must not look like a success
        failed = counts["failed_lines"]
        numbers = ("lines " if len(failed) > 1 else "line ") + ", ".join(map(str, failed))
        raise SystemExit(
            f"{len(failed)} of {counts['lines']} input lines failed ({numbers} of "
            f"{cfg.input}); their rows in {cfg.output} hold the error"
        )


def main() -> None:
    sys.argv[1:] = command_line("generate", sys.argv[1:])  # model.path= -> model_path=; typos named
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="generate")(_run)()


if __name__ == "__main__":
    main()
