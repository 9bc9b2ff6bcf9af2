"""Tokenize raw data into HDF5 storages: ``python -m astrai.data.prepare``.

::

    python -m astrai.data.prepare kind=pretrain input=corpus/ output=data/ tokenizer_path=tok/
    python -m astrai.data.prepare kind=sft input=chat.jsonl output=data/ tokenizer_path=tok/ pack=true window_size=2048
    python -m astrai.data.prepare kind=prompt input=builtin:arithmetic/prompt output=data/ tokenizer_path=tok/
    python -m astrai.data.prepare kind=sft input=chat.jsonl output=data/ tokenizer_path=tok/ teacher=teacher/ teacher_top_k=16

Kinds and the fields their records need:

- ``pretrain``: ``.txt`` / ``.md`` files (one document each) or JSON(L) records with a
  ``text`` field (``text_field``); keys ``input_ids`` (eos appended, bos if ``add_bos``).
- ``sft``: ``messages`` (chat with roles, optional ``tools``), rendered with the tokenizer's chat
  template; keys ``input_ids`` and ``loss_mask`` (1 on assistant tokens only), and
  ``position_ids`` when ``pack=true`` packs short documents into ``window_size`` windows
  (``packing_strategy=greedy|bfd``: in input order, or best-fit decreasing, TRL's ``bfd``).
- ``preference``: ``prompt`` (string or messages), ``chosen`` and ``rejected`` (string or
  messages); keys ``chosen_ids``, ``chosen_mask``, ``rejected_ids``, ``rejected_mask``.
  With ``teacher=<export dir> teacher_top_k=<k>`` also ``teacher_topk_ids`` and
  ``teacher_topk_logprobs``: the teacher's top-k next tokens and log-probs at every target
  position (offline distillation; :mod:`astrai.data.teacher_topk`).
- ``prompt`` (GRPO): ``prompt`` plus ``required_fields`` (e.g. ``[answer]``); keys
  ``prompt_ids`` (generation prompt included) and ``records`` (each record as JSON).
- ``unpaired`` (KTO; TRL's "unpaired preference"): ``prompt`` and ``completion`` (string or
  messages) and ``label`` (``true`` = desirable, ``false`` = undesirable; anything else is an
  error naming file, line and ``label``); keys ``prompt_ids`` (the rendered prompt with its
  generation prompt), ``completion_ids``, ``completion_mask`` (1 on its assistant tokens) and
  ``label`` (one 0/1 element). With ``max_length``, a record whose prompt alone fills it is
  skipped; ``truncate`` cuts the completion's end.

Records of another layout are mapped to these first: ``format=sharegpt`` (``conversations`` of
``{from, value}`` turns), ``format=trl`` (TRL's standard and conversational forms),
``format=alpaca`` (``instruction``/``input``/``output``), and ``columns`` renames fields
(``columns={messages: conv}``); :mod:`astrai.data.formats` and docs/data.md "Formats".

Output is ``<output>/<name>.h5``, or with ``shard_size`` (input records per shard) a directory
``<output>/<name>/`` of shards. Everything is written under a ``.tmp`` name and renamed on
success, so readers never see partial output. A rerun of the same command after an interruption
reuses the finished shards and restarts the rest; a finished output is left alone unless the
options differ, which is an error without ``overwrite=true``. An output that is cut short or
unreadable is named as damaged, shard by shard (``overwrite=true`` prepares it again; a
training run's prepared-data cache does that by itself). Every shard stores a checksum of its
data (``content_digest``), which a training run verifies when it opens the shard.

The work is split by job: :mod:`astrai.data.encode` (options, record -> document),
:mod:`astrai.data.inputs` (files, ``builtin:`` records, tokenizer) and
:mod:`astrai.data.shards` (writing, resuming and reusing shards).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from astrai.data.encode import KINDS, PrepareOptions
from astrai.data.inputs import (
    default_name,
    input_identity,
    is_record_source,
    iter_input,
    load_tokenizer,
)
from astrai.data.shards import (
    existing_totals,
    output_path,
    output_state,
    run_signature,
    write_shards,
)
from astrai.data.storage import DataError
from astrai.data.teacher_topk import document_stage

__all__ = ["KINDS", "PrepareResult", "main", "output_path", "prepare"]

log = logging.getLogger(__name__)

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@dataclass
class PrepareResult:
    """What a prepare run produced; ``summary()`` is the line the CLI prints."""

    path: str
    kind: str
    records: int = 0
    documents: int = 0
    tokens: int = 0
    windows: int = 0
    bad_lines: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    shards_written: int = 0
    shards_reused: int = 0
    seconds: float = 0.0

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values()) + self.bad_lines

    def summary(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        packed = f", {self.windows} packed windows" if self.windows else ""
        fresh = self.seconds > 0 and not self.shards_reused
        rate = f", {self.tokens / self.seconds:,.0f} tokens/s" if fresh else ""
        return (
            f"prepared {self.kind}: {self.documents} documents, {self.tokens} tokens{packed}, "
            f"{self.num_skipped} skipped (bad lines={self.bad_lines}; {skipped}) -> {self.path}"
            f" [{self.shards_written} shard(s) written, {self.shards_reused} reused{rate}]"
        )

    def add_totals(self, totals: Counter, *, written: int = 0, reused: int = 0) -> None:
        """Fill the counts from the stats the shards record."""
        self.records = totals["records"]
        self.documents = totals["documents"]
        self.tokens = totals["tokens"]
        self.windows = totals["windows"]
        self.bad_lines = totals["bad_lines"]
        self.skipped = {
            k.split(":", 1)[1]: v
            for k, v in sorted(totals.items())
            if k.startswith("skipped:") and v
        }
        self.shards_written, self.shards_reused = written, reused


def prepare(
    kind: str,
    input: str | os.PathLike | Any,
    output: str | os.PathLike,
    tokenizer: Any,
    *,
    name: str | None = None,
    max_length: int | None = None,
    pack: bool = False,
    window_size: int | None = None,
    truncate: bool = False,
    skip_bad_lines: bool = False,
    shard_size: int | None = None,
    text_field: str = "text",
    add_bos: bool = False,
    add_eos: bool = True,
    required_fields: Sequence[str] = (),
    format: str | None = None,
    columns: Mapping[str, str] | None = None,
    packing_strategy: str = "greedy",
    truncation_mode: str = "keep_start",
    overwrite: bool = False,
    progress: bool = True,
    batch_size: int = 256,
    builtin: Mapping[str, Any] | None = None,
    teacher: str | os.PathLike | None = None,
    teacher_top_k: int | None = None,
    teacher_batch_size: int = 8,
    teacher_chunk_size: int = 1024,
    teacher_device: str = "auto",
    teacher_dtype: str | None = None,
) -> PrepareResult:
    """Tokenize ``input`` into ``<output>/<name>.h5`` (or ``<output>/<name>/`` when sharded).

    ``tokenizer`` is an ``AutoTokenizer`` or its directory; ``name`` defaults to the input's
    stem. Records longer than ``max_length`` tokens are skipped, or cut when ``truncate``
    (``truncation_mode``: ``keep_start`` keeps the first ``max_length`` tokens, ``keep_end``
    the last, TRL's names). ``pack`` packs sft documents into ``window_size`` windows by
    ``packing_strategy`` (``greedy``, in input order, or ``bfd``, best-fit decreasing per
    shard: :mod:`astrai.data.packing`).
    ``skip_bad_lines`` skips and counts lines that are not JSON and records that lack a field
    or do not render, instead of stopping at the first one with an error naming file and line.
    ``format`` names the records' layout (``openai``: astrai's own fields, the default;
    ``sharegpt``, ``trl``, ``alpaca``) and ``columns`` renames the fields it reads
    (:mod:`astrai.data.formats`).
    ``builtin`` holds options for ``builtin:`` inputs (``n``, ``seed``, ``max_files``, ...).
    ``teacher`` (kind=sft): an export directory whose top-``teacher_top_k`` next-token
    log-probs are stored with every document (:mod:`astrai.data.teacher_topk`), the teacher
    run ``teacher_batch_size`` documents at a time, its head ``teacher_chunk_size``
    positions at a time, on ``teacher_device`` in ``teacher_dtype``.
    Returns the counts; the CLI prints ``result.summary()``.
    """
    started = time.perf_counter()
    opts = PrepareOptions.parse(
        kind,
        max_length=max_length,
        pack=pack,
        window_size=window_size,
        truncate=truncate,
        skip_bad_lines=skip_bad_lines,
        text_field=text_field,
        add_bos=add_bos,
        add_eos=add_eos,
        required_fields=required_fields,
        format=format,
        columns=columns,
        packing_strategy=packing_strategy,
        truncation_mode=truncation_mode,
    )
    if not is_record_source(input):  # else records made in code (astrai.data.onpolicy)
        input = os.fspath(input)
    if shard_size is not None and shard_size < 1:
        raise DataError(f"shard_size must be a positive number of records, got {shard_size}")
    builtin = dict(builtin or {})
    identity = input_identity(input, builtin, kind)  # also: input exists and has files
    tok = load_tokenizer(tokenizer)
    stage = document_stage(
        None if teacher is None else os.fspath(teacher),
        tok,
        opts,
        top_k=teacher_top_k,
        batch_size=teacher_batch_size,
        chunk_size=teacher_chunk_size,
        device=teacher_device,
        dtype=teacher_dtype,
    )
    final = output_path(output, name or default_name(input), shard_size)
    signature = run_signature(opts, str(tok.fingerprint), identity, shard_size, stage)
    result = PrepareResult(path=str(final), kind=kind)

    final.parent.mkdir(parents=True, exist_ok=True)
    state = output_state(final, signature, overwrite)
    if state == "finished":
        totals, shards = existing_totals(final)
        result.add_totals(totals, reused=shards)
        result.seconds = time.perf_counter() - started
        log.info("%s is already prepared with these options; nothing to do", final)
        return result
    run = write_shards(
        iter_input(input, kind, builtin),
        tok,
        opts,
        final=final,
        signature=signature,
        shard_size=shard_size,
        batch_size=batch_size,
        replace=state == "replace",
        progress=progress and sys.stderr.isatty(),  # a bar on a terminal, not in log files
        source=str(input),
        stage=stage,
    )
    result.add_totals(run.totals, written=run.written, reused=run.reused_shards)
    result.seconds = time.perf_counter() - started
    log.info(result.summary())
    return result


# --------------------------------------------------------------------------------------- CLI


def _cli(cfg: DictConfig) -> PrepareResult:
    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    options = {k: v for k, v in options.items() if k != "hydra"}
    options["tokenizer"] = options.pop("tokenizer_path")
    try:
        result = prepare(**options)
    except (DataError, FileNotFoundError) as exc:
        log.error("%s", exc)
        sys.exit(1)
    print(result.summary(), flush=True)
    return result


def main() -> None:
    """Entry point of ``python -m astrai.data.prepare`` (Hydra; config ``conf/prepare.yaml``).

    The tokenizer directory is ``tokenizer_path=<dir>``: ``tokenizer`` names the training
    config group in ``conf/``, so ``tokenizer=<dir>`` is refused naming ``tokenizer_path``, and
    any other key the config lacks with the keys it may mean (``astrai.cli_keys``).
    """
    from astrai.cli_keys import command_line

    sys.argv[1:] = command_line("prepare", sys.argv[1:])
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="prepare")(_cli)()


if __name__ == "__main__":
    main()
