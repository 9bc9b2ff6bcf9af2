"""Training, round trips, special tokens, offsets, fingerprint and saving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizer_cases import VOCAB_SIZE, corpus_texts

from astrai.tokenizer import DEFAULT_CHAT_TEMPLATE, AutoTokenizer
from astrai.tokenizer.tokenizer import DEFAULT_ADDED_TOKENS, DEFAULT_SPECIAL_TOKENS

ROUND_TRIP_TEXTS = {
    "ascii": "Hello, world! def f(x):\n    return x ** 2  # comment\n",
    "empty": "",
    "whitespace": " \t\n\n   \r\n  ",
    "chinese": "中文测试：今天天气很好，我们去公园散步。汉字不在训练里：龘靐齉",
    "emoji": "emoji 😀🎉👍 family 👨‍👩‍👧‍👦 flag 🇨🇭 skin 👋🏽",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0335\u0321a\u0336l\u0337g\u0338o",
    "mixed": "Ünïcödé café — 日本語 — Русский — العربية — हिन्दी — 한국어",
    "rare": "\x00\x01\x7f \u200b\ufeff \U0001f9ec \U00010348",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|begin_of_text|><tool_call>{}</tool_call><think>x</think>",
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_TEXTS))
def test_round_trip(tok: AutoTokenizer, name: str) -> None:
    text = ROUND_TRIP_TEXTS[name]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_vocab_and_special_tokens(tok: AutoTokenizer) -> None:
    assert tok.vocab_size == len(tok) == VOCAB_SIZE
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token == "<|end_of_text|>"
    assert tok.pad_token == "<|pad|>"
    ids = {t: tok.token_to_id(t) for t in DEFAULT_SPECIAL_TOKENS + DEFAULT_ADDED_TOKENS}
    assert None not in ids.values()
    assert len(set(ids.values())) == len(ids)
    assert tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token_id == ids["<|end_of_text|>"]
    assert tok.pad_token_id == ids["<|pad|>"]
    assert tok.stop_ids == [ids["<|end_of_text|>"], ids["<|im_end|>"]]
    assert tok.special_ids == sorted(ids[t] for t in DEFAULT_SPECIAL_TOKENS)
    for token, tid in ids.items():
        # each special/added token is one id, also when glued to other text
        assert tok.encode(f"ab{token}cd").count(tid) == 1
        assert tok.id_to_token(tid) == token
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE


def test_skip_special_tokens_keeps_added_tokens(tok: AutoTokenizer) -> None:
    text = "<|im_start|>assistant\n<think>hm</think><tool_call>{}</tool_call><|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>hm</think><tool_call>{}</tool_call>"
    )


def test_add_special_tokens_prepends_bos(tok: AutoTokenizer) -> None:
    plain = tok.encode("hello world")
    with_bos = tok.encode("hello world", add_special_tokens=True)
    assert with_bos == [tok.bos_token_id, *plain]
    assert plain[0] != tok.bos_token_id


def test_any_byte_is_encodable(tok: AutoTokenizer) -> None:
    text = "".join(chr(c) for c in range(1, 0x250)) + "".join(chr(c) for c in range(0x4E00, 0x4F00))
    assert tok.decode(tok.encode(text)) == text


def test_batch_encode_matches_encode(tok: AutoTokenizer) -> None:
    texts = list(ROUND_TRIP_TEXTS.values())
    assert tok.batch_encode(texts) == [tok.encode(t) for t in texts]
    assert tok.batch_encode(texts, add_special_tokens=True) == [
        tok.encode(t, add_special_tokens=True) for t in texts
    ]


def test_encode_with_offsets(tok: AutoTokenizer) -> None:
    text = "def add(a, b):\n    return a + b<|im_end|> 中文"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert len(offsets) == len(ids)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    im_end = ids.index(tok.token_to_id("<|im_end|>"))
    s, e = offsets[im_end]
    assert text[s:e] == "<|im_end|>"
    # ASCII tokens map to exactly their characters
    ascii_part = text.index("<|im_end|>")
    pieces = [text[s:e] for (s, e) in offsets if e <= ascii_part]
    assert "".join(pieces) == text[:ascii_part]


def test_train_rejects_too_small_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        AutoTokenizer.train(["abc"], 100)


def test_train_rejects_non_text() -> None:
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        AutoTokenizer.train(["abc", b"bytes"], 300)  # type: ignore[list-item]


def test_train_custom_tokens() -> None:
    tok = AutoTokenizer.train(
        ["hello world " * 50],
        300,
        special_tokens=["<s>", "</s>"],
        added_tokens=["<x>"],
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )
    assert tok.bos_token_id is not None and tok.eos_token_id == tok.pad_token_id
    assert tok.token_to_id("<|im_end|>") is None
    assert tok.stop_ids == [tok.eos_token_id]
    assert tok.special_ids == sorted([tok.bos_token_id, tok.eos_token_id])
    assert tok.decode(tok.encode("a<x>b"), skip_special_tokens=True) == "a<x>b"


def test_fingerprint_stable_and_sensitive(tok: AutoTokenizer, saved_dir: Path) -> None:
    fp = tok.fingerprint
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert AutoTokenizer.from_pretrained(saved_dir).fingerprint == fp
    reloaded = AutoTokenizer.from_pretrained(saved_dir)
    reloaded.save_pretrained(saved_dir.parent / (saved_dir.name + "_again"))
    assert (
        AutoTokenizer.from_pretrained(saved_dir.parent / (saved_dir.name + "_again")).fingerprint
        == fp
    )
    # a different vocabulary changes it
    other = AutoTokenizer.train(corpus_texts()[:3], VOCAB_SIZE - 100)
    assert other.fingerprint != fp
    # so does a different eos role on the same vocabulary
    swapped = AutoTokenizer(tok.backend, bos_token=tok.bos_token, eos_token="<|im_end|>")
    assert swapped.fingerprint != fp


def test_save_pretrained_layout(tok: AutoTokenizer, saved_dir: Path) -> None:
    names = sorted(p.name for p in saved_dir.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((saved_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["bos_token"] == tok.bos_token
    assert config["eos_token"] == tok.eos_token
    assert config["pad_token"] == tok.pad_token
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert isinstance(config["model_max_length"], int)
    decoder = config["added_tokens_decoder"]
    assert decoder[str(tok.token_to_id("<|im_end|>"))]["special"] is True
    assert decoder[str(tok.token_to_id("<think>"))]["special"] is False
    special_map = json.loads((saved_dir / "special_tokens_map.json").read_text())
    assert special_map["eos_token"] == tok.eos_token


def test_save_overwrites_atomically(tok: AutoTokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{ stale")
    (tmp_path / "chat_template.jinja").write_text("stale {{ messages }}")
    written = tok.save_pretrained(tmp_path)
    assert tmp_path / "chat_template.jinja" in written
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert (tmp_path / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.chat_template == DEFAULT_CHAT_TEMPLATE
    assert again.encode("x 中") == tok.encode("x 中")


def test_extra_stop_tokens_round_trip(tok: AutoTokenizer, tmp_path: Path) -> None:
    t = AutoTokenizer(
        tok.backend,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        pad_token=tok.pad_token,
        extra_stop_tokens=["</tool_call>"],
        model_max_length=4096,
    )
    t.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.stop_ids == [
        tok.eos_token_id,
        tok.token_to_id("<|im_end|>"),
        tok.token_to_id("</tool_call>"),
    ]
    assert loaded.model_max_length == 4096
