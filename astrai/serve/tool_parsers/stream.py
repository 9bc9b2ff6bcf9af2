"""One choice's output parser: stop strings first (they apply to the raw text), then the
tool-call parser of the server's `tool_parser` choice.

`StopMatcher` holds back text that might be the start of a stop string, so a stop string is
never half-emitted; the tool parser (`ToolParser`, base.py) cuts complete calls out of what
is left. Both are incremental: any split of the output into deltas gives the same events.
"""

from __future__ import annotations

from collections.abc import Sequence

from astrai.serve.tool_parsers.base import ToolParser
from astrai.serve.tool_parsers.events import Event, TextDelta, ToolCall, held_suffix

__all__ = ["OutputParser", "StopMatcher"]


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


class OutputParser:
    """Stop strings first (they apply to the raw text), then tool calls (`tools`: one
    request's parser, `ToolParserChoice.new`; None: the text is all content)."""

    def __init__(self, stops: Sequence[str] = (), tools: ToolParser | None = None) -> None:
        self.stop = StopMatcher(stops)
        self.tools = tools

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
