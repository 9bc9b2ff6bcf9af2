"""Tokenizer over HF ``tokenizers``: byte-level BPE training, HF directory I/O, chat and streaming.

``tokenizers`` does the actual work (BPE, pre-tokenization, added tokens, offsets); this
module adds what a training/serving framework needs around it:

* training a byte-level BPE with the special tokens our chat format uses,
* reading and writing HF tokenizer directories, so our checkpoints load in
  ``transformers`` and HF checkpoints load here,
* chat templating plus a template-independent assistant loss mask for SFT,
* incremental detokenization that never emits a broken character while streaming,
* a fingerprint that lets the data layer notice that a tokenizer changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, TemplateError

logger = logging.getLogger(__name__)

__all__ = [
    "BOS_TOKEN",
    "CHAT_ROLES",
    "DEFAULT_ADDED_TOKENS",
    "DEFAULT_SPECIAL_TOKENS",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "AutoTokenizer",
    "StreamDecoder",
]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
DEFAULT_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    IM_START_TOKEN,
    IM_END_TOKEN,
)
# Not special: decode(skip_special_tokens=True) keeps them, since tool calls and reasoning
# are part of the answer that the server parses.
DEFAULT_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# What transformers writes when a tokenizer has no length limit of its own.
_HF_VERY_LARGE_INTEGER = int(1e30)
_BYTE_ALPHABET_SIZE = 256
_REPLACEMENT_CHAR = "\ufffd"


# --------------------------------------------------------------------------- streaming


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

    @property
    def token_ids(self) -> list[int]:
        """All ids fed so far (a copy)."""
        return list(self._ids)

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


# --------------------------------------------------------------------------- helpers


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder + ``os.replace``: never leave a torn file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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


def _token_content(value: Any, field: str, path: Path) -> str | None:
    """A special token in an HF config: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"{path}: field {field!r} must be a string or an object with a 'content' string, "
        f"got {value!r}"
    )


def _canonical_json(text: str) -> str:
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _overlaps(tok_start: int, tok_end: int, span_start: int, span_end: int) -> bool:
    if tok_start == tok_end:  # zero-width offsets (trimmed whitespace): treat as a point
        return span_start <= tok_start < span_end
    return tok_start < span_end and tok_end > span_start


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate chat messages and drop None-valued keys, exactly as transformers does
    before rendering (so ``content=None`` and a missing ``content`` render the same)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}] has unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({role}): content must be a string or None, "
                f"got {type(content).__name__}"
            )
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}] ({role}): only assistant messages have tool_calls")
            _check_tool_calls(tool_calls, i)
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _check_tool_calls(tool_calls: Any, index: int) -> None:
    if isinstance(tool_calls, (str, bytes)) or not isinstance(tool_calls, Sequence):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    for j, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{where} must be a dict")
        function = call.get("function", call)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"{where}: missing function name (expected {{'function': {{'name'}}}})"
            )
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, Mapping)):
            raise ValueError(f"{where}: arguments must be a dict or a JSON string")


# --------------------------------------------------------------------------- tokenizer


class AutoTokenizer:
    """A ``tokenizers.Tokenizer`` plus the metadata that HF keeps in ``tokenizer_config.json``.

    Build one with :meth:`train`, :meth:`from_pretrained` (our directories and HF ones),
    :meth:`from_file`, or the constructor from a ``tokenizers.Tokenizer``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        extra_stop_tokens: Sequence[str] = (),
        model_max_length: int | None = None,
    ) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        self._tok = tokenizer
        for field, token in (
            ("bos_token", bos_token),
            ("eos_token", eos_token),
            ("pad_token", pad_token),
        ):
            if token is not None and tokenizer.token_to_id(token) is None:
                raise ValueError(f"{field} {token!r} is not in the vocabulary")
        self._bos = bos_token
        self._eos = eos_token
        self._pad = pad_token
        missing = [t for t in extra_stop_tokens if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"extra_stop_tokens not in the vocabulary: {missing}")
        self._extra_stop_tokens = list(dict.fromkeys(extra_stop_tokens))
        self.model_max_length = model_max_length
        self._fingerprint: tuple[int, str] | None = None

        if chat_template is None:
            templates: dict[str, str] = {"default": DEFAULT_CHAT_TEMPLATE}
        elif isinstance(chat_template, str):
            templates = {"default": chat_template}
        else:
            templates = dict(chat_template)
            if not templates:
                raise ValueError("chat_template: empty mapping of named templates")
        self._chat_templates = templates
        # Compile eagerly: a broken template should fail at load time, not mid-request.
        self._compiled = {name: ChatTemplate(src) for name, src in templates.items()}

    # ------------------------------------------------------------------ training

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        *,
        min_frequency: int = 2,
        special_tokens: Sequence[str] | None = None,
        added_tokens: Sequence[str] | None = None,
        bos_token: str = BOS_TOKEN,
        eos_token: str = EOS_TOKEN,
        pad_token: str = PAD_TOKEN,
        chat_template: str | None = None,
        show_progress: bool = False,
    ) -> AutoTokenizer:
        """Train a byte-level BPE whose final vocabulary (added tokens included) has
        ``vocab_size`` entries, or fewer when the corpus has too few merges.

        Every byte is in the initial alphabet, so any string is encodable (no UNK).
        ``special_tokens`` defaults to bos/eos/pad + ``<|im_start|>``/``<|im_end|>``;
        ``added_tokens`` (non-special, kept by ``decode(skip_special_tokens=True)``)
        defaults to the tool-call and think tags.
        """
        specials = list(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        for token in (bos_token, eos_token, pad_token):
            if token not in specials:
                specials.insert(0, token)
        specials = list(dict.fromkeys(specials))
        extra = [
            t
            for t in (DEFAULT_ADDED_TOKENS if added_tokens is None else added_tokens)
            if t not in specials
        ]
        extra = list(dict.fromkeys(extra))
        minimum = _BYTE_ALPHABET_SIZE + len(specials) + len(extra)
        if vocab_size < minimum:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: the byte alphabet, {len(specials)} special "
                f"and {len(extra)} added tokens alone need {minimum}"
            )

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(extra),
            min_frequency=min_frequency,
            special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(_checked_texts(texts), trainer=trainer)
        if extra:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
        # HF convention (Llama 3): encode(add_special_tokens=True) prepends bos, so
        # transformers and we agree on what "add special tokens" means.
        bos_id = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A:0",
            pair=f"{bos_token} $A:0 {bos_token} $B:1",
            special_tokens=[(bos_token, bos_id)],
        )
        logger.info(
            "trained byte-level BPE: %d tokens (%d special, %d added)",
            tok.get_vocab_size(with_added_tokens=True),
            len(specials),
            len(extra),
        )
        return cls(
            tok,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            chat_template=chat_template,
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        **kwargs: Any,
    ) -> AutoTokenizer:
        """Load a bare ``tokenizer.json``; metadata (bos/eos/pad, template) comes from kwargs."""
        return cls(_load_tokenizer_json(Path(path)), **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> AutoTokenizer:
        """Load our directory or an HF tokenizer directory (fast tokenizers only).

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
        chat template, ``model_max_length``), ``special_tokens_map.json``,
        ``chat_template.jinja`` / ``additional_chat_templates/*.jinja`` (which, as in
        transformers, take priority over the config's template) and ``generation_config.json``
        (extra stop ids). Nothing is downloaded: ``path`` must be a local directory.
        """
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"tokenizer directory not found: {root}")
        if root.is_file():
            if root.name.endswith(".json"):
                return cls.from_file(root)
            raise ValueError(f"{root}: expected a tokenizer directory or a tokenizer.json file")
        tokenizer = _load_tokenizer_json(root / TOKENIZER_FILE)

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

        def token(field: str) -> str | None:
            if field in config:
                return _token_content(config[field], field, config_path)
            return _token_content(special_map.get(field), field, map_path)

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
        try:
            return cls(
                tokenizer,
                bos_token=token("bos_token"),
                eos_token=eos,
                pad_token=token("pad_token"),
                chat_template=_load_chat_templates(root, config, config_path),
                extra_stop_tokens=[t for t in extra_stop if t != eos],
                model_max_length=None if max_len is None else int(max_len),
            )
        except (TemplateError, ValueError) as e:
            if str(root) in str(e):
                raise
            # keep the type (TemplateError stays TemplateError) but say which directory
            raise type(e)(f"{root}: {e}") from e

    # ------------------------------------------------------------------ saving

    def save_pretrained(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write an HF-layout directory that ``transformers.AutoTokenizer`` also loads.

        Each file is written atomically, so an interrupted save never leaves a half-written
        tokenizer next to a model checkpoint. Returns the written paths.
        """
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        added = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(self._tok.get_added_tokens_decoder().items())
        }
        templates = self._chat_templates
        if list(templates) == ["default"]:
            template_field: Any = templates["default"]
        else:
            template_field = [{"name": n, "template": s} for n, s in templates.items()]
        config: dict[str, Any] = {
            "added_tokens_decoder": added,
            "bos_token": self._bos,
            "chat_template": template_field,
            "clean_up_tokenization_spaces": False,
            "eos_token": self._eos,
            "model_max_length": self.model_max_length
            if self.model_max_length is not None
            else _HF_VERY_LARGE_INTEGER,
            "pad_token": self._pad,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if self._extra_stop_tokens:
            config["extra_stop_tokens"] = list(self._extra_stop_tokens)
        special_map: dict[str, Any] = {
            k: v
            for k, v in (
                ("bos_token", self._bos),
                ("eos_token", self._eos),
                ("pad_token", self._pad),
            )
            if v is not None
        }
        roles = set(special_map.values())
        additional = [t.content for t in self._special_added_tokens() if t.content not in roles]
        if additional:
            special_map["additional_special_tokens"] = additional

        written = []
        for name, text in (
            (TOKENIZER_FILE, self._tok.to_str(pretty=True)),
            (TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n"),
            (SPECIAL_TOKENS_MAP_FILE, json.dumps(special_map, indent=2, ensure_ascii=False) + "\n"),
        ):
            _atomic_write_text(root / name, text)
            written.append(root / name)
        # transformers prefers chat_template.jinja over the config: keep a stale one in sync.
        jinja_path = root / CHAT_TEMPLATE_FILE
        if jinja_path.exists() and "default" in templates:
            logger.info("updating existing %s to the saved chat template", jinja_path)
            _atomic_write_text(jinja_path, templates["default"])
            written.append(jinja_path)
        return written

    # ------------------------------------------------------------------ properties

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for anything not wrapped here)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding table needs at least this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self._bos

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos is None else self._tok.token_to_id(self._bos)

    @property
    def eos_token(self) -> str | None:
        return self._eos

    @property
    def eos_token_id(self) -> int | None:
        return None if self._eos is None else self._tok.token_to_id(self._eos)

    @property
    def pad_token(self) -> str | None:
        return self._pad

    @property
    def pad_token_id(self) -> int | None:
        return None if self._pad is None else self._tok.token_to_id(self._pad)

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end generation: eos, ``<|im_end|>`` (end of a chat turn), and any extra
        eos a checkpoint declares (generation_config / tokenizer_config)."""
        ids: list[int] = []
        for token in (self._eos, IM_END_TOKEN, *self._extra_stop_tokens):
            if token is None:
                continue
            tid = self._tok.token_to_id(token)
            if tid is not None and tid not in ids:
                ids.append(tid)
        return ids

    def _special_added_tokens(self) -> list[AddedToken]:
        return [t for _, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special]

    @property
    def special_ids(self) -> list[int]:
        """Sorted ids of all special tokens (those ``skip_special_tokens`` removes)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template(self) -> str:
        """Source of the default chat template."""
        return self._chat_templates.get("default") or next(iter(self._chat_templates.values()))

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates (HF checkpoints may ship e.g. ``default`` and ``tool_use``)."""
        return dict(self._chat_templates)

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical tokenizer.json and the special-token roles.

        Identical across save/load; differs whenever ids could change, so cached
        tokenized data can be checked against the tokenizer that reads it. Cached, since
        serializing a 150k-token vocabulary takes a while (keyed on the vocabulary size, so
        tokens added through ``backend`` are noticed).
        """
        key = self.vocab_size
        if self._fingerprint is None or self._fingerprint[0] != key:
            self._fingerprint = (key, self._compute_fingerprint())
        return self._fingerprint[1]

    def _compute_fingerprint(self) -> str:
        specials = {
            "bos_token": self._bos,
            "eos_token": self._eos,
            "pad_token": self._pad,
            "special_tokens": sorted(t.content for t in self._special_added_tokens()),
        }
        h = hashlib.sha256()
        h.update(_canonical_json(self._tok.to_str()).encode("utf-8"))
        h.update(b"\n")
        h.update(json.dumps(specials, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"AutoTokenizer(vocab_size={self.vocab_size}, bos={self._bos!r}, eos={self._eos!r}, "
            f"pad={self._pad!r})"
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the tokenizer's post-processor
        (for trained tokenizers: prepend bos), exactly as transformers does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def batch_encode(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[list[int]]:
        """Encode many texts at once (parallel inside ``tokenizers``)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids plus each token's (start, end) character span in ``text``."""
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (never raises on model output)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` for one generated sequence."""
        return StreamDecoder(self._tok, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def _template_for(self, tools: Sequence[Mapping[str, Any]] | None) -> ChatTemplate:
        """Pick a template the way transformers does: ``tool_use`` when tools are given and
        such a template exists, else ``default``."""
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise TemplateError(
            f"no 'default' chat template among the named templates {sorted(self._compiled)}"
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
    ) -> str:
        variables: dict[str, Any] = {
            k: v
            for k, v in (
                ("bos_token", self._bos),
                ("eos_token", self._eos),
                ("pad_token", self._pad),
            )
            if v is not None
        }
        variables.update(extra)
        return self._template_for(tools).render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    @staticmethod
    def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]] | None:
        if tools is None:
            return None
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise TypeError("tools must be a list of JSON-schema dicts")
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise TypeError(
                    f"tools[{i}] must be a dict (JSON schema), got {type(tool).__name__}"
                )
        return list(tools)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render a conversation (text, or ids when ``tokenize``), identically to
        transformers' ``apply_chat_template`` for the same template and inputs.

        ``extra`` variables reach the template (e.g. ``enable_thinking=False``).
        """
        normalized = _normalize_messages(messages)
        text = self._render(normalized, self._check_tools(tools), add_generation_prompt, extra)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **extra: Any,
    ) -> tuple[list[int], list[int]]:
        """Ids of the rendered conversation and its assistant loss mask.

        The mask is 1 on tokens of assistant turns (content, tool calls and the turn's
        closing stop token such as ``<|im_end|>``), 0 elsewhere (headers like
        ``<|im_start|>assistant\\n``, other roles, separators after the stop token).
        It is computed without knowing the template: the span of assistant turn ``i`` runs
        from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
        ``render(messages[:i+1])``, cut after the last stop token in it. This needs a
        prefix-stable template (true for ChatML-like ones); otherwise TemplateError.
        """
        normalized = _normalize_messages(messages)
        tool_list = self._check_tools(tools)
        full = self._render(normalized, tool_list, add_generation_prompt, extra)
        stop_strings = [s for s in (self.id_to_token(i) for i in self.stop_ids) if s]

        spans: list[tuple[int, int]] = []
        for i, message in enumerate(normalized):
            if message["role"] != "assistant":
                continue
            before = self._render(normalized[:i], tool_list, True, extra)
            through = self._render(normalized[: i + 1], tool_list, False, extra)
            if not through.startswith(before):
                raise TemplateError(
                    f"chat template is not prefix-stable: rendering messages[:{i}] with the "
                    f"generation prompt is not a prefix of rendering messages[:{i + 1}], so the "
                    "assistant loss mask cannot be computed"
                )
            if not full.startswith(through):
                raise TemplateError(
                    f"chat template is not prefix-stable: rendering messages[:{i + 1}] is not a "
                    "prefix of rendering the whole conversation (the template changes earlier "
                    "turns depending on later ones), so the assistant loss mask cannot be computed"
                )
            start, end = len(before), len(through)
            turn = through[start:end]
            cut = max((turn.rfind(s) + len(s) for s in stop_strings if s in turn), default=-1)
            if cut >= 0:
                end = start + cut
            if end > start:
                spans.append((start, end))

        ids, offsets = self.encode_with_offsets(full)
        mask = [0] * len(ids)
        k = 0
        for t, (s, e) in enumerate(offsets):  # offsets and spans are both in order
            while k < len(spans) and spans[k][1] <= s:
                k += 1
            if k == len(spans):
                break
            if _overlaps(s, e, *spans[k]):
                mask[t] = 1
        return ids, mask


# --------------------------------------------------------------------------- loaders


def _checked_texts(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        yield text


def _load_tokenizer_json(path: Path) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found (astrai needs a fast tokenizer saved as tokenizer.json)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"{path}: cannot be read as a tokenizers JSON file: {e}") from e


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
