"""How ``prepare`` turns one input record into one document's arrays, and the options that
govern it (:class:`PrepareOptions`, checked once before any input is read)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from dataclasses import fields as option_fields
from typing import Any, ClassVar

from astrai.data.formats import record_format
from astrai.data.packing import PACKING_STRATEGIES
from astrai.data.storage import DataError
from astrai.tokenizer.chat import TURNS_FORMS, as_turns

KINDS = ("pretrain", "sft", "preference", "prompt", "unpaired")
TOKEN_KEYS = ("input_ids", "chosen_ids", "rejected_ids", "prompt_ids", "completion_ids")
#: The arrays of one ``unpaired`` document (KTO's thumbs-up/down data): the prompt and the
#: completion apart, so a batch can pair a prompt with another row's completion, and the
#: label as one 0/1 element.
UNPAIRED_KEYS = ("prompt_ids", "completion_ids", "completion_mask", "label")
#: What ``truncate`` keeps of a record over ``max_length`` (TRL's ``truncation_mode``): its
#: first or its last ``max_length`` tokens.
TRUNCATION_MODES = {
    "keep_start": lambda n: slice(None, n),
    "keep_end": lambda n: slice(-n, None),
}


@dataclass
class PrepareOptions:
    """The encoding options of one prepare run; all of them enter the output's signature, so
    a finished output is reused only when they are the same."""

    kind: str
    max_length: int | None
    pack: bool
    window_size: int | None
    truncate: bool
    skip_bad_lines: bool
    text_field: str
    add_bos: bool
    add_eos: bool
    required_fields: list[str]
    #: the input's record layout and field renames (:mod:`astrai.data.formats`)
    format: str | None = None
    columns: dict[str, str] | None = None
    #: how packed windows are filled and which end of an over-long record is kept (TRL's names)
    packing_strategy: str = "greedy"
    truncation_mode: str = "keep_start"

    #: options added after format 1: at their default they stay out of the signature, so
    #: outputs prepared before the option existed keep theirs
    UNSIGNED_AT_DEFAULT: ClassVar[tuple[str, ...]] = (
        "format",
        "columns",
        "packing_strategy",
        "truncation_mode",
    )

    def signature(self) -> dict[str, Any]:
        """The options as the output's signature records them."""
        defaults = {f.name: f.default for f in option_fields(self)}
        return {
            k: v
            for k, v in asdict(self).items()
            if not (k in self.UNSIGNED_AT_DEFAULT and v == defaults[k])
        }

    @classmethod
    def parse(
        cls,
        kind: str,
        *,
        max_length: int | None = None,
        pack: bool = False,
        window_size: int | None = None,
        truncate: bool = False,
        skip_bad_lines: bool = False,
        text_field: str = "text",
        add_bos: bool = False,
        add_eos: bool = True,
        required_fields: Sequence[str] = (),
        format: str | None = None,
        columns: Mapping[str, str] | None = None,
        packing_strategy: str = "greedy",
        truncation_mode: str = "keep_start",
    ) -> PrepareOptions:
        """Check the options together (a clear :class:`DataError` naming the option); with
        ``pack`` the window also caps ``max_length``."""
        if kind not in KINDS:
            raise DataError(f"kind must be one of {KINDS}, got {kind!r}")
        if pack and kind != "sft":
            where = (
                "pretrain data is windowed at load time (PretrainDataset window_size/stride; "
                "reset_position_ids=true for per-document positions)"
                if kind == "pretrain"
                else f"kind={kind} keeps one sequence per record"
            )
            raise DataError(f"pack=true applies to kind=sft only: {where}")
        if pack and not window_size:
            raise DataError("pack=true needs window_size (the length of a packed window)")
        record_format(format, columns, kind)  # refuses an unknown format or column early
        if packing_strategy not in PACKING_STRATEGIES:
            raise DataError(
                f"packing_strategy must be one of {PACKING_STRATEGIES}, got {packing_strategy!r}"
            )
        if packing_strategy != "greedy" and not pack:
            raise DataError(f"packing_strategy={packing_strategy} needs pack=true")
        if truncation_mode not in TRUNCATION_MODES:
            raise DataError(
                f"truncation_mode must be one of {tuple(TRUNCATION_MODES)}, got {truncation_mode!r}"
            )
        if truncation_mode != "keep_start" and not truncate:
            raise DataError(
                f"truncation_mode={truncation_mode} needs truncate=true (without it, records "
                f"over max_length are skipped)"
            )
        if pack:
            max_length = min(max_length or window_size, window_size)  # type: ignore[type-var]
        return cls(
            kind=kind,
            max_length=max_length,
            pack=pack,
            window_size=window_size,
            truncate=truncate,
            skip_bad_lines=skip_bad_lines,
            text_field=text_field,
            add_bos=add_bos,
            add_eos=add_eos,
            required_fields=list(required_fields),
            format=None if format in (None, "openai") else format,
            columns=dict(columns) if columns else None,
            packing_strategy=packing_strategy,
            truncation_mode=truncation_mode,
        )


class Skip(Exception):
    """A record that is left out and counted under ``reason`` (too long, no assistant turn)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _require(record: Any, fields: Sequence[str], where: str) -> None:
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in fields:
        if name not in record:
            raise DataError(
                f"{where}: record is missing required field {name!r} (has: {sorted(record)})"
            )


def _as_messages(value: Any, role: str, where: str, name: str) -> list[dict[str, Any]]:
    turns = as_turns(value, role)
    if turns is None:
        raise DataError(f"{where}: field {name!r} {TURNS_FORMS}")
    return turns


def _fit(ids: list[int], mask: list[int], opts: PrepareOptions) -> tuple[list[int], list[int]]:
    if opts.max_length is not None and len(ids) > opts.max_length:
        if not opts.truncate:
            raise Skip("too_long")
        keep = TRUNCATION_MODES[opts.truncation_mode](opts.max_length)
        ids, mask = ids[keep], mask[keep]
    if not any(mask):
        raise Skip("no_assistant_tokens")
    return ids, mask


def _encode_chat(tok: Any, messages: Any, tools: Any, where: str) -> tuple[list[int], list[int]]:
    try:
        return tok.encode_chat(messages, tools=tools)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: cannot render the chat: {exc}") from exc


def _encode_prompt(tok: Any, messages: Any, tools: Any, where: str) -> list[int]:
    """The prompt's ids with the generation prompt (what a model answers after)."""
    try:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: cannot render the prompt: {exc}") from exc


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _encode_unpaired(tok: Any, record: Any, where: str, opts: PrepareOptions) -> dict[str, Any]:
    """One thumbs-up/down record: ``prompt`` and ``completion`` rendered together by the chat
    template, split where the rendered prompt (generation prompt included) stops being a
    prefix of the whole, as TRL splits them; only the completion's assistant tokens are
    scored."""
    _require(record, ["prompt", "completion", "label", *opts.required_fields], where)
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(
            f"{where}: field 'label' must be true or false, got {json.dumps(label, default=repr)}"
        )
    prompt = _as_messages(record["prompt"], "user", where, "prompt")
    completion = _as_messages(record["completion"], "assistant", where, "completion")
    tools = record.get("tools")
    ids, mask = _encode_chat(tok, prompt + completion, tools, where)
    split = _common_prefix(_encode_prompt(tok, prompt, tools, where), ids)
    if opts.max_length is not None and split >= opts.max_length:
        raise Skip("too_long")  # the prompt alone fills max_length (TRL drops these too)
    # earlier assistant turns of a multi-turn prompt are context here, not scored
    full = len(ids)
    ids, mask = _fit(ids, [0] * split + list(mask[split:]), opts)
    if opts.truncation_mode == "keep_end":  # the cut took the prompt's start
        split = max(split - (full - len(ids)), 0)
    return {
        "prompt_ids": ids[:split],
        "completion_ids": ids[split:],
        "completion_mask": mask[split:],
        "label": [int(label)],
    }


def encode_record(tok: Any, record: Any, where: str, opts: PrepareOptions) -> dict[str, Any]:
    """One document's arrays for a non-pretrain record; raises Skip or DataError."""
    if opts.kind == "sft":
        _require(record, ["messages"], where)
        ids, mask = _encode_chat(tok, record["messages"], record.get("tools"), where)
        ids, mask = _fit(ids, mask, opts)
        return {"input_ids": ids, "loss_mask": mask}
    if opts.kind == "preference":
        _require(record, ["prompt", "chosen", "rejected"], where)
        prompt = _as_messages(record["prompt"], "user", where, "prompt")
        out: dict[str, Any] = {}
        for side in ("chosen", "rejected"):
            msgs = prompt + _as_messages(record[side], "assistant", where, side)
            ids, mask = _encode_chat(tok, msgs, record.get("tools"), where)
            out[f"{side}_ids"], out[f"{side}_mask"] = _fit(ids, mask, opts)
        return out
    if opts.kind == "prompt":
        _require(record, ["prompt", *opts.required_fields], where)
        msgs = _as_messages(record["prompt"], "user", where, "prompt")
        ids = _encode_prompt(tok, msgs, record.get("tools"), where)
        if opts.max_length is not None and len(ids) > opts.max_length:
            raise Skip("too_long")
        return {"prompt_ids": ids, "records": json.dumps(record, ensure_ascii=False)}
    if opts.kind == "unpaired":
        return _encode_unpaired(tok, record, where, opts)
    raise AssertionError(opts.kind)


def pretrain_text(record: Any, where: str, opts: PrepareOptions) -> str:
    """The text of a pretrain record: a bare string or the ``text_field`` of an object."""
    if isinstance(record, str):
        return record
    _require(record, [opts.text_field], where)
    text = record[opts.text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {opts.text_field!r} must be a string")
    return text
