"""The run's tokenizer: an existing directory, or a byte-level BPE trained once from the
config's `tokenizer.train` block and cached under `${paths.data_dir}/tokenizers/<hash>`
(a file lock keeps concurrent runs and sweep jobs from training it twice).

`train.corpus` is `builtin:<name>` (the corpora that ship with the package) or a `.txt`,
`.md`, `.py` or `.jsonl` (`text` field) file or folder; `max_bytes` bounds what is read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from astrai.data.builtin import BUILTIN_PREFIX, builtin_records, is_builtin
from astrai.data.cache import digest, file_lock
from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)

__all__ = ["prepare_tokenizer"]


def _corpus_texts(corpus: str, max_bytes: int | None) -> Iterator[str]:
    """Texts for BPE training: builtin records, or .txt / .jsonl (`text`) files."""
    if is_builtin(corpus):
        records = builtin_records(corpus.removeprefix(BUILTIN_PREFIX), max_bytes=max_bytes)
        texts: Iterator[str] = (r.get("text") or json.dumps(r) for r in records)
    else:
        root = Path(corpus)
        files = sorted(root.rglob("*")) if root.is_dir() else [root]

        def read() -> Iterator[str]:
            for f in files:
                if f.suffix == ".jsonl":
                    with open(f, encoding="utf-8") as fh:
                        for line in fh:
                            if line.strip():
                                yield json.loads(line).get("text", "")
                elif f.suffix in (".txt", ".md", ".py"):
                    yield f.read_text(encoding="utf-8", errors="replace")

        texts = read()
    total = 0
    for text in texts:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(text.encode("utf-8", errors="replace"))
        yield text


def prepare_tokenizer(tok_cfg: Mapping[str, Any], data_dir: str | Path) -> Path:
    """The tokenizer directory: `path` as given, or trained from `train` once and cached."""
    if OmegaConf.is_config(tok_cfg):
        tok_cfg = OmegaConf.to_container(tok_cfg, resolve=True)
    tok_cfg = dict(tok_cfg or {})
    if tok_cfg.get("path"):
        return Path(tok_cfg["path"])
    spec = dict(tok_cfg.get("train") or {})
    corpus = spec.pop("corpus")
    vocab_size = int(spec.pop("vocab_size"))
    max_bytes = spec.pop("max_bytes", None)
    out = Path(data_dir) / "tokenizers" / f"bpe{vocab_size}-{digest(tok_cfg['train'])}"
    if (out / "tokenizer.json").is_file():
        return out
    with file_lock(out.with_suffix(".lock")):
        if (out / "tokenizer.json").is_file():  # another process finished it meanwhile
            return out
        log.info("training a %d-token BPE tokenizer on %s -> %s", vocab_size, corpus, out)
        spec.setdefault("show_progress", sys.stderr.isatty())  # the tokenizers library's bar
        tok = AutoTokenizer.train(_corpus_texts(corpus, max_bytes), vocab_size, **spec)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out
