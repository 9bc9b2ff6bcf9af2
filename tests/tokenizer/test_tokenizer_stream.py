"""Streaming detokenization: exact, and never a broken character for valid text."""

from __future__ import annotations

import random

import pytest
from tokenizer_cases import MULTILINGUAL

from astrai.tokenizer import AutoTokenizer

REPLACEMENT = "\ufffd"


def stream(tok: AutoTokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    dec = tok.stream_decoder(skip_special_tokens=skip_special_tokens)
    pieces = [dec.step(i) for i in ids]
    pieces.append(dec.flush())
    return pieces


@pytest.mark.parametrize("skip", [False, True])
def test_random_ids_concatenate_to_decode(tok: AutoTokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces = stream(tok, ids, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("skip", [False, True])
def test_valid_text_never_yields_replacement_char(tok: AutoTokenizer, skip: bool) -> None:
    texts = [
        *MULTILINGUAL,
        "unseen: 龘靐齉 👨‍👩‍👧‍👦 🇨🇭 e\u0301 \U0001f9ec",
        '<|im_start|>assistant\n中文<think>想</think><tool_call>{"q": "😀"}</tool_call><|im_end|>',
    ]
    held_back = 0
    for text in texts:
        ids = tok.encode(text)
        pieces = stream(tok, ids, skip)
        assert not any(REPLACEMENT in p for p in pieces), (text, pieces)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        held_back += sum(1 for p in pieces[:-1] if p == "")
    # the inputs do split characters over tokens, so the decoder must have held bytes back
    assert held_back > 0


def test_tokens_split_mid_character(tok: AutoTokenizer) -> None:
    """Byte-level tokens of an unseen emoji: no text until the 4th byte arrives."""
    ids = tok.encode("😀")
    assert len(ids) > 1  # the small vocabulary has no token for it
    dec = tok.stream_decoder()
    outs = [dec.step(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "😀"
    assert dec.flush() == ""


def test_truncated_character_is_flushed_like_decode(tok: AutoTokenizer) -> None:
    ids = tok.encode("ok\n😀")[:-1]  # cut the emoji's last byte
    pieces = stream(tok, ids)
    assert "".join(pieces[:-1]) == "ok\n"
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].endswith(REPLACEMENT)


def test_random_slices_of_text(tok: AutoTokenizer) -> None:
    """Start and end anywhere inside multi-byte text: still exactly decode()."""
    ids = tok.encode("".join(MULTILINGUAL))
    rng = random.Random(7)
    for _ in range(100):
        a = rng.randrange(len(ids))
        b = rng.randrange(a + 1, len(ids) + 1)
        assert "".join(stream(tok, ids[a:b])) == tok.decode(ids[a:b])


def test_step_returns_text_promptly(tok: AutoTokenizer) -> None:
    ids = tok.encode("hello world, this is plain ASCII")
    dec = tok.stream_decoder()
    out = ""
    for n, i in enumerate(ids, start=1):
        out += dec.step(i)
        # ASCII text is never held back
        assert out == tok.decode(ids[:n])
    assert dec.flush() == ""
