"""Reading and writing HF tokenizer directories, and the tokenizer fingerprint.

The layout is the one ``transformers`` uses (``tokenizer.json`` plus
``tokenizer_config.json``, ``special_tokens_map.json`` and optional chat-template and
generation-config files), so our checkpoints load in ``transformers`` and HF checkpoints
load here. Every parse error names the file and field, since these files are often edited
by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from astrai.files import naming_full_disk, publish

logger = logging.getLogger(__name__)

__all__ = [
    "TokenizerFiles",
    "load_tokenizer_json",
    "read_tokenizer_dir",
    "tokenizer_fingerprint",
    "write_tokenizer_dir",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# What transformers writes when a tokenizer has no length limit of its own.
_HF_VERY_LARGE_INTEGER = int(1e30)


@dataclass
class TokenizerFiles:
    """What a tokenizer directory holds: the ``tokenizers`` backend plus the metadata HF
    keeps beside it. ``chat_templates=None`` means the directory names no template."""

    backend: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_templates: dict[str, str] | None = None
    extra_stop_tokens: list[str] = field(default_factory=list)
    model_max_length: int | None = None


# --------------------------------------------------------------------------- reading


def load_tokenizer_json(path: Path) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``, with errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found (astrai needs a fast tokenizer saved as tokenizer.json)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path}: cannot be read as a tokenizers JSON file: {e}") from e


def read_tokenizer_dir(root: Path) -> TokenizerFiles:
    """Read our directory or an HF tokenizer directory (fast tokenizers only).

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
    chat template, ``model_max_length``), ``special_tokens_map.json``,
    ``chat_template.jinja`` / ``additional_chat_templates/*.jinja`` (which, as in
    transformers, take priority over the config's template) and ``generation_config.json``
    (extra stop ids).
    """
    if not root.exists():
        raise FileNotFoundError(f"tokenizer directory not found: {root}")
    if root.is_file():
        raise ValueError(f"{root}: expected a tokenizer directory or a tokenizer.json file")
    tokenizer = load_tokenizer_json(root / TOKENIZER_FILE)

    config_path = root / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        config = _read_json(config_path)
        if not isinstance(config, Mapping):
            raise ValueError(f"{config_path}: expected a JSON object at top level")
    else:
        logger.warning("%s not found; loading without special-token metadata", config_path)
        config = {}
    map_path = root / SPECIAL_TOKENS_MAP_FILE
    special_map = _read_json(map_path) if map_path.is_file() else {}
    if not isinstance(special_map, Mapping):
        raise ValueError(f"{map_path}: expected a JSON object at top level")

    def token(name: str) -> str | None:
        if name in config:
            return _token_content(config[name], name, config_path)
        return _token_content(special_map.get(name), name, map_path)

    extra_stop: list[str] = []
    raw_eos = config.get("eos_token", special_map.get("eos_token"))
    if isinstance(raw_eos, list):  # some configs list several eos tokens
        eos_list = [_token_content(t, "eos_token", config_path) for t in raw_eos]
        eos_list = [t for t in eos_list if t is not None]
        eos = eos_list[0] if eos_list else None
        extra_stop.extend(eos_list[1:])
    else:
        eos = token("eos_token")
    saved_stop = config.get("extra_stop_tokens", [])
    if not isinstance(saved_stop, list) or not all(isinstance(t, str) for t in saved_stop):
        raise ValueError(f"{config_path}: 'extra_stop_tokens' must be a list of strings")
    extra_stop.extend(saved_stop)
    extra_stop.extend(_generation_config_stop_tokens(root / GENERATION_CONFIG_FILE, tokenizer))

    max_len = config.get("model_max_length")
    if max_len is not None and not isinstance(max_len, (int, float)):
        raise ValueError(f"{config_path}: 'model_max_length' must be a number")
    return TokenizerFiles(
        tokenizer,
        bos_token=token("bos_token"),
        eos_token=eos,
        pad_token=token("pad_token"),
        chat_templates=_load_chat_templates(root, config, config_path),
        extra_stop_tokens=[t for t in extra_stop if t != eos],
        model_max_length=None if max_len is None else int(max_len),
    )


def _read_json(path: Path) -> Any:
    """Read a JSON file, turning a parse error into a ValueError that names the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from e


def _token_content(value: Any, name: str, path: Path) -> str | None:
    """A special token in an HF config: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{path}: field {name!r} must be a string or an object with a 'content' string, "
        f"got {value!r}"
    )


def _load_chat_templates(
    root: Path, config: Mapping[str, Any], config_path: Path
) -> dict[str, str] | None:
    """Templates by name; template files override the config, as in transformers."""
    templates: dict[str, str] = {}
    jinja_path = root / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        templates["default"] = jinja_path.read_text(encoding="utf-8")
    extra_dir = root / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates

    raw = config.get("chat_template")
    if raw is None:
        logger.info("%s has no chat template; using the default ChatML template", root)
        return None
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        for i, item in enumerate(raw):
            if not (
                isinstance(item, Mapping)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise ValueError(
                    f"{config_path}: chat_template[{i}] must be an object with 'name' and "
                    "'template' strings"
                )
            templates[item["name"]] = item["template"]
        if not templates:
            raise ValueError(f"{config_path}: chat_template is an empty list")
        return templates
    raise ValueError(
        f"{config_path}: chat_template must be a string or a list of {{name, template}} objects"
    )


def _generation_config_stop_tokens(path: Path, tokenizer: Tokenizer) -> list[str]:
    """Extra stop tokens from a model's generation_config.json (``eos_token_id`` int or list)."""
    if not path.is_file():
        return []
    config = _read_json(path)
    if not isinstance(config, Mapping):
        raise ValueError(f"{path}: expected a JSON object at top level")
    raw = config.get("eos_token_id")
    if raw is None:
        return []
    ids = raw if isinstance(raw, list) else [raw]
    tokens = []
    for tid in ids:
        if not isinstance(tid, int) or isinstance(tid, bool):
            raise ValueError(f"{path}: 'eos_token_id' must be an int or a list of ints")
        token = tokenizer.id_to_token(tid)
        if token is None:
            raise ValueError(f"{path}: eos_token_id {tid} is outside the vocabulary")
        tokens.append(token)
    return tokens


# --------------------------------------------------------------------------- writing


def write_tokenizer_dir(root: Path, files: TokenizerFiles) -> list[Path]:
    """Write an HF-layout directory that ``transformers.AutoTokenizer`` also loads.

    Each file is written atomically, so an interrupted save never leaves a half-written
    tokenizer next to a model checkpoint. Returns the written paths.
    """
    root.mkdir(parents=True, exist_ok=True)
    backend = files.backend
    added = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(backend.get_added_tokens_decoder().items())
    }
    templates = files.chat_templates
    if templates is None:
        template_field: Any = None
    elif list(templates) == ["default"]:
        template_field = templates["default"]
    else:
        template_field = [{"name": n, "template": s} for n, s in templates.items()]
    config: dict[str, Any] = {
        "added_tokens_decoder": added,
        "bos_token": files.bos_token,
        "chat_template": template_field,
        "clean_up_tokenization_spaces": False,
        "eos_token": files.eos_token,
        "model_max_length": files.model_max_length
        if files.model_max_length is not None
        else _HF_VERY_LARGE_INTEGER,
        "pad_token": files.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if files.extra_stop_tokens:
        config["extra_stop_tokens"] = list(files.extra_stop_tokens)
    special_map: dict[str, Any] = {
        k: v
        for k, v in (
            ("bos_token", files.bos_token),
            ("eos_token", files.eos_token),
            ("pad_token", files.pad_token),
        )
        if v is not None
    }
    roles = set(special_map.values())
    additional = [t.content for t in _special_added_tokens(backend) if t.content not in roles]
    if additional:
        special_map["additional_special_tokens"] = additional

    written = []
    for name, text in (
        (TOKENIZER_FILE, backend.to_str(pretty=True)),
        (TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n"),
        (SPECIAL_TOKENS_MAP_FILE, json.dumps(special_map, indent=2, ensure_ascii=False) + "\n"),
    ):
        _atomic_write_text(root / name, text)
        written.append(root / name)
    # transformers prefers chat_template.jinja over the config: keep a stale one in sync.
    jinja_path = root / CHAT_TEMPLATE_FILE
    if jinja_path.exists() and templates is not None and "default" in templates:
        logger.info("updating existing %s to the saved chat template", jinja_path)
        _atomic_write_text(jinja_path, templates["default"])
        written.append(jinja_path)
    return written


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder + rename: never leave a torn file. The file
    gets the mode a plain `open()` would (mkstemp's is 0600: other users could not read an
    exported tokenizer); a full disk is a `DiskFullError` naming the file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with (
            naming_full_disk(path, f"the previous {path.name} is intact"),
            os.fdopen(fd, "w", encoding="utf-8") as f,
        ):
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- fingerprint


def tokenizer_fingerprint(
    backend: Tokenizer,
    *,
    bos_token: str | None,
    eos_token: str | None,
    pad_token: str | None,
) -> str:
    """sha256 of the canonical tokenizer.json and the special-token roles.

    Identical across save/load; differs whenever ids could change, so cached tokenized
    data can be checked against the tokenizer that reads it.
    """
    specials = {
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "special_tokens": sorted(t.content for t in _special_added_tokens(backend)),
    }
    h = hashlib.sha256()
    h.update(_canonical_json(backend.to_str()).encode("utf-8"))
    h.update(b"\n")
    h.update(json.dumps(specials, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def _canonical_json(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _special_added_tokens(backend: Tokenizer) -> list[AddedToken]:
    return [t for _, t in sorted(backend.get_added_tokens_decoder().items()) if t.special]
