"""The tokenizer class: a ``tokenizers.Tokenizer`` plus the metadata a training/serving
framework needs around it (special-token roles, stop ids, chat templates).

``tokenizers`` does the actual work (BPE, pre-tokenization, added tokens, offsets). The
jobs around it live in their own modules, and this class is their front door:
BPE training in :mod:`astrai.tokenizer.bpe`, HF directory I/O and the fingerprint in
:mod:`astrai.tokenizer.io`, chat formatting in :mod:`astrai.tokenizer.chat`, streaming
detokenization in :mod:`astrai.tokenizer.stream`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from astrai.tokenizer.bpe import train_bpe
from astrai.tokenizer.chat import CHAT_ROLES, ChatFormatter, span_mask
from astrai.tokenizer.chat_template import TemplateError
from astrai.tokenizer.content_text import ContentShield
from astrai.tokenizer.io import (
    TokenizerFiles,
    load_tokenizer_json,
    read_tokenizer_dir,
    tokenizer_fingerprint,
    write_tokenizer_dir,
)
from astrai.tokenizer.stream import StreamDecoder
from astrai.tokenizer.tokens import (
    BOS_TOKEN,
    DEFAULT_ADDED_TOKENS,
    DEFAULT_SPECIAL_TOKENS,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
)

# The token names, CHAT_ROLES and StreamDecoder are re-exported: they were defined here
# before the split, and ``from astrai.tokenizer.tokenizer import ...`` keeps working.
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
        self._shield: tuple[int, ContentShield] | None = None
        self._chat = ChatFormatter(
            chat_template,
            {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token},
        )

    # ------------------------------------------------------------------ building

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
        split_digits: bool = True,
        show_progress: bool = False,
    ) -> AutoTokenizer:
        """Train a byte-level BPE (see :func:`astrai.tokenizer.bpe.train_bpe`) whose final
        vocabulary has ``vocab_size`` entries, or fewer when the corpus has too few merges.

        ``special_tokens`` defaults to bos/eos/pad + ``<|im_start|>``/``<|im_end|>``;
        ``added_tokens`` (non-special, kept by ``decode(skip_special_tokens=True)``)
        defaults to the tool-call and think tags; ``split_digits`` (default on for new
        tokenizers) gives every digit its own token.
        """
        tok = train_bpe(
            texts,
            vocab_size,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            min_frequency=min_frequency,
            special_tokens=special_tokens,
            added_tokens=added_tokens,
            split_digits=split_digits,
            show_progress=show_progress,
        )
        return cls(
            tok,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            chat_template=chat_template,
        )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        **kwargs: Any,
    ) -> AutoTokenizer:
        """Load a bare ``tokenizer.json``; metadata (bos/eos/pad, template) comes from kwargs."""
        return cls(load_tokenizer_json(Path(path)), **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> AutoTokenizer:
        """Load our directory or an HF tokenizer directory (fast tokenizers only; the files
        read are listed in :func:`astrai.tokenizer.io.read_tokenizer_dir`), or a bare
        ``tokenizer.json`` without metadata. Nothing is downloaded: ``path`` must be local.
        """
        root = Path(path)
        if root.is_file() and root.name.endswith(".json"):
            return cls.from_file(root)
        files = read_tokenizer_dir(root)
        try:
            return cls(
                files.backend,
                bos_token=files.bos_token,
                eos_token=files.eos_token,
                pad_token=files.pad_token,
                chat_template=files.chat_templates,
                extra_stop_tokens=files.extra_stop_tokens,
                model_max_length=files.model_max_length,
            )
        except (TemplateError, ValueError) as e:
            if str(root) in str(e):
                raise
            # keep the type (TemplateError stays TemplateError) but say which directory
            raise type(e)(f"{root}: {e}") from e

    def save_pretrained(self, path: str | os.PathLike[str]) -> list[Path]:
        """Write an HF-layout directory that ``transformers.AutoTokenizer`` also loads,
        each file atomically. Returns the written paths."""
        files = TokenizerFiles(
            self._tok,
            bos_token=self._bos,
            eos_token=self._eos,
            pad_token=self._pad,
            chat_templates=self.chat_templates,
            extra_stop_tokens=list(self._extra_stop_tokens),
            model_max_length=self.model_max_length,
        )
        return write_tokenizer_dir(Path(path), files)

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

    @property
    def special_ids(self) -> list[int]:
        """Sorted ids of all special tokens (those ``skip_special_tokens`` removes)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template(self) -> str:
        """Source of the default chat template."""
        return self._chat.default_template

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates (HF checkpoints may ship e.g. ``default`` and ``tool_use``)."""
        return self._chat.templates

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical tokenizer.json and the special-token roles (see
        :func:`astrai.tokenizer.io.tokenizer_fingerprint`).

        Cached, since serializing a 150k-token vocabulary takes a while (keyed on the
        vocabulary size, so tokens added through ``backend`` are noticed).
        """
        key = self.vocab_size
        if self._fingerprint is None or self._fingerprint[0] != key:
            fp = tokenizer_fingerprint(
                self._tok, bos_token=self._bos, eos_token=self._eos, pad_token=self._pad
            )
            self._fingerprint = (key, fp)
        return self._fingerprint[1]

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
        transformers' ``apply_chat_template`` for the same template and inputs, except that
        with ``tokenize`` control-token text inside messages, tools or ``extra`` is encoded
        as text: only the template writes control tokens (see
        :mod:`astrai.tokenizer.content_text`). Encoding the returned text yourself parses
        every special token in it, so pass ``tokenize=True`` for untrusted content.

        ``extra`` variables reach the template (e.g. ``enable_thinking=False``).
        """
        text = self._chat.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, extra=extra
        )
        if not tokenize:
            return text
        shield = self._content_shield()
        shielded, changed = shield.shield((messages, tools, extra))
        if not changed:
            return self.encode(text, add_special_tokens=False)
        s_messages, s_tools, s_extra = shielded
        s_text = self._chat.render(
            s_messages, tools=s_tools, add_generation_prompt=add_generation_prompt, extra=s_extra
        )
        return shield.encode(text, s_text)[0]

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
        Control-token text inside the messages is encoded as text, exactly as
        ``apply_chat_template(tokenize=True)`` does, so training and serving see the same
        ids. The mask is computed without knowing the template, from renderings of conversation
        prefixes (see :meth:`ChatFormatter.render_with_assistant_spans`); a template that
        is not prefix-stable raises TemplateError.
        """
        stop_strings = [s for s in (self.id_to_token(i) for i in self.stop_ids) if s]
        shield = self._content_shield()
        shielded, changed = shield.shield((messages, tools, extra))
        s_messages, s_tools, s_extra = shielded
        s_text, spans = self._chat.render_with_assistant_spans(
            s_messages,
            tools=s_tools,
            add_generation_prompt=add_generation_prompt,
            extra=s_extra,
            stop_strings=stop_strings,
        )
        if not changed:
            ids, offsets = self.encode_with_offsets(s_text)
        else:
            text = self._chat.render(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, extra=extra
            )
            ids, offsets = shield.encode(text, s_text)
        return ids, span_mask(offsets, spans)

    def _content_shield(self) -> ContentShield:
        """The control tokens of this vocabulary (cached, keyed on the vocabulary size)."""
        key = self.vocab_size
        if self._shield is None or self._shield[0] != key:
            extra = [IM_START_TOKEN, *(t for t in map(self.id_to_token, self.stop_ids) if t)]
            self._shield = (key, ContentShield(self._tok, extra))
        return self._shield[1]
