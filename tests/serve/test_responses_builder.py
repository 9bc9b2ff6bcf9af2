"""`POST /v1/responses` through the official `openai` SDK (`client.responses`).

The scripted model (conftest) writes an exact text; expected prompt sizes come from the
tokenizer's own chat template over the conversation the request amounts to, never from
hard-coded numbers.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from astrai.serve import ServerThread, ServeSettings, create_app

TEXT = "Hello there, how are you today?"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _prompt_tokens(tokenizer, messages, tools=None) -> int:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True
    )
    return len(ids)


def _events(oai, **kw) -> list:
    return list(oai.responses.create(model="astrai", stream=True, **kw))


def test_plain(oai, script, tokenizer):
    script(TEXT)
    r = oai.responses.create(
        model="astrai", input="Say hello", instructions="Be brief.", max_output_tokens=64
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text" and r.output_text == TEXT
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello"},
    ]
    assert r.usage.input_tokens == _prompt_tokens(tokenizer, messages)
    assert r.usage.output_tokens == len(tokenizer.encode(TEXT)) + 1  # the text and the end
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 64


def test_stream_equals_plain_at_temperature_zero(oai):
    """The random model's own greedy answer: streamed and plain alike."""
    kw = {"model": "astrai", "input": "Tell me a story", "temperature": 0, "max_output_tokens": 24}
    plain = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_stream_helper(oai, script):
    script(TEXT)
    with oai.responses.stream(model="astrai", input="Say hello") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == TEXT and final.status == "completed"


def test_length_is_incomplete(oai, script):
    script(TEXT)
    r = oai.responses.create(model="astrai", input="Say hello", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    events = _events(oai, input="Say hello", max_output_tokens=2)
    assert events[-1].type == "response.incomplete"


def test_function_call(oai, script, tokenizer):
    script(CALL)
    r = oai.responses.create(model="astrai", input="Weather in Paris?", tools=[WEATHER])
    assert [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in WEATHER if k != "type"}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert r.usage.input_tokens == _prompt_tokens(tokenizer, messages, chat_tools)

    events = _events(oai, input="Weather in Paris?", tools=[WEATHER])
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args
    assert events[-1].response.output[0].arguments == args


def test_function_call_output_round_trip(oai, script, tokenizer):
    """A call and its output sent back as input items render as the chat API's assistant
    tool call and `tool` message."""
    script(TEXT)
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = oai.responses.create(model="astrai", input=items, tools=[WEATHER])
    assert r.output_text == TEXT
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in WEATHER if k != "type"}}]
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert r.usage.input_tokens == _prompt_tokens(tokenizer, messages, chat_tools)


def test_previous_response_id_continues_the_conversation(oai, script, tokenizer):
    script(TEXT)
    first = oai.responses.create(model="astrai", input="Say hello", instructions="Be brief.")
    script("Again: " + TEXT)
    second = oai.responses.create(model="astrai", input="Once more", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The first turn's input and output, not its instructions (OpenAI's rule).
    turns = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": TEXT},
        {"role": "user", "content": "Once more"},
    ]
    assert second.usage.input_tokens == _prompt_tokens(tokenizer, turns)
    streamed = _events(oai, input="And again", previous_response_id=second.id)
    turns += [
        {"role": "assistant", "content": "Again: " + TEXT},
        {"role": "user", "content": "And again"},
    ]
    assert streamed[-1].response.usage.input_tokens == _prompt_tokens(tokenizer, turns)


def _bad(oai, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="astrai", **kw)
    return info.value


def test_errors_name_the_field(oai, script):
    script(TEXT)
    err = _bad(oai, input="hi", previous_response_id="resp_unknown")
    assert err.body["param"] == "previous_response_id"
    kept = oai.responses.create(model="astrai", input="hi", store=False)
    assert (
        _bad(oai, input="hi", previous_response_id=kept.id).body["param"] == "previous_response_id"
    )
    assert _bad(oai, input="hi", max_output_tokens=100_000).body["param"] == "max_output_tokens"
    assert _bad(oai, input="hi", tools=[{"type": "web_search"}]).body["param"].startswith("tools")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
    assert _bad(oai, input=image).body["param"].startswith("input")
    assert (
        _bad(oai, input=[{"type": "item_reference", "id": "x"}]).body["param"].startswith("input")
    )
    assert _bad(oai, input=[]).body["param"] == "input"
    assert _bad(oai, input="hi", background=True).body["param"] == "background"
    choice = {"type": "function", "name": "nope"}
    assert _bad(oai, input="hi", tools=[WEATHER], tool_choice=choice).body["param"] == "tool_choice"


POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_text_format_json_schema_constrains_the_answer(oai, seed):
    """The random model's own samples, constrained by `text.format`, always match it."""
    fmt = {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}
    r = oai.responses.create(
        model="astrai",
        input="A point, please",
        text={"format": fmt},
        temperature=1.0,
        max_output_tokens=64,
        extra_body={"seed": seed},
    )
    jsonschema.validate(json.loads(r.output_text), POINT)
    assert r.text.format.type == "json_schema" and r.text.format.name == "point"


def test_text_format_json_object_and_its_400(oai):
    r = oai.responses.create(
        model="astrai",
        input="Any object",
        text={"format": {"type": "json_object"}},
        max_output_tokens=300,
        temperature=0.0,
    )
    assert r.status == "completed" and r.text.format.type == "json_object", r.output_text
    assert isinstance(json.loads(r.output_text), dict)
    plain = oai.responses.create(model="astrai", input="hi", max_output_tokens=4)
    assert plain.text.format.type == "text"
    bad = {"type": "json_schema", "name": "p", "schema": {"type": "no-such-type"}}
    assert _bad(oai, input="hi", text={"format": bad}).body["param"] == "text.format"


@pytest.fixture(scope="module")
def reasoning_oai(engine):
    app = create_app(engine, ServeSettings(reasoning_parser="deepseek_r1"))
    with (
        ServerThread(app) as srv,
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0) as client,
    ):
        yield client


def test_reasoning_items(reasoning_oai, script):
    """deepseek_r1: everything before `</think>` is the reasoning item, the rest the message."""
    script("Let me think.</think>" + TEXT)
    r = reasoning_oai.responses.create(model="astrai", input="Say hello")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think." and r.output_text == TEXT
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(reasoning_oai.responses.create(model="astrai", input="Say hello", stream=True))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == "Let me think."
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output_text == TEXT
