"""What the output parsers emit, and the two text helpers every incremental parser uses.

The engine hands the server text deltas; the stop matcher, the reasoning parser and the
tool-call parsers turn them into protocol-neutral events, `TextDelta` for content and one
`ToolCall` per complete call, which the protocol builders format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "TextDelta", "ToolCall", "emit_text", "held_suffix"]


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call; ``arguments`` is a JSON object serialized as a string."""

    index: int
    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


Event = TextDelta | ToolCall


def held_suffix(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some pattern."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:k]):
                best = k
                break
    return best


def emit_text(held: str, text: str, out: list[Event]) -> str:
    """Append ``held + text`` to ``out`` as a `TextDelta`, all but its trailing whitespace,
    which is returned to be held back (between two tool calls it is not content)."""
    text = held + text
    stripped = text.rstrip()
    if stripped:
        out.append(TextDelta(stripped))
    return text[len(stripped) :]
