"""Bad input gets a clear error that names the file or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from astrai.tokenizer import AutoTokenizer


@pytest.fixture
def copy_dir(saved_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "tok"
    shutil.copytree(saved_dir, dst)
    return dst


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        AutoTokenizer.from_pretrained(missing)


def test_missing_tokenizer_json(copy_dir: Path) -> None:
    (copy_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        AutoTokenizer.from_pretrained(copy_dir)


def test_corrupt_tokenizer_config(copy_dir: Path) -> None:
    (copy_dir / "tokenizer_config.json").write_text('{"bos_token": "<|begin_of_text|>",')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json.*invalid JSON"):
        AutoTokenizer.from_pretrained(copy_dir)


def test_corrupt_tokenizer_json(copy_dir: Path) -> None:
    (copy_dir / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": [1, 2')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        AutoTokenizer.from_pretrained(copy_dir)


def test_bad_fields_name_the_field(copy_dir: Path) -> None:
    path = copy_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for field, value, pattern in [
        ("eos_token", 42, "eos_token"),
        ("chat_template", 42, "chat_template"),
        ("chat_template", [{"name": "default"}], r"chat_template\[0\]"),
        ("model_max_length", "long", "model_max_length"),
    ]:
        path.write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=pattern):
            AutoTokenizer.from_pretrained(copy_dir)


def test_unknown_special_token(copy_dir: Path) -> None:
    path = copy_dir / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "pad_token": "<|not-there|>"}))
    with pytest.raises(
        ValueError, match=r"pad_token '<\|not-there\|>' is not in the vocabulary"
    ) as e:
        AutoTokenizer.from_pretrained(copy_dir)
    assert str(copy_dir) in str(e.value)


def test_bad_generation_config(copy_dir: Path) -> None:
    (copy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    with pytest.raises(ValueError, match=r"generation_config\.json.*outside the vocabulary"):
        AutoTokenizer.from_pretrained(copy_dir)
    (copy_dir / "generation_config.json").write_text("not json")
    with pytest.raises(ValueError, match=r"generation_config\.json"):
        AutoTokenizer.from_pretrained(copy_dir)


def test_missing_config_still_loads(copy_dir: Path, tok: AutoTokenizer) -> None:
    """A bare tokenizer.json is usable; only the metadata is missing."""
    (copy_dir / "tokenizer_config.json").unlink()
    (copy_dir / "special_tokens_map.json").unlink()
    loaded = AutoTokenizer.from_pretrained(copy_dir)
    assert loaded.encode("abc 中") == tok.encode("abc 中")
    assert loaded.eos_token is None
    assert loaded.stop_ids == [tok.token_to_id("<|im_end|>")]
    bare = AutoTokenizer.from_file(copy_dir / "tokenizer.json", eos_token=tok.eos_token)
    assert bare.eos_token_id == tok.eos_token_id


def test_constructor_rejects_non_tokenizer() -> None:
    with pytest.raises(TypeError, match=r"tokenizers\.Tokenizer"):
        AutoTokenizer("not a tokenizer")  # type: ignore[arg-type]


def test_bare_tokenizer_json_file(saved_dir: Path, tok: AutoTokenizer, tmp_path: Path) -> None:
    """from_pretrained also takes a tokenizer.json file (no metadata), but no other file."""
    loaded = AutoTokenizer.from_pretrained(saved_dir / "tokenizer.json")
    assert loaded.encode("abc 中") == tok.encode("abc 中")
    assert loaded.eos_token is None
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="expected a tokenizer directory"):
        AutoTokenizer.from_pretrained(tmp_path / "notes.txt")
