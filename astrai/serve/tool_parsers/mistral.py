"""Mistral: ``[TOOL_CALLS]`` then the calls, to the end of the output (vLLM's ``mistral``).

Two spellings: a JSON list ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
(Mistral-7B-Instruct-v0.3, Mixtral, Nemo) and, from tokenizer v11 on,
``[TOOL_CALLS]name[ARGS]{...}`` per call (Mistral Small 3.1+, Devstral, Magistral).
Content before ``[TOOL_CALLS]`` stays content.
"""

from __future__ import annotations

import json
from typing import ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser, json_calls

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    starts: ClassVar[tuple[str, ...]] = (TOOL_CALLS,)
    end: ClassVar[str | None] = None
    forced: ClassVar[tuple[str, str]] = (TOOL_CALLS + "[", "]")

    def parse(self, body: str) -> Parsed | None:
        body = body.strip()
        if body.startswith(("[", "{")):
            return json_calls(body)
        calls: Parsed = []
        for part in body.split(TOOL_CALLS):
            name, sep, args = part.partition(ARGS)
            if not sep or not name.strip():
                return None
            calls.append((name.strip(), json.loads(args)))
        return calls
