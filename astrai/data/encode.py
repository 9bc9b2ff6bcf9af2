"""How ``prepare`` turns one input record into one document's arrays, and the options that
govern it (:class:`PrepareOptions`, checked once before any input is read)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from astrai.data.storage import DataError

KINDS = ("pretrain", "sft", "preference", "prompt")
TOKEN_KEYS = ("input_ids", "chosen_ids", "rejected_ids", "prompt_ids")


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
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return [dict(m) for m in value]
    raise DataError(f"{where}: field {name!r} must be a string, a message or a list of messages")


def _fit(ids: list[int], mask: list[int], opts: PrepareOptions) -> tuple[list[int], list[int]]:
    if opts.max_length is not None and len(ids) > opts.max_length:
        if not opts.truncate:
            raise Skip("too_long")
        ids, mask = ids[: opts.max_length], mask[: opts.max_length]
    if not any(mask):
        raise Skip("no_assistant_tokens")
    return ids, mask


def _encode_chat(tok: Any, messages: Any, tools: Any, where: str) -> tuple[list[int], list[int]]:
    try:
        return tok.encode_chat(messages, tools=tools)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: cannot render the chat: {exc}") from exc


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
        try:
            ids = tok.apply_chat_template(
                msgs, tools=record.get("tools"), add_generation_prompt=True, tokenize=True
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"{where}: cannot render the prompt: {exc}") from exc
        if opts.max_length is not None and len(ids) > opts.max_length:
            raise Skip("too_long")
        return {"prompt_ids": ids, "records": json.dumps(record, ensure_ascii=False)}
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
