"""GPT-OSS's harmony output format: the reasoning, the answer and the tool calls of one output
(vLLM's ``openai_gptoss`` reasoning parser and ``openai`` tool-call parser).

A harmony output is a list of messages, each a header, ``<|message|>``, then its text up to
``<|end|>`` (more messages follow), ``<|return|>`` (the answer is done) or ``<|call|>``
(a tool call waits for its result)::

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The prompt ends with ``<|start|>assistant``, so the first header has no ``<|start|>``. The
header names the channel (``analysis``: the reasoning; ``final``: the answer; ``commentary``:
tool calls and the user-visible preambles before them) and, for a tool call, the recipient
``to=functions.NAME`` (in the channel part, or in the role part before ``<|channel|>``).
Text before any header (an output a structured-output grammar wrote) is answer.

The markers are special tokens, so such requests are decoded with
``skip_special_tokens=False`` (`sampling_fields`, which also stops at ``<|call|>``) and
`HarmonySplitter` takes them out: analysis text is reasoning, final and preamble text is
content, and each call is handed on to the tool-call parser in the one spelling every astrai
parser's forced calls share, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the
``openai`` tool parser reads it; docs/serving.md).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from astrai.serve.tool_parsers.events import held_suffix

if TYPE_CHECKING:
    from astrai.tokenizer import AutoTokenizer

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
#: gpt-oss's third stop token (its text is kept with the markers: it ends a message too)
ENDOFTEXT = "<|endoftext|>"
#: what ends a message's text (a ``<|start|>`` without an ``<|end|>`` opens the next one)
TERMINATORS = (END, RETURN, CALL, START, ENDOFTEXT)
#: the reasoning's opening and closing tags (the thinking budget forces the closing one)
OPEN, CLOSE = CHANNEL + "analysis" + MESSAGE, END
#: a chat template with this marker writes harmony (`reasoning_parser=auto`)
TEMPLATE_MARKER = CHANNEL

# A header longer than this with no <|message|> is not a header: its text is content.
_MAX_HEADER = 256


def sampling_fields(tokenizer: AutoTokenizer) -> dict[str, Any]:
    """What a harmony request's `SamplingParams` need: the markers kept in the text, and
    `<|return|>` and `<|call|>` among the stop tokens (a call waits for its result; gpt-oss's
    first generation_config.json names only `<|return|>` and `<|endoftext|>`), as vLLM adds
    them for its harmony models."""
    stops = set(tokenizer.stop_ids)
    stops.update(i for t in (RETURN, CALL) if (i := tokenizer.token_to_id(t)) is not None)
    return {"skip_special_tokens": False, "stop_ids": frozenset(stops)}


def read_header(header: str) -> tuple[str, str]:
    """(channel, recipient) of a message header ("" where it names none)."""
    channel = ""
    if CHANNEL in header:
        channel = _word(header.split(CHANNEL, 1)[1])
    recipient = _word(header.split("to=", 1)[1]) if "to=" in header else ""
    return channel, recipient


def _word(text: str) -> str:
    """The leading word of `text` (up to whitespace or the next marker)."""
    word = text.lstrip().split("<|", 1)[0]
    return word.split(None, 1)[0] if word.strip() else ""


def tool_call_text(recipient: str, arguments: str) -> str:
    """A call to `recipient` (``functions.NAME``) in the spelling the tool parser reads;
    arguments that are not JSON stay a string (the parser then gives the call back as text)."""
    name = recipient.removeprefix("functions.")
    args: Any
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class HarmonySplitter:
    """Splits a harmony output into reasoning and content, incrementally (the interface of
    `astrai.serve.reasoning.ReasoningSplitter`).

    `feed` returns ``(is_reasoning, text)`` pieces; a possible marker's start is held back
    until decided, a tool call until its message ends. `end_at`: raw characters through
    the last analysis message's end (None while none ended); `reasoned`: an analysis
    message came.
    """

    def __init__(self) -> None:
        self._state = "head"  # head -> header -> body -> between -> header ...
        self._buf = ""
        self._kind = "content"  # the open message's: reasoning | content | tool
        self._recipient = ""
        self._call = ""  # the open tool call's text so far
        self._raw = 0
        self.end_at: int | None = None
        self.reasoned = False

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._raw += len(text)
        self._buf += text
        out: list[tuple[bool, str]] = []
        while self._step(out):
            pass
        return out

    def flush(self) -> list[tuple[bool, str]]:
        """End of output: an open message's text is its kind's, an open call is handed on."""
        out: list[tuple[bool, str]] = []
        buf, self._buf = self._buf, ""
        if self._state == "head" or (self._state == "header" and len(buf) > _MAX_HEADER):
            self._put(out, False, buf)
        elif self._state == "body":
            self._emit(out, buf)
            self._close(out)
        self._state = "between"
        return out

    # ------------------------------------------------------------------ states
    def _step(self, out: list[tuple[bool, str]]) -> bool:
        """One move of the state machine; False when it needs more text."""
        buf = self._buf
        if self._state in ("head", "between"):
            s = buf.lstrip()
            for opener in (START, CHANNEL, "to="):
                if s.startswith(opener):
                    self._buf = s[len(START) :] if opener == START else s
                    self._state = "header"
                    return True
            if not s or any(o.startswith(s) for o in (START, CHANNEL, "to=")):
                return False  # nothing yet, or the start of a header: wait
            self._open("content", "")  # text outside any header: the answer
            return True
        if self._state == "header":
            i = buf.find(MESSAGE)
            if i < 0:
                if len(buf) > _MAX_HEADER:  # no header after all
                    self._open("content", "")
                    return True
                return False
            channel, recipient = read_header(buf[:i])
            self._buf = buf[i + len(MESSAGE) :]
            if recipient:
                self._open("tool", recipient)
            elif channel == "analysis":
                self.reasoned = True
                self._open("reasoning", "")
            else:  # final, a commentary preamble, or no channel
                self._open("content", "")
            return True
        # body
        hit = min(((i, t) for t in TERMINATORS if (i := buf.find(t)) >= 0), default=None)
        if hit is None:
            k = held_suffix(buf, TERMINATORS)
            self._emit(out, buf[: len(buf) - k])
            self._buf = buf[len(buf) - k :]
            return False
        i, term = hit
        self._emit(out, buf[:i])
        self._buf = buf[i + len(term) :]
        if self._kind == "reasoning":
            self.end_at = self._raw - len(self._buf)
        self._close(out)
        self._state = "header" if term == START else "between"
        return True

    def _open(self, kind: str, recipient: str) -> None:
        self._state, self._kind, self._recipient, self._call = "body", kind, recipient, ""

    def _emit(self, out: list[tuple[bool, str]], text: str) -> None:
        if self._kind == "tool":
            self._call += text
        else:
            self._put(out, self._kind == "reasoning", text)

    def _close(self, out: list[tuple[bool, str]]) -> None:
        if self._kind == "tool":
            self._put(out, False, tool_call_text(self._recipient, self._call))
        self._kind, self._call = "content", ""

    @staticmethod
    def _put(out: list[tuple[bool, str]], reasoning: bool, text: str) -> None:
        if text:
            out.append((reasoning, text))


def split(text: str) -> tuple[str, str]:
    """A whole output's (reasoning, content), its calls in the tool parser's spelling."""
    sp = HarmonySplitter()
    pieces = sp.feed(text) + sp.flush()
    return "".join(t for r, t in pieces if r), "".join(t for r, t in pieces if not r)


def reasoning_grammar(special_id: Any) -> tuple[str, str]:
    """Lark rules for a structured output under harmony: (the start rule's body before the
    answer, the rules it uses). The answer may follow an analysis message and the final
    channel's header, the final header alone, or nothing; `special_id(marker)`: the id of a
    special token (None: the marker is plain text)."""

    def tag(marker: str) -> str:
        tid = special_id(marker)
        return f"<[{tid}]>" if tid is not None else json.dumps(marker)

    final = f'{tag(CHANNEL)} "final" {tag(MESSAGE)}'
    rules = (
        f'analysis_: {tag(CHANNEL)} "analysis" {tag(MESSAGE)} /(?s:.*)/ {tag(END)} '
        f'{tag(START)} "assistant"\n'
        f"final_: {final}\n"
    )
    return "(analysis_ final_ | final_)?", rules
