"""Names of the special and added tokens of astrai's chat format.

Kept apart from the tokenizer class so that BPE training, the tokenizer and the chat code
share one spelling of each token without importing one another.
"""

from __future__ import annotations

__all__ = [
    "BOS_TOKEN",
    "DEFAULT_ADDED_TOKENS",
    "DEFAULT_SPECIAL_TOKENS",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
)
# Not special: decode(skip_special_tokens=True) keeps them, since tool calls and reasoning
# are part of the answer that the server parses.
DEFAULT_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
