"""Bytes per token and the corpus figures built on them: perplexity and bits per byte.

Cross entropy in nats per token depends on the tokenizer; bits per byte does not: the same
total nats divided by ``ln 2`` times the UTF-8 bytes the target tokens stand for. Training
(``val/bpb``, :mod:`astrai.train.metrics`) and evaluation (:mod:`astrai.eval.perplexity`)
count bytes with the one table here, so their figures agree.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from astrai.tokenizer.tokenizer import AutoTokenizer

if TYPE_CHECKING:  # torch is imported where a table is built: `python -m astrai.eval` checks
    from torch import Tensor  # its suites before torch is imported

log = logging.getLogger(__name__)

__all__ = ["corpus_metrics", "token_byte_lengths"]


# ---------------------------------------------------------------------- bytes per token
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted: the character a byte-level BPE writes for each
    byte, mapped back to that byte (printable bytes stand for themselves, the rest are
    shifted to U+0100 and up)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in chars.items()}


def _is_byte_level(tokenizer: AutoTokenizer) -> bool:
    decoder = tokenizer.backend.decoder
    return decoder is not None and b'"type":"ByteLevel"' in decoder.__getstate__()


def token_byte_lengths(tokenizer: AutoTokenizer, size: int | None = None) -> Tensor:
    """UTF-8 bytes each token id stands for, as an int64 table of ``max(size, vocab)`` rows.

    Byte-level BPE (ours, GPT-2, Llama 3, Qwen): every character of a vocabulary entry is one
    byte in the byte-level alphabet, so a token that holds part of a multi-byte character
    still counts its own bytes (``decode`` would give U+FFFD there). Special tokens (bos,
    eos, pad, chat markers) count 0: they are markup the data pipeline inserts, not text of
    the corpus, and counting them would flatter bpb; their nats still count. Non-special
    added tokens (``<tool_call>``, ``<think>``) stand for literal text and count its bytes.
    Other tokenizers (SentencePiece style) count ``<0xNN>`` byte-fallback pieces as 1 and
    other pieces as their UTF-8 with ``▁`` as a space, an approximation (logged).
    Rows past the tokenizer's vocabulary (a padded embedding) count 0.
    """
    import torch

    backend = tokenizer.backend
    table = torch.zeros(max(size or 0, tokenizer.vocab_size), dtype=torch.long)
    added = backend.get_added_tokens_decoder()
    alphabet = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
    if alphabet is None:
        log.warning("bits per byte: %r is not byte-level; byte counts are approximate", tokenizer)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i in added:
            table[i] = 0 if added[i].special else len(added[i].content.encode("utf-8"))
        elif alphabet is not None and all(c in alphabet for c in token):
            table[i] = len(token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            table[i] = 1
        else:
            table[i] = len(token.replace("▁", " ").encode("utf-8"))
    return table


# ---------------------------------------------------------------------- corpus sums
def corpus_metrics(nats: float, tokens: float, num_bytes: float) -> dict[str, float]:
    """``{"ppl": exp(nats / tokens), "bpb": nats / (ln 2 * bytes)}`` (bpb only when bytes
    are known, ppl only when there are tokens)."""
    out: dict[str, float] = {}
    if tokens > 0:
        out["ppl"] = math.exp(nats / tokens)
    if num_bytes > 0:
        out["bpb"] = nats / (math.log(2) * num_bytes)
    return out
