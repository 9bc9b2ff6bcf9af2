"""Structured outputs over HTTP, through the real OpenAI and Anthropic SDKs and langchain.

The served model has random weights (no script): without the constraint its answers are
byte soup, so a response that parses and validates (`jsonschema`, pydantic) shows the
mask was applied. Schemas bound strings and numbers so every answer completes.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MSGS = [{"role": "user", "content": "Describe a person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {
            "type": "array",
            "items": {"enum": ["a", "b", "c"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a"],
    "additionalProperties": False,
}
OAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
ANT_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER},
    {"name": "add", "input_schema": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed, temperature", [(1, 1.0), (2, 0.7), (3, 0.0)])
def test_response_format_json_schema_validates(oai, seed, temperature):
    r = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=200,
        seed=seed,
        temperature=temperature,
        response_format=_json_schema_format(PERSON),
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_response_format_streamed_and_n2(oai):
    chunks = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=200,
        seed=5,
        n=2,
        stream=True,
        response_format=_json_schema_format(PERSON),
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_is_a_dict(oai):
    # Greedy with a low top-k keeps the random model's object short; any JSON object goes.
    r = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=300,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_response_format_text_is_unconstrained(oai):
    kw = dict(model="astrai", messages=MSGS, max_tokens=12, temperature=0.0)
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    text = oai.chat.completions.create(**kw, response_format={"type": "text"})
    assert text.choices[0].message.content == plain


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    ok: bool


def test_langchain_with_structured_output_json_schema(base_url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{base_url}/v1", api_key="x", model="astrai", max_tokens=200, seed=4)
    person = llm.with_structured_output(Person, method="json_schema", strict=True).invoke(
        "Describe a person."
    )
    assert isinstance(person, Person)
    assert 0 <= person.age <= 120 and len(person.name) <= 8


@pytest.mark.parametrize("seed, temperature", [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.0)])
def test_tool_choice_required_always_calls_a_tool(oai, seed, temperature):
    r = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=200,
        seed=seed,
        temperature=temperature,
        tools=OAI_TOOLS,
        tool_choice="required",
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_picks_that_tool_streamed(oai):
    for name in ("add", "get_weather"):
        chunks = list(
            oai.chat.completions.create(
                model="astrai",
                messages=MSGS,
                max_tokens=200,
                seed=9,
                tools=OAI_TOOLS,
                tool_choice={"type": "function", "function": {"name": name}},
                stream=True,
            )
        )
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
        assert deltas[0].function.name == name
        args = json.loads("".join(d.function.arguments or "" for d in deltas))
        jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_anthropic_tool_choice_any_and_tool(ant, choice):
    for top_k in (1, 50):  # greedy, then sampled
        m = ant.messages.create(
            model="astrai",
            max_tokens=200,
            extra_body={"top_k": top_k},
            messages=MSGS,
            tools=ANT_TOOLS,
            tool_choice=choice,
        )
        assert m.stop_reason == "tool_use"
        [block] = [b for b in m.content if b.type == "tool_use"]
        if choice["type"] == "tool":
            assert block.name == "add"
        jsonschema.validate(block.input, SCHEMAS[block.name])


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objectx"}}},
        {"type": "json_schema", "json_schema": {"name": "p"}},
        {"type": "json_schema", "json_schema": {"name": "p", "schema": {"pattern": "(x"}}},
        {"type": "xml"},
    ],
)
def test_bad_response_format_is_a_400_naming_it(oai, response_format):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai", messages=MSGS, max_tokens=5, response_format=response_format
        )
    assert err.value.body["param"] in ("response_format", "response_format.type")
    assert "response_format" in err.value.body["message"]


def test_bad_tool_schema_with_forced_call_is_a_400(oai, ant):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai", messages=MSGS, max_tokens=5, tools=bad, tool_choice="required"
        )
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(
            model="astrai", messages=MSGS, max_tokens=5, tool_choice="required"
        )
    with pytest.raises(anthropic.BadRequestError) as aerr:
        ant.messages.create(
            model="astrai",
            max_tokens=5,
            messages=MSGS,
            tools=[{"name": "f", "input_schema": {"type": "objectx"}}],
            tool_choice={"type": "any"},
        )
    assert aerr.value.body["type"] == "error"
    assert "tools" in aerr.value.body["error"]["message"]


def _tools(n: int) -> list[dict]:
    return [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": WEATHER}}
        for i in range(n)
    ]


def test_forcing_a_call_among_thousands_of_tools_is_a_400_in_our_words(oai, ant):
    """3,000 tools made a grammar llguidance panics on (its backtrace was the message);
    a forced call chooses among at most 128 (OpenAI's limit on `tools`)."""
    from astrai.serve.structured import MAX_FORCED_TOOLS

    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai", messages=MSGS, max_tokens=5, tools=_tools(3000), tool_choice="required"
        )
    body = err.value.body
    assert body["param"] == "tools" and "at most 128" in body["message"], body
    assert "panic" not in body["message"] and "backtrace" not in body["message"]
    ant_tools = [{"name": t["function"]["name"], "input_schema": WEATHER} for t in _tools(3000)]
    with pytest.raises(anthropic.BadRequestError, match="at most 128"):
        ant.messages.create(
            model="astrai",
            max_tokens=5,
            messages=MSGS,
            tools=ant_tools,
            tool_choice={"type": "any"},
        )
    # 128 pass the cap and compile; their rendering is longer than the tiny model's
    # context, so the engine's prompt check is what answers.
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="astrai",
            messages=MSGS,
            max_tokens=5,
            tools=_tools(MAX_FORCED_TOOLS),
            tool_choice="required",
        )
    assert err.value.body["code"] == "context_length_exceeded", err.value.body


def test_logprobs_of_a_constrained_answer_list_only_allowed_tokens(oai):
    """Forbidden tokens have probability 0: they are no top alternatives (no -inf, which
    JSON cannot carry), and the answer still validates."""
    r = oai.chat.completions.create(
        model="astrai",
        messages=MSGS,
        max_tokens=200,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        response_format=_json_schema_format(PERSON),
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    entries = r.choices[0].logprobs.content
    assert "".join(e.token for e in entries).startswith('{"name": "')
    assert any(len(e.top_logprobs) < 5 for e in entries)  # forced tokens: one alternative
    for e in entries:
        assert e.top_logprobs and e.top_logprobs[0].logprob >= e.logprob - 1e-5
