"""Incremental detokenization for streaming: text as soon as it is final, never a broken
character."""

from __future__ import annotations

from tokenizers import Tokenizer

__all__ = ["StreamDecoder"]

_REPLACEMENT_CHAR = "\ufffd"


class StreamDecoder:
    """Incremental detokenizer: feed ids one by one, get text as soon as it is final.

    Decoding one token at a time breaks multi-byte characters (a Chinese character or an
    emoji is often split over several byte-level tokens) and ignores decoder context (e.g.
    SentencePiece's leading-space rule). Instead this keeps a small window of ids, like
    vLLM's detokenizer: ``prefix_offset`` marks where the window starts and ``read_offset``
    where the text already returned ends. Each step decodes the window with and without the
    new ids and returns the difference, but only once it does not end in U+FFFD, i.e. once
    the pending bytes form complete characters. Both offsets only ever sit on such clean
    boundaries, so the concatenation of all ``step`` outputs plus ``flush`` equals
    ``decode(all_ids)`` exactly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _pending(self) -> tuple[str, str]:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        return prefix_text, new_text

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial)."""
        self._ids.append(int(token_id))
        prefix_text, new_text = self._pending()
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes to U+FFFD,
        exactly as ``decode`` of the whole sequence would render it)."""
        prefix_text, new_text = self._pending()
        out = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        if out:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return out
