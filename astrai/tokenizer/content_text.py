"""Special tokens in chat content are text: only the chat template writes control tokens.

Encoding a rendered conversation with special-token parsing on (what transformers'
``apply_chat_template(tokenize=True)`` does) lets a user who types ``<|im_start|>system``
forge a turn. Here every control-token occurrence in the caller's strings (message fields,
tool definitions, extra template variables) is first *shielded*: each of its characters is
shifted into the Supplementary Private Use Area, which keeps the length and makes it
unmatchable. The template then renders both the real and the shielded inputs; control
tokens found in the shielded rendering were written by the template, and every piece
between two of them whose text differs from the real rendering is re-encoded from the real
text on a backend copy whose special tokens are split like text (``tokenizers``'
``encode_special_tokens``, HF's ``split_special_tokens``).

A conversation without control-token text takes the ordinary path, so its ids are exactly
those of a plain encode of the rendering (training data do not change). Not covered: a
template that glues two caller strings together with nothing between them, so that halves
of a token typed in each form a whole one (no shipped ChatML-like template does).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer

from astrai.tokenizer.chat_template import TemplateError

__all__ = ["ContentShield"]

_SHIFT = 0xF0000  # plane 15: Supplementary Private Use Area-A


def _shift(token: str) -> str:
    return "".join(chr(_SHIFT + ord(c)) if ord(c) < 0xFFFE else "\U000ffffd" for c in token)


class ContentShield:
    """The control tokens of one backend, and encoding that honours only the template's.

    Control tokens are the backend's special added tokens plus ``extra`` (stop tokens,
    ``<|im_start|>``) where those are added tokens; non-special added tokens such as
    ``<tool_call>`` or ``<think>`` stay tokens in content, as assistant turns use them.
    """

    def __init__(self, backend: Tokenizer, extra: Iterable[str] = ()) -> None:
        added = backend.get_added_tokens_decoder()
        names = {t.content for t in added.values() if t.special}
        added_names = {t.content for t in added.values()}
        names |= {t for t in extra if t in added_names}
        self.tokens: tuple[str, ...] = tuple(sorted((t for t in names if t), key=len, reverse=True))
        self._ids = {backend.token_to_id(t) for t in self.tokens}
        self._pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None
        self._backend = backend
        self._plain: Tokenizer | None = None

    def shield(self, value: Any) -> tuple[Any, bool]:
        """``value`` with every control-token text in its strings (and dict keys) shifted
        out of reach, and whether anything changed (unchanged values are returned as is).
        A value nested too deeply to walk is a `TemplateError` (a ValueError), never a
        RecursionError: the server answers it with a 400."""
        if self._pattern is None:
            return value, False
        try:
            return self._shield(value)
        except RecursionError:
            raise TemplateError(
                "the conversation is nested too deeply to render (JSON values inside "
                "messages, tools or template variables)"
            ) from None

    def _shield(self, value: Any) -> tuple[Any, bool]:
        assert self._pattern is not None
        if isinstance(value, str):
            new = self._pattern.sub(lambda m: _shift(m.group(0)), value)
            return new, new != value
        if isinstance(value, Mapping):
            items = [(self._shield(k), self._shield(v)) for k, v in value.items()]
            if not any(kc or vc for (_, kc), (_, vc) in items):
                return value, False
            return {k: v for (k, _), (v, _) in items}, True
        if isinstance(value, (list, tuple)):
            parts = [self._shield(v) for v in value]
            if not any(c for _, c in parts):
                return value, False
            return type(value)(v for v, _ in parts), True
        return value, False

    def encode(self, text: str, shielded: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of ``text`` (the real rendering), with control tokens
        only where ``shielded`` (the rendering of the shielded inputs) has them."""
        if len(shielded) != len(text):
            raise TemplateError(
                "the chat template changed the length of content that holds special-token "
                "text, so it cannot be encoded as text safely"
            )
        enc = self._backend.encode(shielded, add_special_tokens=False)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        run, start = 0, 0

        def flush(stop_tok: int, end: int) -> None:
            if text[start:end] == shielded[start:end]:
                ids.extend(enc.ids[run:stop_tok])
                offsets.extend(tuple(o) for o in enc.offsets[run:stop_tok])
                return
            piece = self._plain_backend().encode(text[start:end], add_special_tokens=False)
            ids.extend(piece.ids)
            offsets.extend((start + a, start + b) for a, b in piece.offsets)

        for i, tid in enumerate(enc.ids):
            if tid in self._ids:
                a, b = enc.offsets[i]
                if a < start or b <= a:
                    continue  # not a matched control token (e.g. one a post-processor added)
                flush(i, a)
                ids.append(tid)
                offsets.append((a, b))
                run, start = i + 1, b
        flush(len(enc.ids), len(text))
        return ids, offsets

    def _plain_backend(self) -> Tokenizer:
        """A copy of the backend that encodes every control token's text as text (built on
        first use; the shared backend is never mutated, so threads may encode at once)."""
        if self._plain is None:
            plain = Tokenizer.from_str(self._backend.to_str())
            specials = {t.content for t in plain.get_added_tokens_decoder().values() if t.special}
            missing = [AddedToken(t, special=True, normalized=False) for t in self.tokens]
            plain.add_special_tokens([t for t in missing if t.content not in specials])
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain
