"""Compiling structured-output grammars (`astrai.inference.grammar`): an llguidance error
reaches the caller in readable words, never as a Rust panic with its backtrace."""

from __future__ import annotations

import pytest

from astrai.inference.grammar import grammar_compiler
from astrai.inference.structured import StructuredOutput
from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> AutoTokenizer:
    return AutoTokenizer.train(["tool call arguments {} [] : , 0 1 2 a b c"] * 4, vocab_size=300)


@pytest.mark.slow  # compiles a grammar of ~70k symbols: a second or two
def test_a_grammar_past_llguidances_symbol_limit_is_named_in_our_words(tokenizer):
    """2,000 small tools trip llguidance's 16-bit symbol assertion (a panic whose text is a
    backtrace); the error names the field and says why, without the backtrace."""
    schema = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}}
    tools = [{"name": f"tool_{i}", "parameters": schema} for i in range(2000)]
    spec = StructuredOutput.tool_call(tools, field="tools")
    with pytest.raises(ValueError) as err:
        grammar_compiler(tokenizer).compile(spec)
    message = str(err.value)
    assert message.startswith("tools: invalid tool_call: the grammar is too large"), message
    assert "backtrace" not in message and "panic" not in message and "<unknown>" not in message
    assert len(message.splitlines()) == 1


def test_an_ordinary_compile_error_keeps_llguidances_reason(tokenizer):
    spec = StructuredOutput.json_schema({"type": "objectx"}, field="response_format")
    with pytest.raises(ValueError, match=r"^response_format: invalid json_schema: .*objectx"):
        grammar_compiler(tokenizer).compile(spec)
