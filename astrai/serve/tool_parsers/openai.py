"""GPT-OSS (harmony): a call is a message to ``functions.NAME`` on the commentary channel
(vLLM's ``openai``).

The harmony reasoning parser (`reasoning_parser=openai_gptoss`, `astrai.serve.harmony`) reads
the channels of the raw output and hands each call on in the hermes spelling, which this
parser reads (as it reads a forced `tool_choice`'s); so it needs that reasoning parser, and
the server refuses it without one.
"""

from __future__ import annotations

from typing import ClassVar

from astrai.serve.tool_parsers.hermes import HermesToolParser


class OpenAIToolParser(HermesToolParser):
    name = "openai"
    markers: ClassVar[tuple[str, ...]] = ("<|call|>", "<|channel|>")
