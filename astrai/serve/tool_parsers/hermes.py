"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Any number of calls, each in its own tags, with content before them (vLLM's ``hermes``).
"""

from __future__ import annotations

from typing import ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser, json_calls


class HermesToolParser(ToolParser):
    name = "hermes"
    markers: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    starts: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    end: ClassVar[str | None] = "</tool_call>"
    forced: ClassVar[tuple[str, str]] = ("<tool_call>", "</tool_call>")

    def parse(self, body: str) -> Parsed | None:
        calls = json_calls(body.strip())
        return calls if calls is not None and len(calls) == 1 else None


def tagged_parser(start: str, end: str) -> type[HermesToolParser]:
    """A hermes parser with other tags (`tool_call_format: "START|END"`)."""
    return type(
        "TaggedToolParser",
        (HermesToolParser,),
        {"name": f"{start}|{end}", "starts": (start,), "end": end, "forced": (start, end)},
    )
