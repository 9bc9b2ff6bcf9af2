"""Pythonic calls: ``[get_weather(city="Paris"), get_time()]`` (vLLM's ``pythonic``).

Llama 3.2 (1B/3B) and Llama 4 with their pythonic templates, ToolACE, Gemma 3 with a
pythonic template. The whole answer is one Python list of calls whose arguments are
literals (read with `ast`, never evaluated); Llama 4 may wrap it in
``<|python_start|>...<|python_end|>``. An answer that is not such a list is content. A
JSON list of ``{"name", "arguments"}`` (what a forced `tool_choice` grammar writes) is read
too.
"""

from __future__ import annotations

import ast
from typing import Any, ClassVar

from astrai.serve.tool_parsers.base import Parsed, ToolParser, json_calls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CONSTANTS = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers: ClassVar[tuple[str, ...]] = ("[func_name1(params_name1=", PYTHON_START)
    starts: ClassVar[tuple[str, ...]] = (PYTHON_START, "[")
    end: ClassVar[str | None] = None
    leading = True
    keep_start = True
    forced: ClassVar[tuple[str, str]] = ("[", "]")

    def parse(self, body: str) -> Parsed | None:
        text = body.strip()
        if text.startswith(PYTHON_START):
            text = text[len(PYTHON_START) :].strip()
            text = text[: -len(PYTHON_END)] if text.endswith(PYTHON_END) else text
        try:
            return json_calls(text)
        except ValueError:
            pass
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls: Parsed = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
                return None
            args = {}
            for kw in node.keywords:
                if kw.arg is None:  # **kwargs
                    return None
                args[kw.arg] = _literal(kw.value)
            calls.append((node.func.id, args))
        return calls


def _literal(node: ast.expr) -> Any:
    """A literal argument; `true`/`false`/`null` are read as JSON's (models write them)."""
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)
