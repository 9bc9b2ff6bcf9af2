"""Perplexity and bits per byte of a model on local documents, through `engine.score`.

Documents come from text files (one document per file), JSON / JSONL records (a ``text``
field, or a list of token ids), a prepared H5 storage (``input_ids``, checked against the
tokenizer's fingerprint), or, with no path, the held-out standard-library files the
built-in corpus trains on. Every token of a document is scored: the first one after a
prefix token (``eos``, which precedes every document in prepared pretraining data, else
``bos``; a token document that already starts with a special token uses that one).
Documents longer than the engine's context are cut into disjoint target windows, each
scored with the tokens before it as context, exactly as lm-evaluation-harness's
``loglikelihood_rolling`` does (``context_len`` 1 is its default; larger values give each
window more context at the cost of more windows).

Metrics are corpus-level sums, as in training: ``nll`` (nats per token), ``ppl``,
``bpb`` (nats over ``ln 2`` times the UTF-8 bytes the tokens stand for, with the byte table
of :func:`astrai.tokenizer.bytes.token_byte_lengths`, so it equals ``val/bpb``),
``word_ppl`` (per whitespace-separated word, lm-eval's ``word_perplexity``), and the
10th / 50th / 90th percentiles of per-document perplexity.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from astrai.data.builtin import stdlib_records
from astrai.data.storage import H5_SUFFIXES, JSON_SUFFIXES, DataError, H5Storage, JsonStorage
from astrai.eval.suite import Suite, SuiteResult, progress_bar
from astrai.tokenizer.bytes import corpus_metrics, token_byte_lengths

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

__all__ = ["PerplexitySuite", "rolling_windows"]

Window = tuple[list[int], list[int]]


def rolling_windows(
    tokens: Sequence[int], prefix: int, max_len: int, context_len: int = 1
) -> list[Window]:
    """`(context, continuation)` requests whose continuations cut `tokens` into consecutive
    disjoint windows; the model sees at most `max_len` tokens per request (context plus
    continuation minus its last token), and every window but the first at least
    `context_len` tokens of context (lm-eval's ``get_rolling_token_windows`` followed by
    ``make_disjoint_window``)."""
    if not 1 <= context_len <= max_len:
        raise ValueError(f"context_len must be in 1..{max_len}, got {context_len}")
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(max_len, len(tokens))
    windows = [([prefix], tokens[:first])]
    done, step = first, max_len - context_len + 1
    while done < len(tokens):
        end = min(len(tokens), done + step)
        windows.append((tokens[end - max_len - 1 : done], tokens[done:end]))
        done = end
    return windows


@dataclass
class Document:
    """One document: where it came from, and its text or its token ids."""

    where: str
    text: str | None = None
    ids: list[int] | None = None


def _load(path: Path, key: str, limit: int | None) -> list[Document]:
    """Documents of one file (or H5 shard directory), at most `limit`."""
    if path.suffix in H5_SUFFIXES or path.is_dir():
        storage = H5Storage(path)
        storage.require("input_ids")
        count = len(storage) if limit is None else min(limit, len(storage))
        return [
            Document(f"{path}[{i}]", ids=storage.get("input_ids", i).tolist()) for i in range(count)
        ]
    if not path.is_file():
        raise FileNotFoundError(f"perplexity: file not found: {path}")
    if path.suffix not in JSON_SUFFIXES:
        return [Document(str(path), text=path.read_text(encoding="utf-8", errors="replace"))]
    docs = []
    for line, record in JsonStorage(path).iter_records():
        where = f"{path}:{line}"
        value = record if isinstance(record, str | list) else None
        if isinstance(record, dict):
            if key not in record:
                raise DataError(f"{where}: missing field {key!r} (has: {sorted(record)})")
            value = record[key]
        if isinstance(value, str):
            docs.append(Document(where, text=value))
        elif isinstance(value, list) and all(type(t) is int for t in value):
            docs.append(Document(where, ids=value))
        else:
            raise DataError(f"{where}: field {key!r} must be text or a list of token ids")
        if limit is not None and len(docs) >= limit:
            break
    return docs


class PerplexitySuite(Suite):
    """Token nll, perplexity, bits per byte and per-document percentiles over documents.

    Args:
        name: metric namespace.
        path: a file or a list of files (``.txt`` and other text: one document each;
            ``.json`` / ``.jsonl``: one per record; ``.h5`` or a shard directory: a prepared
            storage); None: held-out standard-library files (``astrai.data.builtin``).
        key: the record field holding the text (or token ids) in JSON files.
        limit: at most this many documents (per file).
        max_length: tokens per request (None: the engine's context).
        context_len: minimum context of every window after a document's first.
        prefix_token: id or token string scored from (None: eos, else bos).
        chunk_size: windows per ``engine.score`` call.
    """

    def __init__(
        self,
        name: str = "perplexity",
        *,
        path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        key: str = "text",
        limit: int | None = None,
        max_length: int | None = None,
        context_len: int = 1,
        prefix_token: int | str | None = None,
        chunk_size: int = 256,
    ) -> None:
        self.name = name
        if path is None:
            self.documents = [
                Document(f"stdlib:{r['path']}", text=r["text"])
                for r in itertools.islice(stdlib_records("val"), limit)
            ]
        else:
            paths = [path] if isinstance(path, str | os.PathLike) else list(path)
            self.documents = [d for p in paths for d in _load(Path(p).expanduser(), key, limit)]
        for doc in self.documents:
            if not (doc.text if doc.text is not None else doc.ids):
                raise DataError(f"{doc.where}: empty document")
        if not self.documents:
            raise ValueError(f"{name}: no documents")
        if max_length is not None and max_length < 2:
            raise ValueError(f"{name}: max_length must be >= 2, got {max_length}")
        if context_len < 1:
            raise ValueError(f"{name}: context_len must be >= 1, got {context_len}")
        self.max_length = max_length
        self.context_len = int(context_len)
        self.prefix_token = prefix_token
        self.chunk_size = max(1, int(chunk_size))
        self._encoded: tuple[int, list[tuple[int, list[int]]]] | None = None

    # ------------------------------------------------------------------ tokens
    def prefix_id(self, tokenizer: AutoTokenizer) -> int:
        """The token every document is scored after."""
        if isinstance(self.prefix_token, int):
            return self.prefix_token
        if isinstance(self.prefix_token, str):
            found = tokenizer.token_to_id(self.prefix_token)
            if found is None:
                raise ValueError(f"{self.name}: prefix_token {self.prefix_token!r} is not a token")
            return found
        for found in (tokenizer.eos_token_id, tokenizer.bos_token_id):
            if found is not None:
                return found
        raise ValueError(f"{self.name}: the tokenizer has no eos or bos; set prefix_token")

    def encode(self, tokenizer: AutoTokenizer) -> list[tuple[int, list[int]]]:
        """`(prefix, targets)` per document: the token scored from, the tokens scored."""
        if self._encoded is not None and self._encoded[0] == id(tokenizer):
            return self._encoded[1]
        prefix, special = self.prefix_id(tokenizer), set(tokenizer.special_ids)
        out = []
        for doc in self.documents:
            ids = doc.ids if doc.ids is not None else tokenizer.encode(doc.text or "")
            if ids and ids[0] in special:  # a prepared document's own bos
                out.append((ids[0], list(ids[1:])))
            else:
                out.append((prefix, list(ids)))
            if not out[-1][1]:
                raise DataError(f"{doc.where}: no tokens to score")
        self._encoded = (id(tokenizer), out)
        return out

    def required_seq_len(self, tokenizer: AutoTokenizer) -> int:
        longest = max(len(targets) for _, targets in self.encode(tokenizer)) + 1
        return min(longest, self.max_length) if self.max_length else longest

    # ------------------------------------------------------------------ run
    def windows(self, engine: InferenceEngine) -> list[tuple[int, Window]]:
        """`(document index, request)` for every window of every document."""
        length = min(self.max_length or engine.max_seq_len, engine.max_seq_len)
        max_len = length - 1  # a request holds the model's input plus one token
        if max_len < self.context_len:
            raise ValueError(
                f"{self.name}: {length} tokens per request leave no room for "
                f"context_len={self.context_len}"
            )
        return [
            (i, window)
            for i, (prefix, targets) in enumerate(self.encode(engine.tokenizer))
            for window in rolling_windows(targets, prefix, max_len, self.context_len)
        ]

    def run(self, engine: InferenceEngine, *, progress: bool = False) -> SuiteResult:
        started = time.perf_counter()
        tokenizer = engine.tokenizer
        byte_table = token_byte_lengths(tokenizer, engine.vocab_size).tolist()
        requests = self.windows(engine)
        n = len(self.documents)
        nats, tokens, nbytes, count = [0.0] * n, [0] * n, [0] * n, [0] * n
        with progress_bar(len(requests), f"eval {self.name}", progress, "window") as bar:
            for start in range(0, len(requests), self.chunk_size):
                chunk = requests[start : start + self.chunk_size]
                scores = engine.score([w for _, w in chunk], self.score_params())
                for (doc, (_, continuation)), score in zip(chunk, scores):
                    nats[doc] -= score.logprob
                    tokens[doc] += len(continuation)
                    nbytes[doc] += sum(byte_table[t] for t in continuation)
                    count[doc] += 1
                bar.update(len(chunk))
        rows, words = [], []
        for i, doc in enumerate(self.documents):
            text = (
                doc.text
                if doc.text is not None
                else tokenizer.decode(doc.ids or [], skip_special_tokens=True)
            )
            words.append(len(re.split(r"\s+", text)))
            rows.append(
                {
                    "where": doc.where,
                    "tokens": tokens[i],
                    "bytes": nbytes[i],
                    "words": words[i],
                    "windows": count[i],
                    "nll": nats[i] / tokens[i],
                    **corpus_metrics(nats[i], tokens[i], nbytes[i]),
                }
            )
        total = sum(nats)
        metrics: dict[str, Any] = {"nll": total / sum(tokens)}
        metrics.update(corpus_metrics(total, sum(tokens), sum(nbytes)))
        metrics["word_ppl"] = math.exp(total / sum(words))
        doc_ppl = np.array([row["ppl"] for row in rows])
        for q in (10, 50, 90):
            metrics[f"doc_ppl_p{q}"] = float(np.percentile(doc_ppl, q))
        metrics["tokens"] = float(sum(tokens))
        return SuiteResult(self.name, metrics, rows, time.perf_counter() - started)
