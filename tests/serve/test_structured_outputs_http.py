"""vLLM's `structured_outputs` field over HTTP (astrai.serve.structured_outputs), through the
real `openai` client's `extra_body`, on both OpenAI endpoints.

The served model has random weights: unconstrained, its answers are byte soup, so every
sampled answer (several seeds, temperature > 0) that its constraint accepts shows the mask
was applied. Acceptance is checked independently of the server: `re.fullmatch` for a
regex, membership for a choice, llguidance's own parser plus an equivalent `re` for a
grammar, `jsonschema.validate` for a schema. Constraints are bounded so every answer ends.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance as llg
import openai
import pytest

from astrai.inference.grammar import grammar_compiler

MSGS = [{"role": "user", "content": "Answer."}]
SAMPLES = [(1, 1.0), (2, 0.8), (3, 1.3)]  # (seed, temperature)
REGEX = r"[a-z]{2,6}@[a-z]{1,4}\.(com|org)"
CHOICES = ["yes", "no", 'a "quoted" one', "back\\slash", "naïve\nline"]
GRAMMAR = """start: greeting " " name "!"
greeting: "hello" | "hi"
name: /[a-z]{1,6}/
"""
GRAMMAR_RE = r"(hello|hi) [a-z]{1,6}!"  # the same language, for `re`
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def _texts(oai: openai.OpenAI, endpoint: str, structured: dict, seed: int, temp: float):
    """Two sampled answers (n=2) of one request to `endpoint` (chat or completions)."""
    common = dict(
        model="astrai",
        max_tokens=120,
        seed=seed,
        temperature=temp,
        n=2,
        extra_body={"structured_outputs": structured},
    )
    if endpoint == "chat":
        r = oai.chat.completions.create(messages=MSGS, **common)
        return [(c.message.content, c.finish_reason) for c in r.choices]
    r = oai.completions.create(prompt="Answer:", **common)
    return [(c.text, c.finish_reason) for c in r.choices]


def _grammar_accepts(tokenizer, text: str) -> bool:
    """llguidance's own parser of GRAMMAR, fed the answer's bytes as tokens."""
    ll_tok = grammar_compiler(tokenizer).ll_tokenizer
    matcher = llg.LLMatcher(ll_tok, llg.LLMatcher.grammar_from_lark(GRAMMAR))
    ok = matcher.consume_tokens(tokenizer.encode(text))
    return ok and matcher.is_accepting() and not matcher.is_error()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("seed, temp", SAMPLES)
def test_regex_answers_fullmatch(oai, endpoint, seed, temp):
    for text, finish in _texts(oai, endpoint, {"regex": REGEX}, seed, temp):
        assert finish == "stop"
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("seed, temp", SAMPLES)
def test_choice_answers_are_one_of_the_choices(oai, endpoint, seed, temp):
    for text, finish in _texts(oai, endpoint, {"choice": CHOICES}, seed, temp):
        assert finish == "stop"
        assert text in CHOICES, text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("seed, temp", SAMPLES)
def test_grammar_answers_parse(oai, tokenizer, endpoint, seed, temp):
    for text, finish in _texts(oai, endpoint, {"grammar": GRAMMAR}, seed, temp):
        assert finish == "stop"
        assert re.fullmatch(GRAMMAR_RE, text), text
        assert _grammar_accepts(tokenizer, text), text


def test_grammar_check_can_fail(tokenizer):
    assert _grammar_accepts(tokenizer, "hello abc!")
    assert not _grammar_accepts(tokenizer, "hello abc")
    assert not _grammar_accepts(tokenizer, "hey abc!")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("seed, temp", SAMPLES)
@pytest.mark.parametrize("as_text", [False, True])
def test_json_answers_validate(oai, endpoint, seed, temp, as_text):
    schema = json.dumps(SCHEMA) if as_text else SCHEMA
    for text, finish in _texts(oai, endpoint, {"json": schema}, seed, temp):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_answers_are_objects(oai):
    for text, finish in _texts(oai, "chat", {"json_object": True}, 4, 1.0):
        assert finish == "stop" and isinstance(json.loads(text), dict)


def test_streamed_choice(oai):
    chunks = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=60,
        seed=5,
        stream=True,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in CHOICES


@pytest.mark.parametrize(
    ("structured", "param"),
    [
        ({"regex": 5}, "structured_outputs.regex"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"choice": "yes"}, "structured_outputs.choice"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice.1"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ({"grammar": "start: ("}, "structured_outputs.grammar"),
        ({"json": 5}, "structured_outputs.json"),
        ({"json": "not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": {"type": "objectx"}}, "structured_outputs.json"),
        ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"structural_tag": "x"}, "structured_outputs.structural_tag"),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_malformed_is_a_400_naming_the_field(oai, engine, structured, param, endpoint):
    before = engine.get_stats()["total_tasks"]
    with pytest.raises(openai.BadRequestError) as err:
        _texts(oai, endpoint, structured, 1, 1.0)
    assert err.value.body["param"] == param
    assert err.value.body["message"].startswith(param.split(".")[0])
    assert param.rsplit(".", 1)[0] in err.value.body["message"]
    assert engine.get_stats()["total_tasks"] == before  # refused before any generation


def test_both_kinds_are_named(oai):
    with pytest.raises(openai.BadRequestError) as err:
        _texts(oai, "chat", {"regex": "a", "grammar": GRAMMAR}, 1, 1.0)
    assert "regex" in err.value.body["message"] and "grammar" in err.value.body["message"]


def test_with_response_format_is_a_400_naming_both(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai",
            messages=MSGS,
            max_tokens=5,
            response_format={"type": "json_object"},
            extra_body={"structured_outputs": {"regex": "a"}},
        )
    message = err.value.body["message"]
    assert "structured_outputs" in message and "response_format" in message


def test_with_forced_tool_choice_is_a_400_naming_both(oai):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai",
            messages=MSGS,
            max_tokens=5,
            tools=tools,
            tool_choice="required",
            extra_body={"structured_outputs": {"choice": ["a"]}},
        )
    message = err.value.body["message"]
    assert "structured_outputs" in message and "tool_choice" in message
