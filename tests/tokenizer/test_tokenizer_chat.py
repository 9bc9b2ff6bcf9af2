"""Chat templates: default ChatML rendering, sandboxing, and assistant loss masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_cases import CONVERSATIONS, WEATHER_TOOL

from astrai.tokenizer import DEFAULT_CHAT_TEMPLATE, AutoTokenizer, ChatTemplate, TemplateError

# --------------------------------------------------------------------------- rendering


def test_default_template_chatml(tok: AutoTokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS["system_user_assistant"])
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n2+2 = 4.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_default_template_tools(tok: AutoTokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS["tools"], tools=[WEATHER_TOOL])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nUse tools when useful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in system
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in system
    )
    assert rest.startswith("<|im_start|>user\nWeather in Zürich and Paris?<|im_end|>\n")
    # dict arguments via tojson (no ASCII escaping), string arguments as given
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
    ) in rest
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\n12°C, rain\n</tool_response>\n"
        "<tool_response>\n18°C, sun\n</tool_response><|im_end|>\n"
    ) in rest
    # tools without a system message: a system turn that only describes the tools
    bare = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert bare.startswith("<|im_start|>system\n# Tools\n")


def test_unknown_role_names_role_and_index(tok: AutoTokenizer) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]
    with pytest.raises(ValueError, match=r"messages\[1\].*'robot'"):
        tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=r"messages\[1\].*'robot'"):
        tok.encode_chat(messages)


def test_bad_messages_are_rejected(tok: AutoTokenizer) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\].*content"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    with pytest.raises(ValueError, match=r"tool_calls\[0\].*name"):
        tok.apply_chat_template(
            [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]
        )
    with pytest.raises(TypeError, match="messages"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]


def test_template_raise_exception_default_template() -> None:
    """The default template itself rejects unknown roles (HF renders the same template)."""
    with pytest.raises(TemplateError, match=r'Unknown role "robot" in message 0'):
        ChatTemplate(DEFAULT_CHAT_TEMPLATE).render([{"role": "robot", "content": "x"}])


def test_tokenize_true_gives_ids(tok: AutoTokenizer) -> None:
    conv = CONVERSATIONS["multi_turn"]
    ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    text = tok.apply_chat_template(conv, add_generation_prompt=True)
    assert ids == tok.encode(text)


def test_extra_variables_reach_template(tok: AutoTokenizer) -> None:
    t = AutoTokenizer(
        tok.backend,
        eos_token=tok.eos_token,
        chat_template="{{ bos_token }}|{{ eos_token }}|{{ greeting }}|{{ messages | length }}",
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}], greeting="hey") == (
        f"|{tok.eos_token}|hey|1"
    )


def test_tojson_like_hf() -> None:
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    x = {"html": "<b>&'", "text": "中文"}
    assert t.render([], x=x) == json.dumps(x, ensure_ascii=False) + "|" + json.dumps(
        x, ensure_ascii=False, indent=2
    )


def test_strftime_now_and_loopcontrols() -> None:
    t = ChatTemplate(
        "{{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    assert t.render([{"role": "a"}, {"role": "b"}]) == "4a"


def test_generation_block_accepted() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert t.render([{"role": "assistant", "content": "hi"}]) == "hi"


# --------------------------------------------------------------------------- sandbox


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ '{0.__class__}'.format(messages) }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}{{ ns }}",
    ],
)
def test_sandbox_blocks_python_internals(source: str) -> None:
    template = ChatTemplate(source)
    with pytest.raises(TemplateError, match=r"unsafe|sandbox|underscore") as info:
        template.render([{"role": "user", "content": "x"}])
    assert isinstance(info.value, ValueError)


def test_sandbox_error_through_tokenizer(tok: AutoTokenizer) -> None:
    evil = AutoTokenizer(tok.backend, chat_template="{{ cycler.__init__.__globals__.os }}")
    with pytest.raises(TemplateError, match="unsafe"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_syntax_error_names_line() -> None:
    with pytest.raises(TemplateError, match="syntax error at line 3"):
        ChatTemplate("line one\n{{ messages }}\n{% if %}\n")
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}{{ m }}")


def test_render_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="raised on purpose"):
        ChatTemplate("{{ raise_exception('raised on purpose') }}").render([])
    with pytest.raises(TemplateError, match="failed to render"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_bad_template_fails_at_load(tok: AutoTokenizer, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for %}"
    config_path.write_text(json.dumps(config))
    with pytest.raises(TemplateError, match="syntax error"):
        AutoTokenizer.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- assistant mask


def masked_runs(tok: AutoTokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decode each maximal run of mask==1 tokens."""
    runs: list[list[int]] = []
    prev = 0
    for i, m in zip(ids, mask):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(i)
        prev = m
    return [tok.decode(r) for r in runs]


def tool_call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


EXPECTED_ASSISTANT_SPANS = {
    "system_user_assistant": ["2+2 = 4.<|im_end|>"],
    "multi_turn": [
        "Hello 😀 how can I help?<|im_end|>",
        "Why did the chicken cross the road?\nTo get to the other side.<|im_end|>",
    ],
    "tools": [
        tool_call_text("get_weather", '{"city": "Zürich"}')
        + "\n"
        + tool_call_text("get_weather", '{"city": "Paris"}')
        + "<|im_end|>",
        "Zürich: 12°C and rain; Paris: 18°C and sunny.<|im_end|>",
    ],
    "content_and_tool_call": [
        "Let me check.\n" + tool_call_text("get_weather", '{"city": "Oslo"}') + "<|im_end|>",
        "It is -3°C in Oslo.<|im_end|>",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ASSISTANT_SPANS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_assistant_mask_matches_assistant_spans(
    tok: AutoTokenizer, name: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    tools = [WEATHER_TOOL] if with_tools else None
    conv = CONVERSATIONS[name]
    ids, mask = tok.encode_chat(conv, tools=tools, add_generation_prompt=add_generation_prompt)
    text = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt)
    assert ids == tok.encode(text)
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    assert masked_runs(tok, ids, mask) == EXPECTED_ASSISTANT_SPANS[name]
    # the header right before each run stays unmasked
    header = tok.encode("<|im_start|>assistant\n")
    for start in (i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])):
        assert ids[start - len(header) : start] == header
        assert not any(mask[start - len(header) : start])


def test_mask_without_assistant_is_all_zero(tok: AutoTokenizer) -> None:
    ids, mask = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(ids) == len(mask) and not any(mask)


def test_mask_with_other_template(tok: AutoTokenizer) -> None:
    """The mask does not depend on ChatML: any prefix-stable template works."""
    template = (
        "{{ bos_token }}{% for m in messages %}### {{ m.role }}:\n{{ m.content }}{{ eos_token }}\n\n"
        "{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"
    )
    t = AutoTokenizer(
        tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, chat_template=template
    )
    conv = CONVERSATIONS["multi_turn"]
    ids, mask = t.encode_chat(conv)
    assert masked_runs(t, ids, mask) == [
        m["content"] + tok.eos_token for m in conv if m["role"] == "assistant"
    ]


def test_mask_rejects_prefix_unstable_template(tok: AutoTokenizer) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% if loop.last %} [last]{% endif %}\n{% endfor %}"
    )
    t = AutoTokenizer(tok.backend, eos_token=tok.eos_token, chat_template=template)
    with pytest.raises(TemplateError, match="not prefix-stable"):
        t.encode_chat(CONVERSATIONS["multi_turn"])


def test_named_templates_pick_tool_use(tok: AutoTokenizer) -> None:
    t = AutoTokenizer(
        tok.backend, chat_template={"default": "plain", "tool_use": "tools:{{ tools | length }}"}
    )
    user = [{"role": "user", "content": "x"}]
    assert t.apply_chat_template(user) == "plain"
    assert t.apply_chat_template(user, tools=[WEATHER_TOOL]) == "tools:1"
    assert t.chat_template == "plain"


def test_named_templates_round_trip(tok: AutoTokenizer, tmp_path: Path) -> None:
    templates = {"default": "plain", "tool_use": "tools:{{ tools | length }}"}
    t = AutoTokenizer(tok.backend, chat_template=templates)
    assert t.chat_templates == templates
    t.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == [{"name": n, "template": s} for n, s in templates.items()]
    assert AutoTokenizer.from_pretrained(tmp_path).chat_templates == templates
    # template files take priority over the config, as in transformers
    (tmp_path / "chat_template.jinja").write_text("file")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("file-tools")
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_templates == {"default": "file", "tool_use": "file-tools"}
