"""The builder contract: what a `ResponseBuilder` gets and gives, and the wire encodings.

A builder turns its protocol's request body into a `Prepared` (prompt ids, one
`SamplingParams`, stop strings) and the handler's events (`Choice`, `RequestContext`) into
its protocol's JSON and SSE (`sse`); `astrai.serve.handler` runs the request in between.
Builders import their contract from here and `astrai.serve.request` (prompt, settings),
never from the run loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from astrai.serve.errors import APIError
from astrai.serve.settings import ServeSettings
from astrai.serve.tool_parsers import Event, OutputParser, ToolCall

if TYPE_CHECKING:
    from astrai.inference import GenerateResult, SamplingParams
    from astrai.tokenizer import AutoTokenizer

# Internal finish reasons (stop, stop_sequence, length, tool_calls, error); the builders map
# them to their protocol's names.


@dataclass
class Prepared:
    """A request reduced to what the engine and the parsers need.

    `prompts` holds one token list per prompt (chat: one; legacy completions: a batch);
    each is sampled `samples` times (`n`, or `best_of` with the `n` best kept), choice
    `index = prompt_index * samples + j` (a seed then grows by the choice's index).
    `params` is the request's one `SamplingParams`, its protocol's defaults applied
    (`astrai.serve.request`), submitted as it is. `prompt_param` is the request field an
    error about a prompt names; `options` is the builder's own (echo...).
    `max_tokens_param` is the field that set `max_tokens` explicitly (`max_tokens`,
    `max_completion_tokens`), the one a context-length refusal names; None: the
    protocol's default, which is capped to what fits after the prompt.
    """

    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stops: list[str] = field(default_factory=list)
    parse_tools: bool = False
    tool_defs: list[dict[str, Any]] | None = None  # the rendered tools' `function`s
    stream: bool = False
    include_usage: bool = False
    model: str = "astrai"
    prompt_param: str = "messages"
    max_tokens_param: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    reasoning: Any = None  # astrai.serve.reasoning.Reasoning: split the thinking off
    best_of: int | None = None  # > n: sample this many, answer the n best (`best_of.py`)

    @property
    def samples(self) -> int:
        """Sequences sampled per prompt: `best_of` when it is set, else `n`."""
        return self.best_of or self.n


@dataclass
class Choice:
    """Output of one engine task, as seen by the client.

    Token bookkeeping for log-probs: every text piece from the engine arrives with the
    number of output tokens it completes (`marks`: raw characters so far -> tokens so far),
    so a builder hands out the entries of the tokens whose text it has emitted (`chars`)
    and no others: text held back (a possible stop string) holds its tokens back too.
    `token_end` is where the reported tokens end: at the piece a stop string matched in, or
    at the last output token once the task is done. `tokens_sent` is the builder's cursor.
    """

    index: int
    result: GenerateResult
    parser: OutputParser
    prompt_index: int = 0
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # the thinking (reasoning parser)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None
    error: str | None = None
    chars: int = 0  # length of `content` (and of `reasoning`) emitted
    marks: list[tuple[int, int]] = field(default_factory=list)
    token_end: int | None = None
    tokens_sent: int = 0
    taken: int = 0  # text pieces of `result` read so far (`GenerateResult.take`)
    ended: bool = False  # its end has been read
    _mark: int = 0  # marks before this one are covered by the text emitted so far
    _covered: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_content(self) -> str:
        return "".join(self.reasoning)

    @property
    def output_tokens(self) -> int:
        return len(self.result.task.output_ids)

    def received(self, text: str, tokens: int) -> None:
        """Record a raw text piece that completes the first `tokens` output tokens."""
        chars = self.marks[-1][0] + len(text) if self.marks else len(text)
        self.marks.append((chars, tokens))

    def tokens_emitted(self) -> int:
        """How many output tokens the text emitted so far fully covers (never decreases)."""
        while self._mark < len(self.marks) and self.marks[self._mark][0] <= self.chars:
            self._covered = self.marks[self._mark][1]
            self._mark += 1
        end = self.token_end
        return self._covered if end is None else min(self._covered, end)

    def take_tokens(self, upto: int | None = None) -> range:
        """Output positions not yet handed out, through `upto` (default: `token_end`)."""
        end = self.token_end if upto is None else upto
        end = max(self.tokens_sent, end if end is not None else self.tokens_sent)
        out = range(self.tokens_sent, end)
        self.tokens_sent = end
        return out


@dataclass(eq=False)
class RequestContext:
    """One HTTP request in flight; builders keep their own stream state in `extra`."""

    id: str
    prepared: Prepared
    t0: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    extra: dict[str, Any] = field(default_factory=dict)
    # OpenAI's `system_fingerprint`: the weights' identity at submission (None: omitted).
    system_fingerprint: str | None = None

    @property
    def model(self) -> str:
        return self.prepared.model

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.output_tokens for c in self.choices)

    @property
    def all_finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)


class ResponseBuilder(ABC):
    """Formats one protocol: request -> `Prepared`, events -> SSE strings / JSON."""

    id_prefix: str = "req_"
    tool_id_prefix: str = "call_"
    # Request fields whose text is the prompt (the character limit); absent ones are skipped.
    prompt_fields: tuple[str, ...] = ("system", "messages", "prompt", "suffix")

    @abstractmethod
    def prepare(self, body: Any, tokenizer: AutoTokenizer, settings: ServeSettings) -> Prepared:
        """Validate beyond the schema and render the prompt; raise `APIError` (400)."""

    @abstractmethod
    def error_body(self, err: APIError) -> dict[str, Any]: ...

    @abstractmethod
    def format_stream_start(self, ctx: RequestContext) -> list[str]: ...

    @abstractmethod
    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]: ...

    @abstractmethod
    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]: ...

    @abstractmethod
    def format_stream_end(self, ctx: RequestContext) -> list[str]: ...

    @abstractmethod
    def format_stream_error(self, ctx: RequestContext, err: APIError) -> list[str]: ...

    @abstractmethod
    def format_response(self, ctx: RequestContext) -> dict[str, Any]: ...


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that always encodes: a lone surrogate becomes '?' instead of a 500."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "replace")


def sse(data: Any, event: str | None = None) -> str:
    """One SSE event; every event ends with a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    if event is None:
        return f"data: {payload}\n\n"
    return f"event: {event}\ndata: {payload}\n\n"
