"""Post-processing of generated text: stop strings and tool calls, both incremental.

The engine hands us text deltas. Two stateful filters turn them into protocol-neutral
events: :class:`StopMatcher` holds back text that might be the start of a stop string
(so a stop string is never half-emitted), and :class:`ToolCallParser` cuts
``<tool_call>{...}</tool_call>`` spans out of the text and turns them into
:class:`ToolCall` events. A call is emitted only once its closing tag has arrived and
its JSON parsed, which is what guarantees that ``arguments`` is always valid JSON; a span
that does not parse is given back as ordinary text.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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


class StopMatcher:
    """Finds the first occurrence of any stop string in a stream of text deltas."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Return the text that is now safe to emit; sets `matched` on a stop string."""
        if self.matched is not None:
            return ""
        buf = self._buf + text
        if not self.stops:
            self._buf = ""
            return buf
        hit: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (hit is None or (i, -len(s)) < (hit[0], -hit[1])):
                hit = (i, len(s), s)
        if hit is not None:
            self.matched = hit[2]
            self._buf = ""
            return buf[: hit[0]]
        k = held_suffix(buf, self.stops)
        self._buf = buf[len(buf) - k :] if k else ""
        return buf[: len(buf) - k]

    def flush(self) -> str:
        """End of generation: text held back was not a stop string after all."""
        out, self._buf = self._buf, ""
        return "" if self.matched is not None else out


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model wraps a tool call: ``start{"name": ..., "arguments": {...}}end``."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("<tool_call>", "</tool_call>"),  # Hermes, Qwen2.5, our template
}


def tool_call_format(spec: str | ToolCallFormat | None) -> ToolCallFormat | None:
    """Resolve a configured format: a name in TOOL_CALL_FORMATS, ``"start|end"``, or none."""
    if spec is None or isinstance(spec, ToolCallFormat):
        return spec
    if spec in ("", "none", "off"):
        return None
    if spec in TOOL_CALL_FORMATS:
        return TOOL_CALL_FORMATS[spec]
    start, sep, end = spec.partition("|")
    if not sep or not start or not end:
        raise ValueError(
            f"tool call format {spec!r}: expected one of {sorted(TOOL_CALL_FORMATS)}, "
            "'none', or 'START|END' tags"
        )
    return ToolCallFormat(start, end)


def parse_tool_call(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` -> (name, arguments JSON), or None if invalid."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def emit_text(held: str, text: str, out: list[Event]) -> str:
    """Append ``held + text`` to ``out`` as a `TextDelta`, all but its trailing whitespace,
    which is returned to be held back (between two tool calls it is not content)."""
    text = held + text
    stripped = text.rstrip()
    if stripped:
        out.append(TextDelta(stripped))
    return text[len(stripped) :]


@dataclass
class ToolCallParser:
    """Splits text deltas into plain text and complete tool calls."""

    fmt: ToolCallFormat
    id_prefix: str = "call_"
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _inside: bool = False
    _ws: str = ""  # trailing whitespace held back: between two calls it is not content

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._inside:
                i = self._buf.find(self.fmt.end)
                if i < 0:
                    return out
                body, self._buf = self._buf[:i], self._buf[i + len(self.fmt.end) :]
                self._inside = False
                parsed = parse_tool_call(body.strip())
                if parsed is None:
                    self._text(self.fmt.start + body + self.fmt.end, out)
                else:
                    self._ws = ""
                    call = ToolCall(
                        len(self.calls), self.id_prefix + secrets.token_hex(12), *parsed
                    )
                    self.calls.append(call)
                    out.append(call)
                continue
            i = self._buf.find(self.fmt.start)
            if i >= 0:
                self._text(self._buf[:i], out)
                self._buf = self._buf[i + len(self.fmt.start) :]
                self._inside = True
                continue
            k = held_suffix(self._buf, [self.fmt.start])
            ready, self._buf = self._buf[: len(self._buf) - k], self._buf[len(self._buf) - k :]
            self._text(ready, out)
            return out

    def _text(self, text: str, out: list[Event]) -> None:
        self._ws = emit_text(self._ws, text, out)

    def flush(self) -> list[Event]:
        """End of generation: an unclosed call is returned as text."""
        out: list[Event] = []
        rest = (self.fmt.start if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(TextDelta(self._ws))
        self._ws = ""
        return out


class OutputParser:
    """Stop strings first (they apply to the raw text), then tool calls."""

    def __init__(
        self,
        stops: Sequence[str] = (),
        tool_format: ToolCallFormat | None = None,
        id_prefix: str = "call_",
        tool_parser: Any = None,
    ) -> None:
        """`tool_parser`: a ready parser with `feed`/`flush`/`calls` (one of
        `astrai.serve.tool_parsers`); it takes the place of `tool_format`'s."""
        self.stop = StopMatcher(stops)
        self.tools = tool_parser or (
            ToolCallParser(tool_format, id_prefix) if tool_format else None
        )

    @property
    def matched_stop(self) -> str | None:
        return self.stop.matched

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    def feed(self, text: str) -> list[Event]:
        return self._post(self.stop.feed(text))

    def flush(self) -> list[Event]:
        events = self._post(self.stop.flush())
        if self.tools is not None:
            events += self.tools.flush()
        return events

    def _post(self, text: str) -> list[Event]:
        if self.tools is None:
            return [TextDelta(text)] if text else []
        return self.tools.feed(text) if text else []
