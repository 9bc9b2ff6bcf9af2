"""Tool calls through both SDKs, with a scripted model output (deterministic parse path)."""

import json

OAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ANT_TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
ARGS = {"city": "Paris", "days": [1, 2], "unit": "°C"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"


def test_openai_tool_call_plain_and_streamed(oai, script):
    script("Checking.\n" + CALL)
    r = oai.chat.completions.create(model="astrai", messages=MSGS, tools=OAI_TOOLS, max_tokens=99)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS

    with oai.chat.completions.stream(
        model="astrai", messages=MSGS, tools=OAI_TOOLS, max_tokens=99
    ) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS

    chunks = list(
        oai.chat.completions.create(
            model="astrai", messages=MSGS, tools=OAI_TOOLS, max_tokens=99, stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == ARGS


def test_openai_two_calls_and_no_tools_means_text(oai, script):
    script(CALL + "\n" + CALL.replace("Paris", "Rome"))
    r = oai.chat.completions.create(model="astrai", messages=MSGS, tools=OAI_TOOLS, max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert r.choices[0].message.content is None
    # Without tools (or with tool_choice="none") the output is plain text.
    for extra in ({}, {"tools": OAI_TOOLS, "tool_choice": "none"}):
        r = oai.chat.completions.create(model="astrai", messages=MSGS, max_tokens=200, **extra)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].message.content.startswith("<tool_call>")


def test_openai_invalid_call_stays_text(oai, script):
    script("<tool_call>{broken</tool_call>")
    r = oai.chat.completions.create(model="astrai", messages=MSGS, tools=OAI_TOOLS, max_tokens=99)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "<tool_call>{broken</tool_call>"
    assert r.choices[0].finish_reason == "stop"


def test_anthropic_tool_use_plain_and_streamed(ant, script):
    script(CALL)
    m = ant.messages.create(model="astrai", messages=MSGS, tools=ANT_TOOLS, max_tokens=99)
    assert m.stop_reason == "tool_use"
    [block] = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == ARGS

    script("Checking.\n" + CALL)
    with ant.messages.stream(
        model="astrai", messages=MSGS, tools=ANT_TOOLS, max_tokens=99
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking."
    assert final.content[1].name == "get_weather" and final.content[1].input == ARGS


def _prompt_len(tokenizer, messages, tools=None):
    return len(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
    )


def test_tools_and_history_are_rendered(oai, ant, script, tokenizer):
    """Tools, assistant tool calls and tool results reach the prompt exactly as the chat
    template renders them (compared through the prompt's token count)."""
    script("It is sunny.")
    args = json.dumps({"city": "Paris"})
    history = [
        {"role": "system", "content": "You are helpful."},
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    expected = _prompt_len(tokenizer, history, OAI_TOOLS)
    assert expected > _prompt_len(tokenizer, history) > _prompt_len(tokenizer, history[:2])
    r = oai.chat.completions.create(
        model="astrai", messages=history, tools=OAI_TOOLS, max_tokens=20
    )
    assert r.usage.prompt_tokens == expected
    assert r.choices[0].message.content == "It is sunny."

    m = ant.messages.create(
        model="astrai",
        system="You are helpful.",
        tools=ANT_TOOLS,
        max_tokens=20,
        messages=[
            *MSGS,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny, 21 C"}
                ],
            },
        ],
    )
    assert m.usage.input_tokens == expected
    assert m.content[0].text == "It is sunny."
