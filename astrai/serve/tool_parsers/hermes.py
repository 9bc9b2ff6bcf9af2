"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Any number of calls, each in its own tags, with content before them (vLLM's ``hermes``).
A call is one JSON object with ``name`` and ``arguments``, the format's only spelling (as
vLLM reads it): ``parameters`` (llama3_json's key) or a list is no call, and stays text.
"""

from __future__ import annotations

import json
from typing import ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser


class HermesToolParser(ToolParser):
    name = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    starts: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    end: ClassVar[str | None] = "</tool_call>"
    forced: ClassVar[tuple[str, str]] = ("<tool_call>", "</tool_call>")

    def parse(self, body: str) -> Parsed | None:
        return hermes_call(body)


def hermes_call(body: str) -> Parsed | None:
    """The one call of a hermes span's body (None: not a hermes call)."""
    obj = json.loads(body.strip())
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" not in obj:
        return None
    return [(obj["name"], obj["arguments"])]


def tagged_parser(start: str, end: str) -> type[HermesToolParser]:
    """A hermes parser with other tags (`tool_parser: "START|END"`)."""
    return type(
        "TaggedToolParser",
        (HermesToolParser,),
        {"name": f"{start}|{end}", "starts": (start,), "end": end, "forced": (start, end)},
    )
