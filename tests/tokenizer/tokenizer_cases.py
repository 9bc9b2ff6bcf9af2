"""Inputs shared by the tokenizer tests (not collected: no test_ prefix)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

VOCAB_SIZE = 800

# Multilingual lines so that some merges join bytes of multi-byte characters (and cut
# characters in the middle), which is what the stream decoder must cope with.
MULTILINGUAL = [
    "中文测试：今天天气很好，我们去公园散步。",
    "日本語のテキストです。東京は大きい都市です。",
    "Ünïcödé wörds: café, naïve, façade, Zürich, smörgåsbord.",
    "Русский текст для проверки токенизатора.",
    "emoji 😀🎉👍 and more 🚀✨",
]


def corpus_texts() -> list[str]:
    """~0.5 MB of Python stdlib source plus some non-Latin lines (local, deterministic)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size < 200_000)[:20]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return texts + MULTILINGUAL * 40


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS: dict[str, list[dict]] = {
    "system_user_assistant": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 = 4."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi! 你好"},
        {"role": "assistant", "content": "Hello 😀 how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {
            "role": "assistant",
            "content": "Why did the chicken cross the road?\nTo get to the other side.",
        },
        {"role": "user", "content": "Thanks"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "12°C, rain"},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18°C, sun"},
        {"role": "assistant", "content": "Zürich: 12°C and rain; Paris: 18°C and sunny."},
    ],
    "content_and_tool_call": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "-3°C"},
        {"role": "assistant", "content": "It is -3°C in Oslo."},
    ],
}
