"""`Calculator`: arithmetic questions with a ``calc`` tool the model may call.

The records are the built-in arithmetic prompts (``prompt`` like "What is 23 + 45 * 2?",
``answer`` a string). The model calls the tool as the default chat template renders it,
``<tool_call>\\n{"name": "calc", "arguments": {"expr": "23 + 45"}}\\n</tool_call>``; each call
is answered by one ``{"role": "tool", "content": "68"}`` message (or ``"error: ..."``). A turn
without a tool call ends the episode: it is the answer. Every step's reward is 0.0: GRPO's
reward functions score the final answer text (`Episode.final_text`), so the tool is only a
means, never rewarded in itself.

Expressions are evaluated by walking their `ast` (integers, ``+ - * / //``, parentheses,
unary signs), exactly in rationals, with limits on length, size and values: no Python code
is ever run.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from astrai.serve.tool_parsers import ToolParserChoice
from astrai.train.environments.base import Environment, StepResult

__all__ = ["CALC_TOOL", "CalcError", "Calculator", "evaluate", "format_value"]

MAX_EXPR_CHARS = 200
MAX_NODES = 100
MAX_VALUE = 10**18  # every literal and intermediate value, in absolute value

CALC_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression of integers (+ - * / // and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string", "description": "e.g. 23 + 45 * 2"}},
            "required": ["expr"],
        },
    },
}

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression, or `CalcError` saying why not."""
    if not isinstance(expr, str):
        raise CalcError(f"expr must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:  # bools, floats, strings: refused
            raise CalcError(f"only integers are allowed, got {node.value!r}")
        return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv) and right == 0:
            raise CalcError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalcError(f"unsupported syntax: {type(node).__name__}")


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_VALUE:
        raise CalcError(f"value too large (limit {MAX_VALUE:.0e})")
    return value


def format_value(value: Fraction) -> str:
    """An integer as its digits; a fraction as a decimal of at most 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


class Calculator(Environment):
    """Arithmetic with a ``calc`` tool; the episode ends at the first turn without a call.

    Args:
        announce_tools: render the ``calc`` schema into the prompt (`tools`); False keeps
            prompts short for models that learned the tool from their SFT data.
        max_calls: tool calls allowed per episode (None: no limit); a turn that would
            exceed it ends the episode unanswered (its final text is then that turn).
        tool_parser: how the model's calls are read (`Environment`; ``auto``: as the
            server reads the chat template's format).
    """

    def __init__(
        self,
        *,
        announce_tools: bool = True,
        max_calls: int | None = None,
        tool_parser: str | ToolParserChoice = "auto",
    ) -> None:
        super().__init__(tool_parser=tool_parser)
        if not isinstance(announce_tools, bool):
            raise ValueError(f"Calculator announce_tools must be a bool, got {announce_tools!r}")
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0
        ):
            raise ValueError(f"Calculator max_calls must be None or an int >= 0, got {max_calls!r}")
        self.tools = [CALC_TOOL] if announce_tools else None
        self.max_calls = max_calls
        self.calls = 0

    def reset(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        prompt = record.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"Calculator: a record needs a non-empty string field 'prompt', got {prompt!r}"
            )
        self.calls = 0
        return [{"role": "user", "content": prompt}]

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        calls = messages[-1].get("tool_calls") or []
        if not calls:
            return StepResult(None, 0.0, True)
        self.calls += len(calls)
        if self.max_calls is not None and self.calls > self.max_calls:
            return StepResult(None, 0.0, True)
        return StepResult([_answer(call) for call in calls], 0.0, False)


def _answer(call: Mapping[str, Any]) -> dict[str, str]:
    """The tool message answering one call."""
    function = call.get("function", call)
    name, args = function.get("name"), function.get("arguments")
    if name != "calc":
        content = f"error: unknown tool {name!r} (the only tool is 'calc')"
    elif not isinstance(args, Mapping) or set(args) != {"expr"}:
        content = 'error: arguments must be {"expr": "<expression>"}'
    else:
        try:
            content = format_value(evaluate(args["expr"]))
        except CalcError as err:
            content = f"error: {err}"
    return {"role": "tool", "content": content}
