"""Token log-probs in the shapes of the OpenAI APIs (chat `content` list, legacy arrays).

The engine reports token ids with their raw log-probs and top alternatives; this module
turns them into what clients parse. Token strings are the token's own bytes as UTF-8, or
OpenAI's ``bytes:\\xNN`` spelling when a token holds part of a multi-byte character.

JSON has no infinities or NaN. A log-prob of -inf (a token the model rules out) is sent
as vLLM's ``-9999.0``; NaN or +inf means the model's numbers broke down (NaN or infinite
logits), which no log-prob can stand for: the request gets a protocol error, a 422 in its
protocol's shape with code ``non_finite_logprob`` (a stream ends with that error event). Not a
500: the answer is the same on every retry (SDKs retry 5xx), and the same request without
log-probs is answered.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import decoders

from astrai.serve.errors import APIError
from astrai.tokenizer import AutoTokenizer

Top = Sequence[tuple[int, float]]

# vLLM's (and OpenAI's) stand-in for a log-prob of -inf.
MIN_LOGPROB = -9999.0


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
        # What the output's text leaves out (it is decoded with skip_special_tokens).
        self.special: frozenset[int] = frozenset(tokenizer.special_ids)
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


def json_logprob(value: float, token: str) -> float:
    """`value` as JSON can carry it (-inf: `MIN_LOGPROB`); NaN or +inf: a 422 naming the
    token, since no number would tell the truth about it."""
    if math.isfinite(value):
        return value
    if value == -math.inf:
        return MIN_LOGPROB
    raise APIError(
        422,
        f"logprobs: the model gave token {token!r} a log-prob of {value}: its logits are not "
        "finite (NaN or infinite), so the output cannot be trusted or sent as JSON; the same "
        "request without logprobs is answered",
        param="logprobs",
        code="non_finite_logprob",
    )


def _sorted(top: Top | None) -> list[tuple[int, float]]:
    return sorted(top or (), key=lambda t: -t[1])


def chat_entries(
    tt: TokenText, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top | None]
) -> list[dict]:
    """Chat `logprobs.content` entries: token, logprob, bytes, top_logprobs (descending)."""
    out = []
    for tok, lp, top in zip(ids, logprobs, tops, strict=True):
        text = tt.text(tok)
        out.append(
            {
                "token": text,
                "logprob": json_logprob(lp, text),
                "bytes": list(tt.bytes(tok)),
                "top_logprobs": [
                    {
                        "token": tt.text(t),
                        "logprob": json_logprob(v, tt.text(t)),
                        "bytes": list(tt.bytes(t)),
                    }
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
        self,
        ids: Sequence[int],
        logprobs: Sequence[float | None],
        tops: Sequence[Top | None],
        *,
        text_len: int,
        skipped: Collection[int] = frozenset(),
    ) -> dict:
        """Entries for `ids`; a None log-prob (the first prompt token) has no top dict.

        `text_offset` is where each token starts in the choice's text, of which `text_len`
        characters exist so far: tokens in `skipped` (the special tokens the output's text
        leaves out) take no room, and no offset ever points past the text (a stop string
        cuts the text inside a step's tokens)."""
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for tok, lp, top in zip(ids, logprobs, tops, strict=True):
            text = self.tt.text(tok)
            lp = None if lp is None else json_logprob(lp, text)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["text_offset"].append(min(self.offset, text_len))
            if tok not in skipped:
                self.offset += len(self._utf8.decode(self.tt.bytes(tok)))
            if lp is None:
                out["top_logprobs"].append(None)
                continue
            alternatives: dict[str, float] = {}
            for t, v in _sorted(top):
                alt = self.tt.text(t)
                alternatives.setdefault(alt, lp if t == tok else json_logprob(v, alt))
            alternatives.setdefault(text, lp)
            out["top_logprobs"].append(alternatives)
        return out

    @staticmethod
    def merge(parts: Sequence[dict]) -> dict:
        """One object from consecutive `build` results."""
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [x for p in parts for x in p[k]] for k in keys}
