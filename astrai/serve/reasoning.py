"""Reasoning models: the thinking part of the output, split from the answer (vLLM's parsers).

`reasoning_parser` (serve option): ``qwen3``, ``deepseek_r1``, ``openai_gptoss``, ``auto``
(chosen from the chat template) or ``none``. GPT-OSS's harmony channels are
``openai_gptoss``'s (`astrai.serve.harmony`); the other two read ``<think> ... </think>``:

- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so everything the model
  writes up to ``</think>`` is reasoning (a ``<think>`` it writes itself is dropped).
- ``qwen3``: the reasoning is the text between ``<think>`` and ``</think>``; the opening
  tag is either written by the model (Qwen3 up to 2507) or left open at the end of the
  prompt (Qwen3-Thinking, Qwen3.5 templates: then it behaves as ``deepseek_r1``). An answer
  that does not start with ``<think>`` is split at its ``</think>`` as Qwen3's model card
  splits an output (a thinking model may leave the opening tag out), and is all content
  when it has none; since only its ``</think>`` or its end tells, such an answer is held
  back (not streamed) until one of them comes. With ``enable_thinking=False`` (the template
  writes an empty think block into the prompt) nothing is parsed.

A reasoning that never closes (``max_tokens`` reached, or a hostile output) is all
reasoning and the content is empty, as in vLLM's parsers; the finish reason is the
engine's (``length`` / ``max_tokens``, or ``stop``).

Order of the output filters (agreed with the tool-call parsers): the reasoning splitter
runs first on the raw text; only the text after the reasoning goes on to the
`OutputParser` (stop strings, then tool calls). So stop strings and tool calls apply to
the answer only, never inside the thinking. Whitespace between ``</think>`` and the answer
is dropped.

`ThinkingBudget` caps the reasoning (Anthropic ``thinking.budget_tokens``): once the
reasoning has used its budget, it forces the closing tag's tokens so that the model goes
on with its answer. `after_reasoning` lets a structured output or a forced tool call apply
only after the reasoning: the grammar accepts any reasoning, then the closing tag, then
the answer's grammar.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from astrai.serve import harmony
from astrai.serve.errors import APIError
from astrai.serve.harmony import HarmonySplitter
from astrai.serve.tool_parsers import Event, OutputParser, ToolCall
from astrai.serve.tool_parsers.events import held_suffix

if TYPE_CHECKING:
    import torch

    from astrai.inference.structured import StructuredOutput
    from astrai.tokenizer import AutoTokenizer

#: GPT-OSS's harmony format (vLLM's name)
HARMONY = "openai_gptoss"
REASONING_PARSERS = ("qwen3", "deepseek_r1", HARMONY)
REASONING_PARSER_CHOICES = (*REASONING_PARSERS, "auto", "none")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning (never part of the content)."""

    text: str


def check_reasoning_parser(value: object) -> str | None:
    """The configured parser (None: none); a ValueError naming `reasoning_parser`."""
    if value is None or value == "none":
        return None
    if value not in REASONING_PARSER_CHOICES:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}; got {value!r}"
        )
    return str(value)


# (id(tokenizer), its chat template) -> the parser the template implies
_AUTO: dict[tuple[int, str], str | None] = {}


def resolve_reasoning_parser(name: str | None, tokenizer: AutoTokenizer) -> str | None:
    """`name`, or for ``auto`` the parser the chat template implies: ``openai_gptoss`` when
    it writes harmony channels, ``qwen3`` when it has an `enable_thinking` switch,
    ``deepseek_r1`` when its generation prompt opens ``<think>``, else none."""
    name = check_reasoning_parser(name)
    if name != "auto":
        return name
    template = tokenizer.chat_template or ""
    key = (id(tokenizer), template)
    if key not in _AUTO:
        found: str | None = None
        if harmony.TEMPLATE_MARKER in template:
            found = HARMONY
        elif "enable_thinking" in template:
            found = "qwen3"
        elif THINK_START in template and _prompt_opens_think(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
            )
        ):
            found = "deepseek_r1"
        _AUTO[key] = found
    return _AUTO[key]


def check_harmony_parsers(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """The ``openai`` tool parser reads the calls the harmony reasoning parser cuts out of
    the raw output: a ValueError naming both settings when it would run without it
    (`reasoning_parser` as resolved; ``auto`` is checked once the template is known)."""
    if tool_parser != "openai" or reasoning_parser in (HARMONY, "auto"):
        return
    raise ValueError(
        f"tool_parser=openai (GPT-OSS's harmony calls) needs reasoning_parser={HARMONY} "
        f"(or auto with a harmony chat template); got reasoning_parser={reasoning_parser!r}"
    )


def _prompt_opens_think(text: str) -> bool:
    """Whether the prompt text ends inside an open ``<think>`` block."""
    tail = text.rstrip()
    i = tail.rfind(THINK_START)
    return i >= 0 and tail.find(THINK_END, i) < 0


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning settings, decided when its prompt is rendered.

    `opened`: the output starts inside the reasoning (the prompt opened ``<think>``);
    otherwise the reasoning is there only if the output starts with ``<think>``.
    `budget`: the most tokens the reasoning may use (None: no cap).
    """

    parser: str
    opened: bool
    budget: int | None = None

    def splitter(self) -> ReasoningSplitter | HarmonySplitter:
        return HarmonySplitter() if self.parser == HARMONY else ReasoningSplitter(self.opened)

    def sampling_fields(self, tokenizer: AutoTokenizer) -> dict[str, Any]:
        """`SamplingParams` fields the parser needs (harmony: its markers kept in the text,
        its stop tokens; `astrai.serve.harmony.sampling_fields`)."""
        return harmony.sampling_fields(tokenizer) if self.parser == HARMONY else {}

    @property
    def tags(self) -> tuple[str, str]:
        """The reasoning's opening and closing tags (what a thinking budget forces)."""
        return (harmony.OPEN, harmony.CLOSE) if self.parser == HARMONY else (THINK_START, THINK_END)


def reasoning_for(
    parser: str | None,
    tokenizer: AutoTokenizer,
    prompt_ids: list[int],
    *,
    enabled: bool = True,
    budget: int | None = None,
) -> Reasoning | None:
    """The `Reasoning` of a request (None: no parsing), its prompt already rendered.
    `enabled`: the template's `enable_thinking` (qwen3 then writes an empty think block
    into the prompt and the model answers without reasoning)."""
    name = resolve_reasoning_parser(parser, tokenizer)
    if name is None or (name == "qwen3" and not enabled):
        return None
    tail = tokenizer.decode(prompt_ids[-16:])  # the generation prompt's end, tags kept
    opened = name == "deepseek_r1" or (name != HARMONY and _prompt_opens_think(tail))
    return Reasoning(name, opened, budget)


class ReasoningSplitter:
    """Splits raw output text into reasoning and content, incrementally.

    `feed` returns ``(is_reasoning, text)`` pieces; text that may be the start of a tag is
    held back until it is decided. `end_at`: raw characters through ``</think>`` (None
    while the reasoning has not ended); `reasoned`: whether the output had a reasoning.
    """

    def __init__(self, opened: bool) -> None:
        self._opened = opened
        # head -> reasoning -> gap -> content; not opened and no <think> first:
        # head -> undecided -> gap -> content (a </think> came) or the end (all content)
        self._state = "head"
        self._buf = ""
        self._scanned = 0  # undecided: characters of the buffer searched for </think>
        self._raw = 0
        self.end_at: int | None = None
        self.reasoned = False

    def feed(self, text: str) -> list[tuple[bool, str]]:
        self._raw += len(text)
        self._buf += text
        out: list[tuple[bool, str]] = []
        while True:
            buf = self._buf
            if self._state == "head":  # an optional <think> the model writes itself
                s = buf.lstrip()
                if s.startswith(THINK_START):
                    self._buf, self._state, self.reasoned = s[len(THINK_START) :], "reasoning", True
                    continue
                if THINK_START.startswith(s):  # empty or a prefix of the tag: wait
                    return out
                self._state = "reasoning" if self._opened else "undecided"
                self.reasoned = self._opened
                continue
            if self._state == "undecided":  # held until a </think> or the end decides
                i = buf.find(THINK_END, max(0, self._scanned - len(THINK_END) + 1))
                if i < 0:
                    self._scanned = len(buf)
                    return out
                self.reasoned = True
                self._put(out, True, buf[:i])
                self._buf, self._state = buf[i + len(THINK_END) :], "gap"
                self.end_at = self._raw - len(self._buf)
                continue
            if self._state == "reasoning":
                i = buf.find(THINK_END)
                if i >= 0:
                    self._put(out, True, buf[:i])
                    self._buf, self._state = buf[i + len(THINK_END) :], "gap"
                    self.end_at = self._raw - len(self._buf)
                    continue
                k = held_suffix(buf, (THINK_END,))
                self._put(out, True, buf[: len(buf) - k])
                self._buf = buf[len(buf) - k :]
                return out
            if self._state == "gap":  # whitespace between </think> and the answer
                s = buf.lstrip()
                self._buf = s
                if not s:
                    return out
                self._state = "content"
                continue
            self._put(out, False, buf)
            self._buf = ""
            return out

    def flush(self) -> list[tuple[bool, str]]:
        """End of output: held text is reasoning inside a reasoning, else content."""
        out: list[tuple[bool, str]] = []
        buf, self._buf = self._buf, ""
        if self._state == "head":
            self.reasoned = self._opened
            self._put(out, self._opened, buf)
        elif self._state == "undecided":  # no </think> came: it was all answer
            self._put(out, False, buf)
        elif self._state != "gap":
            self._put(out, self._state == "reasoning", buf)
        return out

    @staticmethod
    def _put(out: list[tuple[bool, str]], reasoning: bool, text: str) -> None:
        if text:
            out.append((reasoning, text))


class ReasoningOutputParser:
    """An `OutputParser` with the reasoning split off first: reasoning text becomes
    `ReasoningDelta` events, the rest goes through `inner` (stop strings, tool calls)."""

    def __init__(self, reasoning: Reasoning, inner: OutputParser) -> None:
        self.reasoning = reasoning
        self.split = reasoning.splitter()
        self.inner = inner

    @property
    def matched_stop(self) -> str | None:
        return self.inner.matched_stop

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.inner.tool_calls

    def feed(self, text: str) -> list[Event | ReasoningDelta]:
        return self._route(self.split.feed(text))

    def flush(self) -> list[Event | ReasoningDelta]:
        return self._route(self.split.flush()) + self.inner.flush()

    def _route(self, pieces: list[tuple[bool, str]]) -> list[Event | ReasoningDelta]:
        out: list[Event | ReasoningDelta] = []
        for is_reasoning, text in pieces:
            if is_reasoning:
                out.append(ReasoningDelta(text))
            else:
                out += self.inner.feed(text)
        return out

    def reasoning_tokens(self, marks: list[tuple[int, int]], output_tokens: int) -> int:
        """Output tokens of the reasoning, tags included: those through ``</think>``
        (`marks`: raw characters -> tokens so far); all the text's if it never closed."""
        if not self.split.reasoned:
            return 0
        end = self.split.end_at
        if end is None:  # never closed: the tokens of all the text (not the end token)
            end = marks[-1][0] if marks else 0
        return next((tokens for chars, tokens in marks if chars >= end), output_tokens)


def with_reasoning(reasoning: Reasoning | None, parser: OutputParser) -> Any:
    """`parser`, wrapped to split the reasoning off first when the request has one."""
    return parser if reasoning is None else ReasoningOutputParser(reasoning, parser)


def reasoning_tokens(choice: Any) -> int:
    """A choice's reasoning tokens (0 without a reasoning parser)."""
    parser = choice.parser
    if not isinstance(parser, ReasoningOutputParser):
        return 0
    return parser.reasoning_tokens(choice.marks, choice.output_tokens)


# --------------------------------------------------------------------------- the budget
@dataclass(frozen=True)
class ThinkingBudget:
    """Logits processor capping the reasoning at `budget` tokens, tags included.

    While the reasoning is open and only the closing tag still fits in the budget, the
    closing tag's tokens (`close_ids`) are forced one by one; the model then writes its
    answer. Stateless (it reads the generated ids), so `n` choices may share it.
    """

    budget: int
    close_ids: tuple[int, ...]
    open_ids: tuple[int, ...]
    opened: bool
    _limit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        floor = 0 if self.opened else len(self.open_ids)
        object.__setattr__(self, "_limit", max(self.budget - len(self.close_ids), floor))

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        n, limit, close = len(ids), self._limit, self.close_ids
        if n < limit or n >= limit + len(close):
            return logits
        if not self.opened and tuple(ids[: len(self.open_ids)]) != self.open_ids:
            return logits  # no reasoning in this answer
        k = n - limit  # closing tokens forced so far
        if tuple(ids[limit:n]) != close[:k] or _contains(ids[:limit], close):
            return logits  # the reasoning ended on its own
        logits.fill_(-math.inf)
        logits[close[k]] = 0.0
        return logits


def _contains(ids: list[int], seq: tuple[int, ...]) -> bool:
    last, m = seq[-1], len(seq)
    i = -1
    try:
        while True:
            i = ids.index(last, i + 1)
            if i + 1 >= m and tuple(ids[i + 1 - m : i + 1]) == seq:
                return True
    except ValueError:
        return False


def thinking_budget(
    reasoning: Reasoning | None, tokenizer: AutoTokenizer
) -> tuple[ThinkingBudget, ...]:
    """The logits processors that enforce `reasoning.budget` (none without one)."""
    if reasoning is None or reasoning.budget is None:
        return ()
    open_tag, close_tag = reasoning.tags
    return (
        ThinkingBudget(
            reasoning.budget,
            tuple(tokenizer.encode(close_tag)),
            tuple(tokenizer.encode(open_tag)),
            reasoning.opened,
        ),
    )


# --------------------------------------------------------------------------- grammars
_START_RULE = re.compile(r"(?m)^start(\s*):")


def after_reasoning(
    spec: StructuredOutput | None, reasoning: Reasoning | None, tokenizer: AutoTokenizer
) -> StructuredOutput | None:
    """`spec`, applied only after the reasoning: any reasoning text, ``</think>``, optional
    whitespace, then the answer under `spec` (harmony: an analysis message, then the final
    channel's header; `astrai.serve.harmony.reasoning_grammar`). A 400 naming its field if
    it cannot be composed or compiled."""
    if spec is None or reasoning is None:
        return spec
    from astrai.inference.grammar import grammar_compiler
    from astrai.inference.structured import StructuredOutput

    compiler = grammar_compiler(tokenizer)
    try:
        text = spec.grammar(compiler.special_id)  # a TopLevelGrammar's JSON, or Lark text
        inner = json.loads(text)["grammars"][0] if text.startswith("{") else {"lark_grammar": text}
        if inner.get("json_schema") is not None:
            answer = "answer_: %json " + json.dumps(inner["json_schema"], ensure_ascii=False)
        elif inner.get("lark_grammar"):
            answer = _START_RULE.sub(r"answer_\1:", inner["lark_grammar"])
        else:
            raise ValueError("the constraint cannot be composed with a reasoning")
        if reasoning.parser == HARMONY:
            first, rules = harmony.reasoning_grammar(compiler.special_id)
            lark = f"start: {first} answer_\n{rules}{answer}\n"
            out = StructuredOutput.lark(lark, field=spec.field)
            compiler.compile(out)
            return out
        open_id, close_id = compiler.special_id(THINK_START), compiler.special_id(THINK_END)
        if close_id is not None:
            head = f"<[{open_id}]>" if open_id is not None else json.dumps(THINK_START)
            head = head + "?" if reasoning.opened else head
            think = f"reasoning_: {head} /(?s:.*)/ <[{close_id}]>"
        else:
            body = "/(?s:.*)/" if reasoning.opened else "/<think>(?s:.*)/"
            think = f"reasoning_[stop={json.dumps(THINK_END)}]: {body}"
        first = "reasoning_ ws_?" if reasoning.opened else "(reasoning_ ws_?)?"
        lark = f"start: {first} answer_\nws_: /[ \\t\\r\\n]+/\n{think}\n{answer}\n"
        out = StructuredOutput.lark(lark, field=spec.field)
        compiler.compile(out)
    except (ValueError, KeyError) as err:
        raise APIError(400, f"{spec.field}: {err}", param=spec.field) from err
    return out
