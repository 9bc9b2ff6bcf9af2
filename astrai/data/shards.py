"""Writing ``prepare``'s output: records go into one HDF5 file, or into a directory of shards of
``shard_size`` records each. Every file is written under a ``.tmp`` name and renamed when
complete, so readers never see partial output; a rerun of the same command (same signature)
reuses the finished shards of an interrupted run and restarts the rest."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm

from astrai.data.encode import TOKEN_KEYS, PrepareOptions, Skip, encode_record, pretrain_text
from astrai.data.formats import record_format
from astrai.data.packing import Packer, make_packer
from astrai.data.storage import FORMAT_VERSION, DataError, H5Storage, H5Writer, token_dtype
from astrai.data.storage.h5 import DamagedDataError
from astrai.data.teacher_topk import DocumentStage

log = logging.getLogger(__name__)


def output_path(output: str | os.PathLike, name: str, shard_size: int | None) -> Path:
    """Where a run writes: ``<output>/<name>.h5``, or the shard directory ``<output>/<name>``."""
    return Path(output) / (f"{name}.h5" if shard_size is None else name)


def run_signature(
    opts: PrepareOptions,
    fingerprint: str,
    identity: Any,
    shard_size: int | None,
    stage: DocumentStage,
) -> str:
    """What makes two runs the same: format, options, tokenizer, input, sharding and what the
    document stage adds (a teacher's digest and k; nothing without one)."""
    payload = {
        "format_version": FORMAT_VERSION,
        "options": opts.signature(),
        "tokenizer": fingerprint,
        "input": identity,
        "shard_size": shard_size,
        **stage.signature(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def output_state(
    final: Path, signature: str, overwrite: bool
) -> Literal["new", "finished", "replace"]:
    """``finished``: ``final`` holds this very run's output; ``replace``: another run's, and
    ``overwrite`` is set (it goes only once the new output is complete); ``new`` otherwise.
    Removes a ``.tmp`` file an interrupted run left; refuses to touch another run's output
    without ``overwrite``."""
    stale = Path(f"{final}.tmp")
    if stale.is_file():
        log.warning("removing %s left by an interrupted run", stale)
        stale.unlink()
    if not final.exists():
        return "new"
    if overwrite:
        return "replace"
    damaged = damaged_shards(final)
    if damaged:
        raise DamagedOutputError(
            f"{final} is damaged: "
            + "; ".join(f"{p}: {why}" for p, why in damaged)
            + "; pass overwrite=true to prepare it again"
        )
    if finished_signature(final) == signature:
        return "finished"
    raise DataError(
        f"{final} exists and was prepared from other input or options; pass "
        f"overwrite=true to replace it, or choose another output or name"
    )


class DamagedOutputError(DamagedDataError):
    """``prepare``'s output is there but cut short or unreadable (not another run's output)."""


def damaged_shards(final: Path) -> list[tuple[Path, str]]:
    """The files of an output HDF5 cannot open or whose layout is broken, with the reason
    (metadata only: a checksum mismatch is found when training opens the data)."""
    paths = sorted(final.glob("*.h5")) if final.is_dir() else [final]
    found = []
    for path in paths:
        try:
            H5Storage(path).close()
        except (DataError, OSError) as exc:
            found.append((path, str(exc).removeprefix(f"{path}: ")))
    return found


def _dtypes(kind: str, vocab_size: int, window_size: int | None, pack: bool) -> dict[str, Any]:
    """The token keys of a kind and their dtypes (ids sized to the vocabulary, masks uint8)."""
    ids = token_dtype(vocab_size)
    if kind == "pretrain":
        return {"input_ids": ids}
    if kind == "sft":
        out = {"input_ids": ids, "loss_mask": np.uint8}
        if pack:
            out["position_ids"] = token_dtype(window_size or 0)
        return out
    if kind == "preference":
        return {
            "chosen_ids": ids,
            "chosen_mask": np.uint8,
            "rejected_ids": ids,
            "rejected_mask": np.uint8,
        }
    if kind == "unpaired":
        return {
            "prompt_ids": ids,
            "completion_ids": ids,
            "completion_mask": np.uint8,
            "label": np.uint8,
        }
    return {"prompt_ids": ids}


def _shard_stats(path: Path) -> dict[str, Any] | None:
    """Stats and signature of a finished shard, or None if it cannot be read."""
    try:
        with H5Storage(path) as storage:
            attrs = storage.attrs
    except (DataError, OSError) as exc:
        log.warning("unreadable shard %s: %s", path, exc)
        return None
    return {"signature": attrs.get("signature"), "stats": attrs.get("stats") or {}}


class ShardRun:
    """Feeds records into shards; each shard is a fresh ``H5Writer`` or a finished file that a
    previous run of the same command left (reused, its counts read from its attributes)."""

    def __init__(
        self,
        tok: Any,
        opts: PrepareOptions,
        *,
        shard_path: Callable[[int], Path],
        sharded: bool,
        dtypes: dict[str, Any],
        string_keys: list[str],
        attrs: dict[str, Any],
        batch_size: int,
        stage: DocumentStage,
    ) -> None:
        self.tok, self.opts, self.stage = tok, opts, stage
        self.record_format = record_format(opts.format, opts.columns, opts.kind)
        self.shard_path, self.sharded = shard_path, sharded
        self.dtypes, self.string_keys, self.attrs = dtypes, string_keys, attrs
        self.batch_size = batch_size
        self.totals: Counter = Counter()
        self.counts: Counter = Counter()
        self.shard = -1
        self.writer: H5Writer | None = None
        self.packer: Packer | None = None
        self.reused = False
        self.pending: list[str] = []
        self.written = 0
        self.reused_shards = 0

    # -- shards -------------------------------------------------------------------------------
    def open(self) -> None:
        self.shard += 1
        self.counts = Counter()
        path = self.shard_path(self.shard)
        self.reused = self.sharded and path.exists()
        if self.reused:
            log.info("reusing finished shard %s", path)
            return
        self.writer = H5Writer(
            path, dtypes=self.dtypes, string_keys=self.string_keys, attrs=self.attrs
        )
        if self.opts.pack and self.opts.window_size:
            self.packer = make_packer(
                self.opts.packing_strategy, self.writer, self.opts.window_size
            )

    def close(self) -> None:
        if self.reused:
            info = _shard_stats(self.shard_path(self.shard)) or {}
            self.totals.update(info.get("stats") or {})
            self.reused_shards += 1
            return
        assert self.writer is not None
        self._flush_pending()
        for doc in self.stage.flush():
            self.writer.add(**doc)
        if self.packer is not None:
            self.packer.flush()
            self.counts["windows"] += self.packer.windows
            self.packer = None
        self.writer.attrs["stats"] = {k: v for k, v in self.counts.items() if v}
        if self.sharded:
            self.writer.attrs["shard_index"] = self.shard
        self.writer.close()
        self.writer = None
        self.totals.update(self.counts)
        self.written += 1

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def total(self, key: str) -> int:
        return self.totals[key] + (0 if self.reused else self.counts[key])

    # -- records ------------------------------------------------------------------------------
    def feed(self, where: str, record: Any) -> None:
        if self.reused:
            return
        self.counts["records"] += 1
        opts = self.opts
        try:
            if isinstance(record, DataError):
                raise record
            record = self.record_format.map(record, where)
            if opts.kind == "pretrain":
                text = pretrain_text(record, where, opts)
                if not text:
                    raise Skip("empty")
                self.pending.append(text)
                if len(self.pending) >= self.batch_size:
                    self._flush_pending()
                return
            doc = encode_record(self.tok, record, where, opts)
        except Skip as skip:
            self.counts[f"skipped:{skip.reason}"] += 1
            return
        except DataError as exc:
            if not opts.skip_bad_lines:
                raise
            log.warning("skipping %s", exc)
            self.counts["bad_lines" if isinstance(record, DataError) else "skipped:bad_record"] += 1
            return
        if self.packer is not None:
            self.packer.add(doc["input_ids"], doc["loss_mask"])
        else:
            assert self.writer is not None
            for ready in self.stage.add(doc):
                self.writer.add(**ready)
        self.counts["documents"] += 1
        self.counts["tokens"] += sum(len(doc[k]) for k in TOKEN_KEYS if k in doc)

    def _flush_pending(self) -> None:
        if not self.pending:
            return
        tok, opts = self.tok, self.opts
        assert self.writer is not None
        for ids in tok.batch_encode(self.pending):
            if opts.add_bos and tok.bos_token_id is not None:
                ids = [tok.bos_token_id, *ids]
            if opts.add_eos and tok.eos_token_id is not None:
                ids = [*ids, tok.eos_token_id]
            self.writer.add(input_ids=ids)
            self.counts["documents"] += 1
            self.counts["tokens"] += len(ids)
        self.pending = []


def finished_signature(final: Path) -> str | None:
    """The signature all shards of a finished output share, or None (mixed or unreadable)."""
    paths = sorted(final.glob("*.h5")) if final.is_dir() else [final]
    sigs = {(_shard_stats(p) or {}).get("signature") for p in paths}
    return sigs.pop() if len(sigs) == 1 else None


def existing_totals(final: Path) -> tuple[Counter, int]:
    """The counts a finished output recorded, summed over its shards, and its shard count."""
    paths = sorted(final.glob("*.h5")) if final.is_dir() else [final]
    total: Counter = Counter()
    for p in paths:
        total.update((_shard_stats(p) or {}).get("stats") or {})
    return total, len(paths)


def _clean_partial_dir(tmp_dir: Path, signature: str) -> None:
    """Keep finished shards of this very command; drop ``.tmp`` files and other runs' shards."""
    for p in sorted(tmp_dir.iterdir()):
        if p.name.endswith(".tmp"):
            log.warning("removing %s left by an interrupted run", p)
            p.unlink()
        elif p.suffix == ".h5":
            info = _shard_stats(p)
            if info is None:
                log.warning("removing %s: damaged (see above); it is written again", p)
                p.unlink()
            elif info.get("signature") != signature:
                log.warning("removing %s: left by an interrupted run with other options", p)
                p.unlink()


def write_shards(
    records: Iterable[tuple[str, Any]],
    tok: Any,
    opts: PrepareOptions,
    *,
    final: Path,
    signature: str,
    shard_size: int | None,
    batch_size: int,
    replace: bool,
    progress: bool,
    source: str,
    stage: DocumentStage,
) -> ShardRun:
    """Feed ``(where, record)`` pairs into ``final`` (one file, or shards of ``shard_size``
    records) and move the result into place; ``replace`` removes the previous output only
    then. On any error the unfinished file is removed; finished shards stay for a rerun."""
    name = final.name
    tmp_dir: Path | None = None
    if shard_size is None:

        def shard_path(_index: int) -> Path:
            return final
    else:
        tmp_dir = final.parent / f"{name}.tmp"
        tmp_dir.mkdir(exist_ok=True)
        _clean_partial_dir(tmp_dir, signature)
        shards = tmp_dir

        def shard_path(index: int) -> Path:
            return shards / f"{name}-{index:05d}.h5"

    run = ShardRun(
        tok,
        opts,
        shard_path=shard_path,
        sharded=shard_size is not None,
        dtypes={
            **_dtypes(opts.kind, tok.vocab_size, opts.window_size, opts.pack),
            **stage.dtypes(),
        },
        string_keys=["records"] if opts.kind == "prompt" else [],
        attrs={**_shard_attrs(tok, opts, signature), **stage.attrs()},
        batch_size=batch_size,
        stage=stage,
    )
    bar = tqdm(desc=f"prepare {opts.kind}", unit=" rec", disable=not progress, dynamic_ncols=True)
    try:
        run.open()
        in_shard = 0
        for where, record in records:
            if shard_size is not None and in_shard == shard_size:
                run.close()
                run.open()
                in_shard = 0
            in_shard += 1
            run.feed(where, record)
            bar.update(1)
            if bar.n % 256 == 0:
                bar.set_postfix(tokens=run.total("tokens"), refresh=False)
        if run.total("documents") + len(run.pending) == 0:
            count = run.total("records")
            raise DataError(
                f"{source}: empty input, no documents to write"
                + (f" ({count} records, all skipped)" if count else "")
            )
        run.close()
    except BaseException:
        run.abort()
        if tmp_dir is not None and not any(tmp_dir.glob("*.h5")):
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        bar.close()

    if tmp_dir is not None:
        if replace:  # overwrite=true: the old output goes only now that the new one is done
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        os.replace(tmp_dir, final)
    if replace:
        log.warning("overwrite=true: replaced %s", final)
    return run


def _shard_attrs(tok: Any, opts: PrepareOptions, signature: str) -> dict[str, Any]:
    """Attributes of every shard: what a reader checks (kind, tokenizer) and special ids."""
    return {
        "kind": opts.kind,
        "tokenizer_fingerprint": str(tok.fingerprint),
        "vocab_size": tok.vocab_size,
        "signature": signature,
        "pack": opts.pack,
        "window_size": opts.window_size or 0,
        "created_by": "astrai.data.prepare",
        **{
            f"{role}_token_id": -1 if tid is None else int(tid)
            for role, tid in (
                ("bos", tok.bos_token_id),
                ("eos", tok.eos_token_id),
                ("pad", tok.pad_token_id),
            )
        },
    }
