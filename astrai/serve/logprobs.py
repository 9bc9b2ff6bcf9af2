"""Token log-probs in the shapes of the OpenAI APIs (chat `content` list, legacy arrays).

The engine reports token ids with their raw log-probs and top alternatives; this module
turns them into what clients parse. Token strings are the token's own bytes as UTF-8, or
OpenAI's ``bytes:\\xNN`` spelling when a token holds part of a multi-byte character.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import decoders

from astrai.tokenizer import AutoTokenizer

Top = Sequence[tuple[int, float]]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of every byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = _byte_decoder()


class TokenText:
    """Per-token bytes and display strings of one tokenizer (cached: tokens repeat a lot)."""

    def __init__(self, tokenizer: AutoTokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)
        self.text = lru_cache(maxsize=65536)(self._text)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id) if self.byte_level else None
        if piece and all(c in _BYTES for c in piece):
            return bytes(_BYTES[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()

    def _text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@lru_cache(maxsize=8)
def token_text(tokenizer: AutoTokenizer) -> TokenText:
    """The shared `TokenText` of a tokenizer (a server has one; its cache then fills once)."""
    return TokenText(tokenizer)


def _sorted(top: Top | None) -> list[tuple[int, float]]:
    return sorted(top or (), key=lambda t: -t[1])


def chat_entries(
    tt: TokenText, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top | None]
) -> list[dict]:
    """Chat `logprobs.content` entries: token, logprob, bytes, top_logprobs (descending)."""
    out = []
    for tok, lp, top in zip(ids, logprobs, tops, strict=True):
        out.append(
            {
                "token": tt.text(tok),
                "logprob": lp,
                "bytes": list(tt.bytes(tok)),
                "top_logprobs": [
                    {"token": tt.text(t), "logprob": v, "bytes": list(tt.bytes(t))}
                    for t, v in _sorted(top)
                ],
            }
        )
    return out


@dataclass
class LegacyLogprobs:
    """Builds legacy `logprobs` objects; `offset` carries `text_offset` across stream chunks.

    Every top dict also holds the chosen token (OpenAI: "up to logprobs+1 elements"), with
    the chosen token's own log-prob, so `chosen == max(top.values())` exactly when it is
    the argmax: the greedy test lm-eval's `local-completions` applies.
    """

    tt: TokenText
    offset: int = 0

    def __post_init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(
        self, ids: Sequence[int], logprobs: Sequence[float | None], tops: Sequence[Top | None]
    ) -> dict:
        """Entries for `ids`; a None log-prob (the first prompt token) has no top dict."""
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for tok, lp, top in zip(ids, logprobs, tops, strict=True):
            text = self.tt.text(tok)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["text_offset"].append(self.offset)
            self.offset += len(self._utf8.decode(self.tt.bytes(tok)))
            if lp is None:
                out["top_logprobs"].append(None)
                continue
            alternatives: dict[str, float] = {}
            for t, v in _sorted(top):
                alternatives.setdefault(self.tt.text(t), lp if t == tok else v)
            alternatives.setdefault(text, lp)
            out["top_logprobs"].append(alternatives)
        return out

    @staticmethod
    def merge(parts: Sequence[dict]) -> dict:
        """One object from consecutive `build` results."""
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [x for p in parts for x in p[k]] for k in keys}
