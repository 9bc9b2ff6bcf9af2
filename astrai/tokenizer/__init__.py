"""Tokenization for astrai: byte-level BPE over HF ``tokenizers``, sandboxed chat templates,
streaming detokenization, and HF-compatible save/load."""

from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, TemplateError
from astrai.tokenizer.stream import StreamDecoder
from astrai.tokenizer.tokenizer import AutoTokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "AutoTokenizer",
    "ChatTemplate",
    "StreamDecoder",
    "TemplateError",
]
