"""Tool-call parsers, one per output format, chosen by `tool_parser=` (vLLM's names).

| name          | model families                                  | a call looks like                         |
|---------------|-------------------------------------------------|-------------------------------------------|
| `hermes`      | Hermes 2/3, Qwen2.5, Qwen3, astrai's template   | `<tool_call>{"name", "arguments"}</tool_call>` |
| `llama3_json` | Llama 3.1 / 3.2 / 3.3 (JSON templates)          | `<|python_tag|>{"name", "parameters"}`    |
| `mistral`     | Mistral 7B v0.3, Mixtral, Nemo, Small           | `[TOOL_CALLS][{"name", "arguments"}]`     |
| `pythonic`    | Llama 3.2 1B/3B, Llama 4 (pythonic templates)   | `[get_weather(city="Paris")]`             |
| `qwen3_coder` | Qwen3-Coder                                      | `<tool_call><function=f><parameter=p>...` |
| `openai`      | GPT-OSS (harmony; needs `reasoning_parser=openai_gptoss`) | `<|channel|>commentary to=functions.f<|message|>{...}<|call|>` |

`auto` picks by the chat template's text (`detect`), falling back to hermes; `none`
parses no calls. `resolve` turns the setting into a `ToolParserChoice`, whose `new` makes
the per-choice parser (`ToolParser`, base.py) and whose `parse_text` reads a whole output.
The server (one parser per choice, behind the stop strings: `OutputParser`, stream.py) and
GRPO's environments (`astrai.train.environments`, `Environment.tool_parser`) resolve the
same setting against the same chat template, so a model is read alike in training and
serving. The events they emit are events.py's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from astrai.serve.tool_parsers.base import ToolParser, argument_fragments
from astrai.serve.tool_parsers.events import Event, TextDelta, ToolCall
from astrai.serve.tool_parsers.hermes import HermesToolParser, tagged_parser
from astrai.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from astrai.serve.tool_parsers.mistral import MistralToolParser
from astrai.serve.tool_parsers.openai import OpenAIToolParser
from astrai.serve.tool_parsers.pythonic import PythonicToolParser
from astrai.serve.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from astrai.serve.tool_parsers.stream import OutputParser, StopMatcher

__all__ = [
    "TOOL_PARSERS",
    "TOOL_PARSER_CHOICES",
    "Event",
    "OutputParser",
    "StopMatcher",
    "TextDelta",
    "ToolCall",
    "ToolParser",
    "ToolParserChoice",
    "argument_fragments",
    "detect",
    "resolve",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        OpenAIToolParser,
        PythonicToolParser,
        Qwen3CoderToolParser,
    )
}
TOOL_PARSER_CHOICES: tuple[str, ...] = (*TOOL_PARSERS, "auto", "none")

# `auto`: the most specific markers first (a qwen3_coder template also has <tool_call>).
_DETECT_ORDER = ("openai", "pythonic", "qwen3_coder", "mistral", "llama3_json", "hermes")


@dataclass(frozen=True)
class ToolParserChoice:
    """The server's tool-call format: `new(tools, id_prefix)` makes one choice's parser."""

    cls: type[ToolParser]

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def forced(self) -> tuple[str, str]:
        """The tags around the JSON call a forced `tool_choice` grammar writes."""
        return self.cls.forced

    def new(
        self, tools: Sequence[Mapping[str, Any]] | None = None, id_prefix: str = "call_"
    ) -> ToolParser:
        return self.cls(tools, id_prefix)

    def parse_text(
        self, text: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[str, list[ToolCall]]:
        """A whole output at once: its content (the text outside the calls, as a
        non-streamed choice's) and its calls (`tools`: as for `new`)."""
        parser = self.new(tools)
        events = parser.feed(text) + parser.flush()
        return "".join(e.text for e in events if isinstance(e, TextDelta)), parser.calls


def detect(template: str | None) -> str:
    """The parser a chat template's text calls for (`hermes` when nothing matches)."""
    for name in _DETECT_ORDER:
        if template and any(m in template for m in TOOL_PARSERS[name].markers):
            return name
    return "hermes"


def resolve(
    spec: str | ToolParserChoice | None, template: str | None = None
) -> ToolParserChoice | None:
    """`tool_parser=` (a name, `auto` read off `template`, `none`, or "START|END" tags of a
    hermes-style format) -> a choice (a choice is kept as it is); None for `none`. A
    ValueError naming `tool_parser` and the choices for anything else."""
    if isinstance(spec, ToolParserChoice):
        return spec
    if spec is None or spec in ("", "none", "off"):
        return None
    if isinstance(spec, str):
        name = detect(template) if spec == "auto" else spec
        if name in TOOL_PARSERS:
            return ToolParserChoice(TOOL_PARSERS[name])
        start, sep, end = spec.partition("|")
        if sep and start and end:
            return ToolParserChoice(tagged_parser(start, end))
    raise ValueError(
        f"tool_parser must be one of {', '.join(TOOL_PARSER_CHOICES)} "
        f"(or 'START|END' tags for a hermes-style format); got {spec!r}"
    )
