"""The teacher's top-k next-token log-probs, stored by ``prepare`` for offline distillation.

``python -m astrai.data.prepare kind=sft ... teacher=<export dir> teacher_top_k=<k>`` runs the
teacher (an astrai or HF export directory) over every prepared document, batched and without
gradients, and stores per document of ``T`` tokens the ``k`` most likely next tokens and their
log-probs (the teacher's ``log_softmax`` at temperature 1) for the ``T - 1`` targets
``input_ids[1:]``: entry ``j`` is the teacher's distribution after ``input_ids[:j + 1]``.
They go into the HDF5 storage flattened row-major, ``[(T - 1) * k]`` per document, as
``teacher_topk_ids`` (ids, sized to the teacher's vocabulary) and ``teacher_topk_logprobs``
(float32); the file's attributes say ``teacher_top_k`` (k) and ``teacher`` (path, content
digest of its config and weights, vocabulary size). The LM head runs ``teacher_chunk_size``
positions at a time, so ``[B, S, V]`` logits never exist. The SFT dataset hands them to the
batch ``[B, L, k]`` (:class:`~astrai.data.datasets.SFTDataset`); TRL's ``top_k`` meaning: the
support of the loss (``astrai.train.strategies.distill.stored_teacher``).

The teacher must share the tokenizer's vocabulary: its config's ``vocab_size`` must cover the
tokenizer and its own tokenizer (when its directory has one) must be the same, or ``prepare``
refuses it naming both, before any weight is read. What stores nothing is :class:`NoTeacher`,
the same interface (a document passes through as encoded).
"""

from __future__ import annotations

import functools
import itertools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from astrai.data.encode import PrepareOptions
from astrai.data.storage import DataError, token_dtype

if TYPE_CHECKING:
    import torch

# torch is imported where a teacher runs, never at import: prepare without a teacher and the
# preflight of every run (which reach this module through the data cache) stay torch-free.

__all__ = [
    "TEACHER_ATTR",
    "TOPK_IDS",
    "TOPK_LOGPROBS",
    "TOP_K_ATTR",
    "DocumentStage",
    "NoTeacher",
    "TeacherSettings",
    "TeacherTopK",
    "document_stage",
    "teacher_files_stat",
    "teacher_topk",
]

log = logging.getLogger(__name__)

TOPK_IDS = "teacher_topk_ids"
TOPK_LOGPROBS = "teacher_topk_logprobs"
TOP_K_ATTR = "teacher_top_k"
TEACHER_ATTR = "teacher"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TeacherSettings:
    """``prepare``'s teacher options (its CLI keys, with the ``teacher_`` prefix).

    ``path``: the export directory; ``top_k``: ids stored per target position; ``batch_size``:
    documents per teacher forward; ``chunk_size``: positions per LM-head block; ``device``:
    ``auto`` (CUDA when there is one) or a torch device; ``dtype``: the weights' dtype
    (``float32``, ``bfloat16``, ...; None keeps the stored one). The log-softmax is fp32.
    """

    path: str
    top_k: int
    batch_size: int = 8
    chunk_size: int = 1024
    device: str = "auto"
    dtype: str | None = None

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)


class DocumentStage(ABC):
    """What happens to encoded SFT documents before they are written: nothing
    (:class:`NoTeacher`) or the teacher's top-k added (:class:`TeacherTopK`)."""

    @abstractmethod
    def dtypes(self) -> dict[str, Any]:
        """The keys this stage adds and their stored dtypes."""

    @abstractmethod
    def attrs(self) -> dict[str, Any]:
        """Attributes of every shard."""

    @abstractmethod
    def signature(self) -> dict[str, Any]:
        """What the output depends on besides the encoding (enters the run's signature)."""

    @abstractmethod
    def add(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one document; return the documents ready to write (in order)."""

    @abstractmethod
    def flush(self) -> list[dict[str, Any]]:
        """The documents still held (at the end of a shard)."""


class NoTeacher(DocumentStage):
    """No teacher: documents are written as encoded."""

    def dtypes(self) -> dict[str, Any]:
        return {}

    def attrs(self) -> dict[str, Any]:
        return {}

    def signature(self) -> dict[str, Any]:
        return {}

    def add(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [doc]

    def flush(self) -> list[dict[str, Any]]:
        return []


class TeacherTopK(DocumentStage):
    """Adds the teacher's top-k ids and log-probs to every document, ``batch_size`` at a
    time; the teacher's weights are read on the first batch (a reused output needs none)."""

    def __init__(self, settings: TeacherSettings, vocab_size: int, max_positions: int) -> None:
        import torch

        from astrai.data.onpolicy import policy_digest

        self.settings = settings
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.digest = policy_digest(settings.path)
        self.pending: list[dict[str, Any]] = []
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu")
            if settings.device == "auto"
            else settings.device
        )

    @functools.cached_property
    def model(self) -> Any:
        """The teacher, read when the first batch needs it."""
        from astrai.model import load_pretrained

        log.info("loading teacher %s on %s", self.settings.path, self.device)
        dtype = self.settings.torch_dtype()
        return load_pretrained(self.settings.path, device=self.device, dtype=dtype).to(self.device)

    def dtypes(self) -> dict[str, Any]:
        return {TOPK_IDS: token_dtype(self.vocab_size), TOPK_LOGPROBS: np.float32}

    def attrs(self) -> dict[str, Any]:
        teacher = {
            "path": str(Path(self.settings.path).resolve()),
            "digest": self.digest,
            "vocab_size": self.vocab_size,
            "dtype": self.settings.dtype,
        }
        return {TOP_K_ATTR: self.settings.top_k, TEACHER_ATTR: teacher}

    def signature(self) -> dict[str, Any]:
        s = self.settings
        return {"teacher": {"digest": self.digest, "top_k": s.top_k, "dtype": s.dtype}}

    def add(self, doc: dict[str, Any]) -> list[dict[str, Any]]:
        if len(doc["input_ids"]) > self.max_positions:
            raise DataError(
                f"teacher {self.settings.path}: a document of {len(doc['input_ids'])} tokens is "
                f"longer than its max_position_embeddings ({self.max_positions}); set "
                f"max_length (with truncate=true to cut instead of skip)"
            )
        self.pending.append(doc)
        return self.flush() if len(self.pending) >= self.settings.batch_size else []

    def flush(self) -> list[dict[str, Any]]:
        docs, self.pending = self.pending, []
        if not docs:
            return []
        scored = teacher_topk(
            self.model,
            [d["input_ids"] for d in docs],
            self.settings.top_k,
            chunk_size=self.settings.chunk_size,
        )
        return [
            {**d, TOPK_IDS: ids.reshape(-1), TOPK_LOGPROBS: logprobs.reshape(-1)}
            for d, (ids, logprobs) in zip(docs, scored)
        ]


def teacher_topk(
    model: Any, docs: list[list[int]], k: int, *, chunk_size: int = 1024
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per document of ``T`` tokens: the teacher's top-``k`` ids ``[T - 1, k]`` (int64) and
    log-probs (float32) after each prefix ``doc[:j + 1]``, ``j < T - 1``; highest first.

    One right-padded forward for all documents (causal: a real token never sees padding),
    then the LM head over the real target positions ``chunk_size`` at a time.
    """
    import torch

    with torch.no_grad():
        return _teacher_topk(model, docs, k, chunk_size)


def _teacher_topk(
    model: Any, docs: list[list[int]], k: int, chunk_size: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    import torch

    device = next(model.parameters()).device
    lengths = [len(d) for d in docs]
    ids = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        ids[i, : len(doc)] = torch.as_tensor(doc, dtype=torch.long)
        mask[i, : len(doc)] = 1
    hidden = model(ids.to(device), attention_mask=mask.to(device), return_hidden=True)
    rows = torch.cat([torch.full((n - 1,), i, dtype=torch.long) for i, n in enumerate(lengths)])
    cols = torch.cat([torch.arange(n - 1) for n in lengths])
    top_ids, top_lp = [], []
    for start in range(0, len(rows), chunk_size):
        r, c = rows[start : start + chunk_size], cols[start : start + chunk_size]
        logits = model.lm_head(hidden[r.to(device), c.to(device)]).float()
        values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        top_ids.append(indices.cpu())
        top_lp.append(values.cpu())
    all_ids = torch.cat(top_ids).numpy() if top_ids else np.zeros((0, k), np.int64)
    all_lp = torch.cat(top_lp).numpy() if top_lp else np.zeros((0, k), np.float32)
    bounds = np.cumsum([0, *(n - 1 for n in lengths)])
    return [(all_ids[a:b], all_lp[a:b]) for a, b in itertools.pairwise(bounds)]


def document_stage(
    teacher: str | None,
    tok: Any,
    opts: PrepareOptions,
    *,
    top_k: int | None = None,
    batch_size: int = 8,
    chunk_size: int = 1024,
    device: str = "auto",
    dtype: str | None = None,
) -> DocumentStage:
    """The stage of a prepare run: :class:`NoTeacher` without ``teacher``, else the teacher
    checked (options, vocabulary: config and tokenizer files only) before any weight is read."""
    if teacher is None:
        if top_k is not None:
            raise DataError("teacher_top_k is set but teacher is not (the export directory)")
        return NoTeacher()
    settings = TeacherSettings(str(teacher), top_k or 0, batch_size, chunk_size, device, dtype)
    if opts.kind != "sft":
        raise DataError(f"teacher applies to kind=sft only (offline distillation), got {opts.kind}")
    if opts.pack:
        raise DataError(
            "teacher with pack=true: the teacher's top-k is stored per document and "
            "distillation trains on unpacked documents; prepare with pack=false"
        )
    for name, value in (("top_k", top_k), ("batch_size", batch_size), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"teacher_{name} must be an integer >= 1, got {value!r}")
    import torch

    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise DataError(f"teacher_dtype must name a torch dtype (e.g. bfloat16), got {dtype!r}")
    vocab_size, max_positions = _check_vocabulary(settings.path, tok)
    if settings.top_k > vocab_size:
        raise DataError(f"teacher_top_k={top_k} exceeds the teacher's vocabulary ({vocab_size})")
    return TeacherTopK(settings, vocab_size, max_positions)


def teacher_files_stat(path: str | Path) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of a teacher directory's config and weight files (cheap: no
    byte is read), for a cache key that changes when the teacher is written again."""
    root = Path(path)
    if not root.is_dir():
        return []
    files = sorted(p for p in root.iterdir() if p.suffix in (".json", ".safetensors"))
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.is_file()]


def _check_vocabulary(path: str, tok: Any) -> tuple[int, int]:
    """The teacher's ``(vocab_size, max_position_embeddings)``, after refusing a teacher whose
    vocabulary is not the tokenizer's (naming both)."""
    from astrai.model.hub import read_config
    from astrai.tokenizer import AutoTokenizer

    root = Path(path)
    try:
        config = read_config(root)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"teacher {path}: not a model export directory ({exc})") from exc
    if not any(root.glob("*.safetensors")):
        raise DataError(f"teacher {path}: no model weights (*.safetensors)")
    ours = f"the tokenizer's ({tok.vocab_size} ids, fingerprint {str(tok.fingerprint)[:16]})"
    if any((root / name).is_file() for name in _TOKENIZER_FILES):
        theirs = AutoTokenizer.from_pretrained(str(root))
        if str(theirs.fingerprint) != str(tok.fingerprint):
            raise DataError(
                f"teacher {path}: its vocabulary ({theirs.vocab_size} ids, fingerprint "
                f"{str(theirs.fingerprint)[:16]}; the model's embedding has "
                f"{config.vocab_size}) differs from {ours}: a teacher must share the "
                f"tokenizer's vocabulary"
            )
    elif config.vocab_size != tok.vocab_size:
        raise DataError(
            f"teacher {path} has no tokenizer files and a vocabulary of {config.vocab_size} "
            f"ids, not {ours}: a teacher must share the tokenizer's vocabulary"
        )
    if config.vocab_size < tok.vocab_size:
        raise DataError(f"teacher {path}: its model has {config.vocab_size} ids, fewer than {ours}")
    return config.vocab_size, config.max_position_embeddings
