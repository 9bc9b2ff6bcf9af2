"""The chat templates of Qwen3, Llama 3.1, Mistral, DeepSeek-V3 and GPT-OSS render in astrai
exactly as in transformers' `apply_chat_template` (text and ids), with tools, tool calls,
tool results and thinking, and `tool_parser=auto` picks each family's parser from its text
(and `reasoning_parser=auto` GPT-OSS's harmony parser).

The templates are local copies (tests/tokenizer/family_templates/), never downloaded:
- qwen3.jinja: Qwen/Qwen3-8B's `chat_template` (tokenizer_config.json,
  https://huggingface.co/Qwen/Qwen3-8B), as quoted verbatim in the code index.
- llama3.1_json.jinja: vLLM examples/tool_chat_template_llama3.1_json.jinja
  (https://github.com/vllm-project/vllm, commit 545227602f25).
- mistral.jinja: vLLM examples/tool_chat_template_mistral.jinja (commit 2d4b302af306).
- deepseekv3.jinja: vLLM examples/tool_chat_template_deepseekv3.jinja (commit 7531ada7db29).
- gpt_oss.jinja: openai/gpt-oss-20b's chat_template.jinja (https://huggingface.co/openai/
  gpt-oss-20b, "Update chat_template.jinja (#94)"), from a GitHub mirror of that repository
  (EchoCog/gpt-oss-20b, commit cbf31f62664d); Apache-2.0.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import transformers
from tokenizer_cases import corpus_texts

from astrai.serve.reasoning import resolve_reasoning_parser
from astrai.serve.tool_parsers import detect
from astrai.tokenizer import AutoTokenizer

HERE = Path(__file__).parent / "family_templates"

# family: (template file, bos, eos, the family's other control tokens, auto's parser)
FAMILIES = {
    "qwen3": ("qwen3.jinja", "<|endoftext|>", "<|im_end|>", ["<|im_start|>"], "hermes"),
    "llama3": (
        "llama3.1_json.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"],
        "llama3_json",
    ),
    "mistral": (
        "mistral.jinja",
        "<s>",
        "</s>",
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "mistral",
    ),
    "deepseek": (
        "deepseekv3.jinja",
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        [
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
        ],
        "hermes",  # no DeepSeek parser: auto falls back to hermes
    ),
    "gpt_oss": (
        "gpt_oss.jinja",
        "<|startoftext|>",
        "<|return|>",
        ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>"],
        "openai",
    ),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City, e.g. Zürich"},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    }
]
ARGS = {"city": "Zürich", "days": 2}


def _call(family: str) -> dict:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ARGS},
    }
    return call


def conversations(family: str) -> dict[str, tuple[list[dict], dict]]:
    """name -> (messages, template kwargs); each family's own conventions (Mistral writes
    a call as its content, Llama wants the tools' first user message)."""
    call = _call(family)
    content = (
        json.dumps([{"name": "get_weather", "arguments": ARGS}]) if family == "mistral" else ""
    )
    calling = {"role": "assistant", "content": content, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}
    user = {"role": "user", "content": "Weather in Zürich?"}
    extra = {"date_string": "26 Jul 2024"} if family == "llama3" else {}
    convs = {
        "tools_prompt": ([user], extra),
        "tool_call_and_result": ([user, calling, result], extra),
        "system_multi_turn": (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi 你好"},
                {"role": "assistant", "content": "Hello!"},
                user,
            ],
            extra,
        ),
    }
    if family == "qwen3":
        think = {
            "role": "assistant",
            "content": "<think>\nIt is cold there.\n</think>\n\nTake a coat.",
        }
        convs["thinking_in_content"] = ([user, think], {})
        convs["reasoning_content_field"] = (
            [user, {"role": "assistant", "content": "Take a coat.", "reasoning_content": "Cold."}],
            {},
        )
        convs["thinking_then_tool"] = (
            [user, {**calling, "content": "<think>\nlook up\n</think>\n\n"}, result],
            {},
        )
        convs["thinking_disabled"] = ([user], {"enable_thinking": False})
    return convs


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    file, bos, eos, specials, _ = FAMILIES[name]
    template = (HERE / file).read_text(encoding="utf-8")
    ours = AutoTokenizer.train(
        corpus_texts()[:4],
        400,
        special_tokens=[bos, eos, "<pad>", *specials],
        bos_token=bos,
        eos_token=eos,
        pad_token="<pad>",
        chat_template=template,
    )
    path = tmp_path_factory.mktemp(f"tok_{name}")
    ours.save_pretrained(path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    assert hf.chat_template == template
    return name, ours, hf


def test_renders_as_transformers(family):
    name, ours, hf = family
    for conv, (messages, extra) in conversations(name).items():
        for tools in (TOOLS, None):
            for gen in (True, False):
                if gen and messages[-1]["role"] == "assistant":
                    continue
                kw = dict(tools=tools, add_generation_prompt=gen, **extra)
                want = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
                got = ours.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
                assert got == want, (name, conv, tools is not None, gen)
                ids = hf.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kw)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
                assert ours.apply_chat_template(messages, tokenize=True, **kw) == list(ids)


def test_renderings_carry_the_calls_and_thinking(family):
    """The comparison above is not vacuous: the call's arguments, the tool result and
    (Qwen3) the thinking are in the text."""
    name, ours, _ = family
    convs = conversations(name)
    messages, extra = convs["tool_call_and_result"]
    text = ours.apply_chat_template(messages, tools=TOOLS, **extra)
    assert "get_weather" in text and "temp_c" in text and "days" in text
    assert "Z\\u00fcrich" in text or "Zürich" in text
    if name == "qwen3":
        msgs, _ = convs["thinking_in_content"]
        assert "<think>\nIt is cold there.\n</think>\n\nTake a coat." in ours.apply_chat_template(
            msgs
        )
        off = ours.apply_chat_template(
            convs["thinking_disabled"][0], add_generation_prompt=True, enable_thinking=False
        )
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_auto_picks_the_family_parser(family):
    name, ours, _ = family
    assert detect(ours.chat_template) == FAMILIES[name][4]
    harmony = resolve_reasoning_parser("auto", ours) == "openai_gptoss"
    assert harmony is (name == "gpt_oss")


def test_gpt_oss_renders_harmony_messages():
    """The harmony shapes the server's parser reads: the generation prompt opens an
    assistant message, a call goes to `functions.NAME` on the commentary channel with its
    JSON arguments and ends with `<|call|>`, its result comes from `functions.NAME`, and the
    reasoning effort reaches the system message."""
    template = (HERE / "gpt_oss.jinja").read_text(encoding="utf-8")
    tok = AutoTokenizer.train(
        corpus_texts()[:4],
        400,
        special_tokens=["<|startoftext|>", "<|return|>", "<pad>"],
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<pad>",
        chat_template=template,
    )
    messages, _ = conversations("gpt_oss")["tool_call_and_result"]
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, reasoning_effort="high"
    )
    call = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    assert call + json.dumps(ARGS, ensure_ascii=False) + "<|call|>" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
