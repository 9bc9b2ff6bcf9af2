"""Interop with HF transformers, both directions (no network: everything is local)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import transformers
from tokenizer_cases import CONVERSATIONS, MULTILINGUAL, WEATHER_TOOL
from tokenizers import Tokenizer

from astrai.tokenizer import AutoTokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2\n",
    *MULTILINGUAL,
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call> <think>ok</think>",
    "  leading spaces and trailing   ",
]

# A template in the Llama-3 style: uses bos_token and a different turn format.
LLAMA_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + ' says\\n\\n' + (message['content'] or '') | trim + '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if tools %}{{- '\\n[tools: ' + tools | map(attribute='function.name') | join(', ') + ']' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant says\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def hf_from_ours(saved_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.PreTrainedTokenizerFast.from_pretrained(saved_dir)


def test_hf_loads_our_directory_same_ids(
    tok: AutoTokenizer, hf_from_ours: transformers.PreTrainedTokenizerBase, saved_dir: Path
) -> None:
    hf = hf_from_ours
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (
        tok.bos_token,
        tok.eos_token,
        tok.pad_token,
    )
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len(hf) == tok.vocab_size
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.encode(text) == tok.encode(text, add_special_tokens=True)
        assert hf.decode(ids) == tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    # the Auto class resolves our tokenizer_class too
    auto = transformers.AutoTokenizer.from_pretrained(saved_dir)
    assert auto.encode(TEXTS[2], add_special_tokens=False) == tok.encode(TEXTS[2])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_hf_renders_default_template_identically(
    tok: AutoTokenizer,
    hf_from_ours: transformers.PreTrainedTokenizerBase,
    name: str,
    with_tools: bool,
    add_generation_prompt: bool,
) -> None:
    conv = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if with_tools else None
    ours = tok.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt)
    theirs = hf_from_ours.apply_chat_template(
        copy.deepcopy(conv),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    assert ours == theirs
    theirs_ids = hf_from_ours.apply_chat_template(
        copy.deepcopy(conv),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    assert tok.encode_chat(conv, tools=tools, add_generation_prompt=add_generation_prompt)[
        0
    ] == list(theirs_ids)


def write_hf_dir(
    tok: AutoTokenizer, path: Path, chat_template: str
) -> transformers.PreTrainedTokenizerBase:
    """An HF-written tokenizer directory (whatever layout this transformers version uses)."""
    backend = Tokenizer.from_str(tok.backend.to_str())
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        chat_template=chat_template,
    )
    hf.save_pretrained(path)
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)


def test_we_load_hf_directory(tok: AutoTokenizer, tmp_path: Path) -> None:
    hf = write_hf_dir(tok, tmp_path, LLAMA_STYLE_TEMPLATE)
    ours = AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == LLAMA_STYLE_TEMPLATE
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        hf.bos_token,
        hf.eos_token,
        hf.pad_token,
    )
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=True) == hf.encode(text)
    for conv in CONVERSATIONS.values():
        for gen in (False, True):
            for tools in (None, [WEATHER_TOOL]):
                expected = hf.apply_chat_template(
                    copy.deepcopy(conv), tools=tools, add_generation_prompt=gen, tokenize=False
                )
                assert (
                    ours.apply_chat_template(conv, tools=tools, add_generation_prompt=gen)
                    == expected
                )
    assert ours.apply_chat_template(CONVERSATIONS["multi_turn"]).startswith(tok.bos_token)


def test_hf_directory_with_config_variants(tok: AutoTokenizer, tmp_path: Path) -> None:
    """Older layouts: template list in tokenizer_config, AddedToken dicts, eos lists,
    and a generation_config.json with several eos ids."""
    write_hf_dir(tok, tmp_path, "unused")
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D:{{ messages | length }}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}"},
    ]
    config["bos_token"] = {"__type": "AddedToken", "content": tok.bos_token, "special": True}
    config["eos_token"] = {"__type": "AddedToken", "content": tok.eos_token, "special": True}
    config_path.write_text(json.dumps(config))
    think_end = tok.token_to_id("</think>")
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.eos_token_id, think_end]})
    )

    ours = AutoTokenizer.from_pretrained(tmp_path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert ours.bos_token == tok.bos_token and ours.eos_token == tok.eos_token
    assert ours.stop_ids == [tok.eos_token_id, tok.token_to_id("<|im_end|>"), think_end]
    user = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(user) == hf.apply_chat_template(user, tokenize=False) == "D:1"
    assert (
        ours.apply_chat_template(user, tools=[WEATHER_TOOL])
        == hf.apply_chat_template(user, tools=[WEATHER_TOOL], tokenize=False)
        == "T:1"
    )

    # an eos list in tokenizer_config: first is eos, the rest are extra stop tokens
    config["eos_token"] = [tok.eos_token, "</tool_call>"]
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").unlink()
    listed = AutoTokenizer.from_pretrained(tmp_path)
    assert listed.eos_token == tok.eos_token
    assert listed.stop_ids == [
        tok.eos_token_id,
        tok.token_to_id("<|im_end|>"),
        tok.token_to_id("</tool_call>"),
    ]


# Written like Hub templates: relies on trim_blocks/lstrip_blocks, namespace, tojson options.
HUB_STYLE_TEMPLATES = [
    """{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'user' %}
        {% set ns.n = ns.n + 1 %}
<user {{ ns.n }}>{{ message['content'] }}</user>
    {% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}
        {% for call in message['tool_calls'] %}
<call>{{ call['function'] | tojson(indent=2, sort_keys=true) }}</call>
        {% endfor %}
    {% else %}
<{{ message['role'] }}>{{ message['content'] }}</{{ message['role'] }}>
    {% endif %}
{% endfor %}
{% if tools is not none %}
    {% for t in tools %}{{ t | tojson(separators=(',', ':')) }}{% endfor %}
{% endif %}
{% if add_generation_prompt %}
<assistant>
{% endif %}""",
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "(message['content'] or '') + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
]


@pytest.mark.parametrize("index", range(len(HUB_STYLE_TEMPLATES)))
def test_environment_matches_hf(
    tok: AutoTokenizer, hf_from_ours: transformers.PreTrainedTokenizerBase, index: int
) -> None:
    """Same Jinja options, filters and globals as transformers: identical output."""
    source = HUB_STYLE_TEMPLATES[index]
    ours = AutoTokenizer(tok.backend, eos_token=tok.eos_token, chat_template=source)
    for conv in CONVERSATIONS.values():
        for tools in (None, [WEATHER_TOOL]):
            expected = hf_from_ours.apply_chat_template(
                copy.deepcopy(conv),
                tools=tools,
                add_generation_prompt=True,
                chat_template=source,
                tokenize=False,
            )
            assert (
                ours.apply_chat_template(conv, tools=tools, add_generation_prompt=True) == expected
            )
