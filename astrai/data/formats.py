"""Record layouts ``prepare`` reads besides its own (``format:`` and ``columns:``).

Every kind has one canonical record (``messages``; ``prompt``/``chosen``/``rejected``;
``prompt``; ``prompt``/``completion``/``label``; see :mod:`astrai.data.prepare`). A
:class:`RecordFormat` maps one input record of another layout to it, before
:func:`astrai.data.encode.encode_record` sees it, so a ShareGPT, TRL or Alpaca file needs no
rewriting by hand:

- ``openai`` (the default, ``format: null``): astrai's own fields, the record as it is.
- ``sharegpt``: ``conversations`` of ``{from, value}`` turns, with LLaMA-Factory's field and tag
  names (``role_tag``, ``content_tag``, ``user_tag``, ...) and Axolotl's role aliases.
- ``trl``: TRL's standard and conversational forms (``messages``, ``prompt``/``completion``,
  ``prompt``/``chosen``/``rejected`` or the implicit prompt of ``chosen``/``rejected``).
- ``alpaca``: ``instruction``, ``input``, ``output``, optional ``system`` and ``history``,
  as LLaMA-Factory's Alpaca converter reads them.

``columns:`` renames the fields a format reads (``{messages: conv}``: the record's ``conv``
field is what the format calls ``messages``); its keys are that format's field names for the
kind (:func:`format_fields`). A record that fits no mapping is a :class:`DataError` naming
``where`` (file and row) and the record's own field name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from astrai.data.storage import DataError
from astrai.tokenizer.chat import TURNS_FORMS, as_turns

FORMATS = ("openai", "sharegpt", "trl", "alpaca")

#: The fields astrai's own schema reads, per kind (``tools`` is optional everywhere).
_OPENAI_FIELDS = {
    "sft": ("messages", "tools"),
    "preference": ("prompt", "chosen", "rejected", "tools"),
    "prompt": ("prompt", "tools"),
    "unpaired": ("prompt", "completion", "label", "tools"),
}
_TRL_FIELDS = {
    "sft": ("messages", "prompt", "completion", "tools"),
    "preference": ("prompt", "chosen", "rejected", "tools"),
    "prompt": ("prompt", "tools"),
    "unpaired": ("prompt", "completion", "label", "tools"),
}
#: LLaMA-Factory's ``dataset_info.json`` names: ``columns`` (the record's fields) and ``tags``
#: (the keys and role values of one turn), here one mapping; the values are its defaults.
SHAREGPT_DEFAULTS = {
    "messages": "conversations",
    "system": "system",
    "tools": "tools",
    "chosen": "chosen",
    "rejected": "rejected",
    "label": "label",
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
    "observation_tag": "observation",
    "function_tag": "function_call",
}
_SHAREGPT_FIELDS = {
    "sft": ("messages", "system", "tools"),
    "preference": ("messages", "system", "tools", "chosen", "rejected"),
    "prompt": ("messages", "system", "tools"),
    "unpaired": ("messages", "system", "tools", "label"),
}
_SHAREGPT_TAGS = tuple(k for k in SHAREGPT_DEFAULTS if k.endswith("_tag"))
_ALPACA_FIELDS = {
    "sft": ("instruction", "input", "output", "system", "history"),
    "preference": ("instruction", "input", "chosen", "rejected", "system", "history"),
    "prompt": ("instruction", "input", "system", "history"),
    "unpaired": ("instruction", "input", "output", "label", "system", "history"),
}


def format_fields(name: str, kind: str) -> tuple[str, ...]:
    """The keys ``columns:`` may rename for format ``name`` and ``kind``."""
    if name == "sharegpt":
        return _SHAREGPT_FIELDS[kind] + _SHAREGPT_TAGS
    table = {"openai": _OPENAI_FIELDS, "trl": _TRL_FIELDS, "alpaca": _ALPACA_FIELDS}[name]
    return table[kind]


class _Fields:
    """One record read through the ``columns:`` renames, refusing a missing field with the
    record's own field name, its ``where`` and the format."""

    def __init__(
        self,
        record: Any,
        where: str,
        columns: Mapping[str, str],
        label: str,
        defaults: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(record, Mapping):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        self.record, self.where, self.columns, self.label = record, where, columns, label
        self.defaults = defaults or {}

    def name(self, field: str) -> str:
        return self.columns.get(field) or self.defaults.get(field, field)

    def has(self, field: str) -> bool:
        return self.record.get(self.name(field)) is not None

    def get(self, field: str) -> Any:
        source = self.name(field)
        if source not in self.record:
            renamed = f", columns: {field} -> {source}" if field in self.columns else ""
            raise DataError(
                f"{self.where}: record is missing required field {source!r} "
                f"({self.label}{renamed}; has: {sorted(self.record)})"
            )
        return self.record[source]

    def optional(self, field: str) -> Any:
        return self.record.get(self.name(field))

    def error(self, field: str, problem: str) -> DataError:
        return DataError(f"{self.where}: field {self.name(field)!r} {problem} ({self.label})")


def _turns(value: Any, role: str, fields: _Fields, field: str) -> list[dict[str, Any]]:
    """A string as one turn of ``role``, a message or a list of messages as they are (the
    forms astrai's own prompt/chosen/rejected/completion fields take)."""
    turns = as_turns(value, role)
    if turns is None:
        raise fields.error(field, TURNS_FORMS)
    return turns


def _with_tools(out: dict[str, Any], tools: Any) -> dict[str, Any]:
    if tools is not None:
        out["tools"] = tools
    return out


class RecordFormat:
    """The identity: records already in astrai's schema (``format: openai``, no columns).

    Subclasses map a record of their layout to the kind's canonical record; every mapping
    keeps the record's other fields (a prompt record's ``answer`` is what its reward reads).
    """

    name = "openai"

    def __init__(self, kind: str, columns: Mapping[str, str] | None = None) -> None:
        self.kind, self.columns = kind, dict(columns or {})

    @property
    def label(self) -> str:
        return f"format={self.name}, kind={self.kind}"

    def map(self, record: Any, where: str) -> Any:
        """The canonical record of ``record`` (read at ``where``); raises DataError."""
        return record


class Renamed(RecordFormat):
    """astrai's own schema under other field names (``columns:`` with ``format: openai``)."""

    def map(self, record: Any, where: str) -> Any:
        fields = _Fields(record, where, self.columns, self.label)
        out = dict(record)
        for field in format_fields("openai", self.kind):
            if field == "tools":
                if fields.has("tools"):
                    out["tools"] = fields.get("tools")
            else:
                out[field] = fields.get(field)
        return out


class TRLFormat(RecordFormat):
    """TRL's dataset types (trl/data_utils.py): for ``sft`` the conversational language
    modeling form (``messages``) or prompt-completion (``prompt`` + ``completion``, standard
    or conversational: the completion becomes the assistant's turn); for ``preference``
    explicit or implicit prompt (TRL's ``maybe_extract_prompt``); ``prompt`` and ``unpaired``
    are astrai's own fields. TRL's ``text`` form has no chat turns: ``kind=pretrain``."""

    name = "trl"

    def map(self, record: Any, where: str) -> Any:
        fields = _Fields(record, where, self.columns, self.label)
        tools = fields.optional("tools")
        if self.kind == "sft":
            if fields.has("messages"):
                return _with_tools({**record, "messages": fields.get("messages")}, tools)
            if not fields.has("prompt"):
                if "text" in record:
                    raise DataError(
                        f"{where}: a 'text' record is TRL's language-modeling form, which has no "
                        f"chat turns: prepare it with kind=pretrain ({self.label})"
                    )
                raise DataError(
                    f"{where}: record has neither field {fields.name('messages')!r} nor "
                    f"{fields.name('prompt')!r} and {fields.name('completion')!r} "
                    f"({self.label}; has: {sorted(record)})"
                )
            prompt = _turns(fields.get("prompt"), "user", fields, "prompt")
            completion = _turns(fields.get("completion"), "assistant", fields, "completion")
            return _with_tools({**record, "messages": prompt + completion}, tools)
        if self.kind == "preference":
            chosen, rejected = fields.get("chosen"), fields.get("rejected")
            prompt = fields.optional("prompt")
            if prompt is None or _conversational(prompt) != _conversational(chosen):
                prompt, chosen, rejected = extract_prompt(chosen, rejected, fields)
            out = {**record, "prompt": prompt, "chosen": chosen, "rejected": rejected}
            return _with_tools(out, tools)
        return Renamed(self.kind, self.columns).map(record, where)


def _conversational(value: Any) -> bool:
    """TRL's ``is_conversational`` of one field: a list whose first item is a message."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)


def extract_prompt(chosen: Any, rejected: Any, fields: _Fields) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``: the longest common prefix of ``chosen`` and ``rejected``
    (turns, or characters of strings) is the prompt, a space before the split going with
    the completions."""
    if type(chosen) is not type(rejected) or not isinstance(chosen, str | list):
        raise fields.error("chosen", "and 'rejected' must both be strings or both message lists")
    if not chosen or not rejected:
        raise fields.error("chosen", "and 'rejected' must not be empty (implicit prompt)")
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


class ShareGPTFormat(RecordFormat):
    """ShareGPT: ``conversations`` of ``{from, value}`` turns, as LLaMA-Factory's sharegpt
    converter reads them (field and tag names overridable through ``columns:``). Roles:
    ``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant, ``system`` -> system,
    ``observation``/``tool`` -> tool, ``function_call`` -> an assistant tool call (its value
    the JSON of ``{name, arguments}`` or a list of them). A ``system`` field (when there is no
    system turn) is the leading system message; ``tools`` may be a JSON string."""

    name = "sharegpt"

    def __init__(self, kind: str, columns: Mapping[str, str] | None = None) -> None:
        super().__init__(kind, columns)
        self.roles = {"user": "user", "assistant": "assistant", "tool": "tool"}  # Axolotl's
        for tag, role in (
            ("user_tag", "user"),
            ("assistant_tag", "assistant"),
            ("system_tag", "system"),
            ("observation_tag", "tool"),
            ("function_tag", "function"),
        ):
            self.roles[self._tag(tag)] = role

    def map(self, record: Any, where: str) -> Any:
        fields = _Fields(record, where, self.columns, self.label, SHAREGPT_DEFAULTS)
        turns = fields.get("messages")
        if not isinstance(turns, list):
            raise fields.error("messages", "must be a list of turns")
        messages = [
            self._turn(turn, fields, f"{fields.name('messages')}[{i}]")
            for i, turn in enumerate(turns)
        ]
        system = fields.optional("system")
        if system is not None and not isinstance(system, str):
            raise fields.error("system", f"must be a string, got {type(system).__name__}")
        if system and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
        tools = self._tools(fields)
        out = {k: v for k, v in record.items() if k != fields.name("tools")}  # raw JSON text
        if self.kind == "sft":
            out["messages"] = messages
        elif self.kind == "preference":
            out["prompt"] = messages
            for side in ("chosen", "rejected"):
                out[side] = self._answer(fields.get(side), fields, side)
        elif self.kind == "prompt":
            if messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # the reference answer: the prompt is what precedes it
            out["prompt"] = messages
        else:  # unpaired: the last turn is the completion, as LLaMA-Factory's KTO examples
            if not messages or messages[-1]["role"] != "assistant":
                last = f"{fields.name('messages')}[-1]"
                raise DataError(f"{where}: {last} must be an assistant turn ({self.label})")
            out["prompt"], out["completion"] = messages[:-1], messages[-1:]
            out["label"] = fields.get("label")
        return _with_tools(out, tools)

    def _tag(self, field: str) -> str:
        return self.columns.get(field, SHAREGPT_DEFAULTS[field])

    def _turn(self, turn: Any, fields: _Fields, at: str) -> dict[str, Any]:
        role_key, content_key = self._tag("role_tag"), self._tag("content_tag")
        if not isinstance(turn, Mapping) or role_key not in turn or content_key not in turn:
            raise DataError(
                f"{fields.where}: {at} must be a turn with fields {role_key!r} and "
                f"{content_key!r}, got {json.dumps(turn, default=repr)[:200]} ({self.label})"
            )
        roles = self.roles
        tag, content = turn[role_key], turn[content_key]
        if tag not in roles:
            raise DataError(
                f"{fields.where}: {at}.{role_key} is {tag!r}, not one of {sorted(roles)} "
                f"({self.label}; columns: user_tag, assistant_tag, ... rename them)"
            )
        if roles[tag] == "function":
            return {"role": "assistant", "content": "", "tool_calls": _calls(content, fields, at)}
        if not isinstance(content, str):
            raise DataError(f"{fields.where}: {at}.{content_key} must be a string ({self.label})")
        return {"role": roles[tag], "content": content}

    def _answer(self, value: Any, fields: _Fields, side: str) -> list[dict[str, Any]]:
        """A preference side: one turn (LLaMA-Factory's ranking form), a list of turns or a
        string (the assistant's answer)."""
        if isinstance(value, str):
            return [{"role": "assistant", "content": value}]
        name = fields.name(side)
        if isinstance(value, Mapping):
            return [self._turn(value, fields, name)]
        if isinstance(value, list):
            return [self._turn(t, fields, f"{name}[{i}]") for i, t in enumerate(value)]
        raise fields.error(side, "must be a turn, a list of turns or a string")

    def _tools(self, fields: _Fields) -> Any:
        tools = fields.optional("tools")
        if isinstance(tools, str):
            if not tools.strip():
                return None
            try:
                return json.loads(tools)
            except json.JSONDecodeError as exc:
                raise fields.error("tools", f"is not valid JSON: {exc}") from exc
        return tools


def _calls(content: Any, fields: _Fields, at: str) -> list[dict[str, Any]]:
    """A ``function_call`` turn's value (JSON text or data: ``{name, arguments}`` or a list of
    them) as OpenAI ``tool_calls``."""
    value = content
    if isinstance(content, str):
        try:
            value = json.loads(content)
        except json.JSONDecodeError as exc:
            raise DataError(f"{fields.where}: {at} is a function call but not JSON: {exc}") from exc
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, Mapping) and "name" in c for c in calls):
        raise DataError(
            f"{fields.where}: {at} is a function call but not {{name, arguments}} or a list of them"
        )
    return [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
        for c in calls
    ]


class AlpacaFormat(RecordFormat):
    """Alpaca: the user turn is ``instruction``, then ``"\\n"`` and ``input`` when ``input`` is
    non-empty (LLaMA-Factory's alpaca converter joins them so; Axolotl's chat-style
    AlpacaPrompter puts one newline between them too), after the optional ``system`` and the
    ``history`` pairs ``[[instruction, response], ...]``; ``output`` is the assistant's
    answer (``chosen``/``rejected`` for preference, with ``label`` for unpaired)."""

    name = "alpaca"

    def map(self, record: Any, where: str) -> Any:
        fields = _Fields(record, where, self.columns, self.label)
        prompt = self._prompt(fields)
        out = dict(record)
        if self.kind == "sft":
            out["messages"] = [*prompt, self._answer(fields, "output")]
        elif self.kind == "preference":
            out["prompt"] = prompt
            out["chosen"] = [self._answer(fields, "chosen")]
            out["rejected"] = [self._answer(fields, "rejected")]
        elif self.kind == "prompt":
            out["prompt"] = prompt
        else:
            out["prompt"], out["completion"] = prompt, [self._answer(fields, "output")]
            out["label"] = fields.get("label")
        return out

    def _prompt(self, fields: _Fields) -> list[dict[str, Any]]:
        instruction = self._text(fields, "instruction", fields.get("instruction"))
        query = self._text(fields, "input", fields.optional("input") or "")
        messages = []
        system = fields.optional("system")
        if system:
            messages.append({"role": "system", "content": self._text(fields, "system", system)})
        history = fields.optional("history") or []
        if not isinstance(history, list) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and all(isinstance(s, str) for s in p)
            for p in history
        ):
            raise fields.error("history", "must be a list of [instruction, response] pairs")
        for user, assistant in history:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        content = f"{instruction}\n{query}" if query else instruction
        return [*messages, {"role": "user", "content": content}]

    def _answer(self, fields: _Fields, field: str) -> dict[str, Any]:
        return {"role": "assistant", "content": self._text(fields, field, fields.get(field))}

    @staticmethod
    def _text(fields: _Fields, field: str, value: Any) -> str:
        if not isinstance(value, str):
            raise fields.error(field, f"must be a string, got {type(value).__name__}")
        return value


_CLASSES: dict[str, type[RecordFormat]] = {
    "sharegpt": ShareGPTFormat,
    "trl": TRLFormat,
    "alpaca": AlpacaFormat,
}


def record_format(name: str | None, columns: Mapping[str, str] | None, kind: str) -> RecordFormat:
    """The mapping of ``format: name`` with ``columns:`` renames for ``kind``; ``None`` is
    ``openai`` (astrai's own schema). Refuses an unknown name, a format that has no meaning
    for ``kind``, and a ``columns:`` key the format does not read (naming the known ones)."""
    name = name or "openai"
    if name not in FORMATS:
        raise DataError(f"format must be one of {FORMATS} (or null), got {name!r}")
    columns = dict(columns or {})
    if kind == "pretrain":
        if name not in ("openai", "trl"):
            raise DataError(f"format={name} has chat turns; kind=pretrain reads text")
        if columns:
            raise DataError("columns: kind=pretrain reads one field; name it with text_field")
        return RecordFormat(kind)
    known = format_fields(name, kind)
    for key, value in columns.items():
        if key not in known:
            raise DataError(
                f"columns: {key!r} is not a field of format={name} for kind={kind}; "
                f"known: {', '.join(known)}"
            )
        if not isinstance(value, str) or not value:
            raise DataError(f"columns.{key}: must be a field name, got {value!r}")
    if name == "openai":
        return Renamed(kind, columns) if columns else RecordFormat(kind)
    return _CLASSES[name](kind, columns)


__all__ = [
    "FORMATS",
    "AlpacaFormat",
    "RecordFormat",
    "Renamed",
    "ShareGPTFormat",
    "TRLFormat",
    "format_fields",
    "record_format",
]
