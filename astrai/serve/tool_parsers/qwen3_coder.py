"""Qwen3-Coder: XML-style calls (vLLM's ``qwen3_coder``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it is converted by the type its tool's schema declares
(integer, number, boolean, object/array as JSON, null), strings stay as written, and so
does the value of a parameter the tool does not declare (``null`` is None), as the
Qwen3-Coder reference parser reads them. A complete call (through ``</function>``) that
the output ends without ``</tool_call>`` is a call too, as there; a call cut off before
``</function>`` stays text. A body that is a JSON call (a forced `tool_choice` grammar
writes that) is read as hermes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser, json_calls

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers: ClassVar[tuple[str, ...]] = ("<function=", "<parameter=")
    starts: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    end: ClassVar[str | None] = "</tool_call>"
    forced: ClassVar[tuple[str, str]] = ("<tool_call>", "</tool_call>")

    def parse(self, body: str) -> Parsed | None:
        body = body.strip()
        if body.startswith("{"):
            calls = json_calls(body)
            return calls if calls is not None and len(calls) == 1 else None
        found = _FUNCTION.findall(body)
        if len(found) != 1 or body[: body.find("<function=")].strip():
            return None
        name, inner = found[0]
        props = self.parameters(name.strip()).get("properties") or {}
        args = {}
        for key, raw in _PARAM.findall(inner):
            key, value = key.strip(), _trim(raw)
            if key in props:
                args[key] = _convert(value, props[key] or {})
            else:  # undeclared: the text as written (the reference parser's reading)
                args[key] = None if value.lower() == "null" else value
        return [(name.strip(), args)]

    def parse_unclosed(self, body: str) -> Parsed | None:
        """A complete call the output ended without ``</tool_call>`` is a call."""
        return self.parse(body) if "</function>" in body else None


def _trim(raw: str) -> str:
    """The value between the tags, without the one newline on each side."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _convert(value: str, schema: Mapping[str, Any]) -> Any:
    """`value` as the type `schema` declares (as vLLM does; unconvertible: the string)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if value.lower() == "null" and ("null" in kinds or kind is None):
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(value)
            if k == "number":
                number = float(value)
                return int(number) if number.is_integer() and "." not in value else number
            if k == "boolean" and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if k in ("object", "array"):
                return json.loads(value)
        except ValueError:
            continue
    if kind is None or "string" not in kinds:
        try:  # no declared type: JSON if it is JSON
            return json.loads(value)
        except ValueError:
            return value
    return value
