"""The shared machinery of the tool-call parsers: `ToolParser`.

A parser is stateful, one per choice. It is fed the text deltas that are left after stop
strings (and the reasoning parser) and returns protocol-neutral events: `TextDelta` for
content and one `ToolCall` per complete call. A format is described by where a call span
starts (`starts`), where it ends (`end`; None: at the end of the output) and how a span's
body becomes calls (`parse`). A call is emitted only once its span is complete, parsed,
names one of the request's tools and has a JSON object as arguments; anything else is given
back as the text it was, so a model's malformed call is content, never a server error.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from astrai.serve.tool_parsers.events import Event, TextDelta, ToolCall, emit_text, held_suffix

Parsed = list[tuple[str, Any]]  # (name, arguments) pairs; arguments checked later


class ToolParser(ABC):
    """Cuts tool-call spans out of a stream of text deltas (subclass per format).

    Class attributes: `name` (the `tool_parser=` value), `markers` (substrings of a chat
    template that select this parser for `tool_parser=auto`), `starts` / `end` (the span),
    `leading` (a span only counts at the start of the output, as for formats that have no
    opening tag of their own), `keep_start` (the start marker belongs to the body, e.g. the
    `[` of a pythonic list), `forced` (the `(start, end)` tags around the JSON call
    `{"name": ..., "arguments": {...}}` that a forced `tool_choice` grammar writes; the
    parser reads that spelling too).
    """

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    starts: ClassVar[tuple[str, ...]] = ()
    end: ClassVar[str | None] = None
    leading: ClassVar[bool] = False
    keep_start: ClassVar[bool] = False
    forced: ClassVar[tuple[str, str]] = ("<tool_call>", "</tool_call>")

    def __init__(
        self, tools: Sequence[Mapping[str, Any]] | None = None, id_prefix: str = "call_"
    ) -> None:
        # tools: `{"name", "parameters"}` dicts (OpenAI `function`s); None: any name passes
        self.tools = {t["name"]: t for t in tools or ()} if tools is not None else None
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._start = ""  # the marker of the open span ("" while outside one)
        self._decided = not self.leading  # leading formats: has the output's start been seen?
        self._ws = ""  # trailing whitespace held back: before a call it is not content

    # ------------------------------------------------------------------ the format
    @abstractmethod
    def parse(self, body: str) -> Parsed | None:
        """A span's body (between its start and end) -> calls, or None if it is no call."""

    def parse_unclosed(self, body: str) -> Parsed | None:
        """The body of a span the output ended inside (its `end` never came): its calls,
        or None (the default: the span is text)."""
        return None

    def parameters(self, name: str) -> Mapping[str, Any]:
        """The JSON schema of tool `name`'s parameters (`{}` if unknown)."""
        tool = (self.tools or {}).get(name) or {}
        return tool.get("parameters") or {}

    # ------------------------------------------------------------------ the stream
    def feed(self, text: str) -> list[Event]:
        """Events that `text` (the next delta) completes."""
        self._buf += text
        out: list[Event] = []
        while True:
            if self._start:
                if self.end is None:  # the span runs to the end of the output
                    return out
                i = self._buf.find(self.end)
                if i < 0:
                    return out
                body, self._buf = self._buf[:i], self._buf[i + len(self.end) :]
                self._close(body, self.end, out)
                continue
            if not self._decided:
                if not self._decide(out):
                    return out
                continue
            if self.leading:  # decided: no call at the start, the rest is text
                self._text(self._buf, out)
                self._buf = ""
                return out
            hit = min(((i, s) for s in self.starts if (i := self._buf.find(s)) >= 0), default=None)
            if hit is not None:
                i, s = hit
                self._text(self._buf[:i], out)
                self._open(s, i)
                continue
            k = held_suffix(self._buf, self.starts)
            ready, self._buf = self._buf[: len(self._buf) - k], self._buf[len(self._buf) - k :]
            self._text(ready, out)
            return out

    def flush(self) -> list[Event]:
        """End of the output: an open span is parsed now if it needs no end, else text."""
        out: list[Event] = []
        if self._start:
            body, self._buf = self._buf, ""
            self._close(body, "", out, self.parse if self.end is None else self.parse_unclosed)
        rest = ("" if self.keep_start else self._start) + self._buf
        self._buf, self._start = "", ""
        self._text(rest, out)
        if self._ws and not self.calls:
            out.append(TextDelta(self._ws))
        self._ws = ""
        return out

    # ------------------------------------------------------------------ helpers
    def _decide(self, out: list[Event]) -> bool:
        """Leading formats: does the output open with a call? False: wait for more text."""
        head = self._buf.lstrip()
        if not head:
            return False
        for s in self.starts:
            if head.startswith(s):
                self._decided = True
                self._ws, lead = "", self._buf[: len(self._buf) - len(head)]
                self._text(lead, out)
                self._open(s, len(self._buf) - len(head))
                return True
        if any(s.startswith(head) for s in self.starts):
            return False
        self._decided = True
        return True

    def _open(self, start: str, i: int) -> None:
        self._start = start
        self._buf = self._buf[i:] if self.keep_start else self._buf[i + len(start) :]

    def _close(
        self,
        body: str,
        end: str,
        out: list[Event],
        parse: Callable[[str], Parsed | None] | None = None,
    ) -> None:
        start, self._start = self._start, ""
        calls = self._calls(body, parse or self.parse)
        if calls is None:
            self._text(("" if self.keep_start else start) + body + end, out)
            return
        self._ws = ""
        self.calls += calls
        out += calls

    def _calls(self, body: str, parse: Callable[[str], Parsed | None]) -> list[ToolCall] | None:
        """The span's calls if all of them are valid (a known name, object arguments)."""
        try:
            parsed = parse(body)
        except (ValueError, TypeError, RecursionError, MemoryError, SyntaxError):
            parsed = None
        if not parsed:
            return None
        calls = []
        for name, args in parsed:
            if not isinstance(name, str) or not name:
                return None
            if self.tools is not None and name not in self.tools:
                return None
            if args is None:
                args = {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            index = len(self.calls) + len(calls)
            call_id = self.id_prefix + secrets.token_hex(12)
            calls.append(ToolCall(index, call_id, name, json.dumps(args, ensure_ascii=False)))
        return calls

    def _text(self, text: str, out: list[Event]) -> None:
        self._ws = emit_text(self._ws, text, out)


def json_call(obj: Any) -> tuple[str, Any] | None:
    """`{"name": ..., "arguments" | "parameters": ...}` -> (name, arguments), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


def json_calls(text: str) -> Parsed | None:
    """One JSON call object, or a JSON list of them (None if `text` is neither)."""
    obj = json.loads(text)
    items = obj if isinstance(obj, list) else [obj]
    calls = [json_call(o) for o in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def argument_fragments(arguments: str) -> list[str]:
    """`arguments` (JSON) cut after each `:` and `,` outside strings: the pieces a stream
    sends as argument deltas, the way OpenAI streams a call (they concatenate back)."""
    pieces, start, in_string, escaped = [], 0, False, False
    for i, ch in enumerate(arguments):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in ",:":
            end = i + 2 if arguments[i + 1 : i + 2] == " " else i + 1
            pieces.append(arguments[start:end])
            start = end
    if start < len(arguments) or not pieces:
        pieces.append(arguments[start:])
    return [p for p in pieces if p] or [arguments]
