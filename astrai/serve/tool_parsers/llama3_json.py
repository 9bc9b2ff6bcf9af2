"""Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's ``llama3_json``).

The whole answer is the call: ``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``; several calls are separated by ``;``. An answer that does not open
with either is content.
"""

from __future__ import annotations

import json
from typing import ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser, json_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "Environment: ipython")
    starts: ClassVar[tuple[str, ...]] = (PYTHON_TAG, "{")
    end: ClassVar[str | None] = None
    leading = True
    keep_start = True
    forced: ClassVar[tuple[str, str]] = (PYTHON_TAG, ";")

    def parse(self, body: str) -> Parsed | None:
        text = body.strip()
        text = text[len(PYTHON_TAG) :] if text.startswith(PYTHON_TAG) else text
        decoder = json.JSONDecoder()
        calls: Parsed = []
        i = 0
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                return calls or None
            obj, i = decoder.raw_decode(text, i)
            call = json_call(obj)
            if call is None:
                return None
            calls.append(call)
