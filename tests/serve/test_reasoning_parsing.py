"""The reasoning splitter, the thinking budget and the `reasoning_parser` option, unit-level."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from astrai.serve import ServeSettings
from astrai.serve.__main__ import settings_of
from astrai.serve.reasoning import (
    REASONING_PARSER_CHOICES,
    Reasoning,
    ReasoningDelta,
    ReasoningOutputParser,
    ReasoningSplitter,
    ThinkingBudget,
    reasoning_for,
    resolve_reasoning_parser,
)
from astrai.serve.tool_parsers import OutputParser, TextDelta
from astrai.tokenizer import AutoTokenizer

CASES = [
    # (text, opened) -> (reasoning, content)
    ("<think>a < b</think>\n\nAnswer", False, "a < b", "Answer"),
    ("  <think>x</think>y", False, "x", "y"),
    # qwen3, no <think> first: split at </think> as Qwen3's model card does, else content
    ("Answer <think>later</think>", False, "Answer <think>later", ""),
    (
        "Reasoning without the tag.</think>\n\nThe answer.",
        False,
        "Reasoning without the tag.",
        "The answer.",
    ),
    ("No tag, no end: all answer </thin", False, "", "No tag, no end: all answer </thin"),
    ("<think>never closed </thi", False, "never closed </thi", ""),
    ("<thi", False, "", "<thi"),
    ("r1 style</think>ok", True, "r1 style", "ok"),
    ("<think>again</think>ok", True, "again", "ok"),
    ("no end at all", True, "no end at all", ""),
    ("", True, "", ""),
]


def _split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    s = ReasoningSplitter(opened)
    pieces, last = [], 0
    for cut in [*cuts, len(text)]:
        pieces += s.feed(text[last:cut])
        last = cut
    pieces += s.flush()
    return (
        "".join(t for r, t in pieces if r),
        "".join(t for r, t in pieces if not r),
    )


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_splitter_is_independent_of_how_the_text_arrives(text, opened, reasoning, content):
    assert _split(text, opened, []) == (reasoning, content)
    rng = random.Random(text)
    for _ in range(30):  # any cut into deltas, also inside a tag, gives the same split
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 6))))
        assert _split(text, opened, cuts) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _split(text, opened, list(range(1, i))) == (reasoning, content)


def test_stop_strings_apply_to_the_answer_only():
    p = ReasoningOutputParser(Reasoning("qwen3", False), OutputParser(["END"]))
    events = []
    for ch in "<think>no END here</think>yes END rest":
        events += p.feed(ch)
    events += p.flush()
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "no END here"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "yes "
    assert p.matched_stop == "END"


def test_thinking_budget_forces_the_closing_tokens():
    close, opening = (7, 8), (5,)
    budget = ThinkingBudget(6, close, opening, opened=False)
    # <think> and 2 reasoning tokens: with the close (2 tokens) 5 of 6, nothing forced yet
    assert torch.equal(budget([5, 1, 1], torch.zeros(10)), torch.zeros(10))
    out = budget([5, 1, 1, 1], torch.zeros(10))  # now only the close still fits
    assert int(out.argmax()) == 7 and torch.isinf(out).sum() == 9
    out = budget([5, 1, 1, 1, 7], torch.zeros(10))
    assert int(out.argmax()) == 8
    assert torch.equal(budget([5, 1, 1, 1, 7, 8], torch.zeros(10)), torch.zeros(10))
    # Closed on its own before the budget, or no reasoning at all: left alone.
    assert torch.equal(budget([5, 7, 8, 1], torch.zeros(10)), torch.zeros(10))
    assert torch.equal(budget([1, 1, 1, 1], torch.zeros(10)), torch.zeros(10))
    opened = ThinkingBudget(3, (7,), (5,), opened=True)  # the prompt opened <think>
    assert int(opened([1, 1], torch.zeros(10)).argmax()) == 7


def test_reasoning_parser_option_names_its_choices():
    with pytest.raises(ValueError, match="reasoning_parser must be one of") as err:
        ServeSettings(reasoning_parser="foo")
    assert all(c in str(err.value) for c in REASONING_PARSER_CHOICES)
    with pytest.raises(SystemExit, match="reasoning_parser"):
        settings_of({"model_path": "/tmp/m", "reasoning_parser": "foo"})
    assert settings_of({"model_path": "/tmp/m", "reasoning_parser": "qwen3"}).reasoning_parser
    assert ServeSettings(reasoning_parser="none").reasoning_parser == "none"


class _Template:
    """A tokenizer stand-in: `resolve_reasoning_parser` reads only the template."""

    def __init__(self, template: str, generation_prompt: str) -> None:
        self.chat_template = template
        self.prompt = generation_prompt

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "<|im_start|>user\nhi<|im_end|>\n" + self.prompt


@pytest.mark.parametrize(
    ("template", "prompt", "want"),
    [
        ("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}", "", "qwen3"),
        ("{{ '<think>\\n' }}", "<|im_start|>assistant\n<think>\n", "deepseek_r1"),
        ("{{ '<think></think>' }}", "<|im_start|>assistant\n<think></think>", None),
        ("chatml", "<|im_start|>assistant\n", None),
    ],
)
def test_auto_picks_the_parser_from_the_chat_template(template, prompt, want):
    tok = _Template(template, prompt)
    assert resolve_reasoning_parser("auto", tok) == want
    assert resolve_reasoning_parser("qwen3", tok) == "qwen3"
    assert resolve_reasoning_parser(None, tok) is None


QWEN3 = Path(__file__).parents[1] / "tokenizer" / "family_templates" / "qwen3.jinja"


@pytest.mark.skipif(not QWEN3.exists(), reason="needs Qwen3's chat template")
def test_qwen3_template_auto_and_enable_thinking(tokenizer):
    """Qwen3-8B's own template: `auto` finds qwen3; `enable_thinking=False` writes an empty
    think block, so nothing is parsed; a template that opens `<think>` in the prompt
    (Qwen3-Thinking, Qwen3.5) makes the whole answer up to `</think>` reasoning."""
    template = QWEN3.read_text(encoding="utf-8")
    tok = AutoTokenizer(tokenizer.backend, eos_token="<|im_end|>", chat_template=template)
    assert resolve_reasoning_parser("auto", tok) == "qwen3"

    def prompt(tok: AutoTokenizer, **extra) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, **extra
        )

    assert reasoning_for("auto", tok, prompt(tok, enable_thinking=False), enabled=False) is None
    on = reasoning_for("auto", tok, prompt(tok), enabled=True)
    assert on == Reasoning("qwen3", opened=False)
    gen = "{{- '<|im_start|>assistant\\n' }}"
    assert gen in template
    opening = template.replace(gen, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    tok2 = AutoTokenizer(tokenizer.backend, eos_token="<|im_end|>", chat_template=opening)
    assert reasoning_for("auto", tok2, prompt(tok2), enabled=True).opened
