"""Tokenize raw data into HDF5 storages: ``python -m astrai.data.prepare``.

::

    python -m astrai.data.prepare kind=pretrain input=corpus/ output=data/ tokenizer=tok/
    python -m astrai.data.prepare kind=sft input=chat.jsonl output=data/ tokenizer=tok/ pack=true window_size=2048
    python -m astrai.data.prepare kind=prompt input=builtin:arithmetic/prompt output=data/ tokenizer=tok/

Kinds and the fields their records need:

- ``pretrain``: ``.txt`` / ``.md`` files (one document each) or JSON(L) records with a
  ``text`` field (``text_field``); keys ``input_ids`` (eos appended, bos if ``add_bos``).
- ``sft``: ``messages`` (chat with roles, optional ``tools``), rendered with the tokenizer's chat
  template; keys ``input_ids`` and ``loss_mask`` (1 on assistant tokens only), and
  ``position_ids`` when ``pack=true`` packs short documents into ``window_size`` windows.
- ``preference``: ``prompt`` (string or messages), ``chosen`` and ``rejected`` (string or
  messages); keys ``chosen_ids``, ``chosen_mask``, ``rejected_ids``, ``rejected_mask``.
- ``prompt`` (GRPO): ``prompt`` plus ``required_fields`` (e.g. ``[answer]``); keys
  ``prompt_ids`` (generation prompt included) and ``records`` (each record as JSON).

Output is ``<output>/<name>.h5``, or with ``shard_size`` (input records per shard) a directory
``<output>/<name>/`` of shards. Everything is written under a ``.tmp`` name and renamed on
success, so readers never see partial output. A rerun of the same command after an interruption
reuses the finished shards and restarts the rest; a finished output is left alone unless the
options differ, which is an error without ``overwrite=true``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from astrai.data.builtin import builtin_records
from astrai.data.storage import (
    FORMAT_VERSION,
    DataError,
    H5Storage,
    H5Writer,
    JsonStorage,
    token_dtype,
)

log = logging.getLogger(__name__)

KINDS = ("pretrain", "sft", "preference", "prompt")
TEXT_SUFFIXES = (".txt", ".md")
RECORD_SUFFIXES = (".json", ".jsonl")
BUILTIN_PREFIX = "builtin:"
TOKEN_KEYS = ("input_ids", "chosen_ids", "rejected_ids", "prompt_ids")


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


@dataclass
class _Options:
    kind: str
    max_length: int | None
    pack: bool
    window_size: int | None
    truncate: bool
    skip_bad_lines: bool
    text_field: str
    add_bos: bool
    add_eos: bool
    required_fields: list[str]


# ------------------------------------------------------------------------------------ reading


def _input_files(path: Path, kind: str) -> list[Path]:
    suffixes = RECORD_SUFFIXES + (TEXT_SUFFIXES if kind == "pretrain" else ())
    if path.is_file():
        if path.suffix not in suffixes:
            raise DataError(f"{path}: kind={kind} reads {', '.join(suffixes)} files")
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix in suffixes
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"{path}: no input files ({', '.join(suffixes)}) in this directory")
        return files
    raise FileNotFoundError(f"input not found: {path}")


def _iter_input(input: str, kind: str, builtin: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yield ``(where, record)`` in input order; ``where`` is ``file:line`` for messages.

    A JSONL line that is not JSON comes as a :class:`DataError` record, so that the caller
    raises it or counts it in the shard it belongs to.
    """
    if input.startswith(BUILTIN_PREFIX):
        name = input[len(BUILTIN_PREFIX) :]
        for i, record in enumerate(builtin_records(name, **dict(builtin)), start=1):
            yield f"{input}#{i}", record
        return
    for path in _input_files(Path(input), kind):
        if path.suffix in TEXT_SUFFIXES:
            yield str(path), {"text": path.read_text(encoding="utf-8", errors="replace")}
            continue
        for line, record in JsonStorage(path).iter_records(with_errors=True):
            yield f"{path}:{line}", record


def _input_identity(input: str, builtin: Mapping[str, Any], kind: str) -> Any:
    """What the signature records about the input: names, sizes and mtimes of the files."""
    if input.startswith(BUILTIN_PREFIX):
        return {"builtin": input, "options": dict(builtin)}
    files = _input_files(Path(input), kind)
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


# ----------------------------------------------------------------------------------- encoding


class _Skip(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _require(record: Any, fields: Sequence[str], where: str) -> None:
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in fields:
        if name not in record:
            raise DataError(
                f"{where}: record is missing required field {name!r} (has: {sorted(record)})"
            )


def _as_messages(value: Any, role: str, where: str, name: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return [dict(m) for m in value]
    raise DataError(f"{where}: field {name!r} must be a string, a message or a list of messages")


def _fit(ids: list[int], mask: list[int], opts: _Options) -> tuple[list[int], list[int]]:
    if opts.max_length is not None and len(ids) > opts.max_length:
        if not opts.truncate:
            raise _Skip("too_long")
        ids, mask = ids[: opts.max_length], mask[: opts.max_length]
    if not any(mask):
        raise _Skip("no_assistant_tokens")
    return ids, mask


def _encode_chat(tok: Any, messages: Any, tools: Any, where: str) -> tuple[list[int], list[int]]:
    try:
        return tok.encode_chat(messages, tools=tools)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{where}: cannot render the chat: {exc}") from exc


def _encode_record(tok: Any, record: Any, where: str, opts: _Options) -> dict[str, Any]:
    """One document's arrays for a non-pretrain record; raises _Skip or DataError."""
    if opts.kind == "sft":
        _require(record, ["messages"], where)
        ids, mask = _encode_chat(tok, record["messages"], record.get("tools"), where)
        ids, mask = _fit(ids, mask, opts)
        return {"input_ids": ids, "loss_mask": mask}
    if opts.kind == "preference":
        _require(record, ["prompt", "chosen", "rejected"], where)
        prompt = _as_messages(record["prompt"], "user", where, "prompt")
        out: dict[str, Any] = {}
        for side in ("chosen", "rejected"):
            msgs = prompt + _as_messages(record[side], "assistant", where, side)
            ids, mask = _encode_chat(tok, msgs, record.get("tools"), where)
            out[f"{side}_ids"], out[f"{side}_mask"] = _fit(ids, mask, opts)
        return out
    if opts.kind == "prompt":
        _require(record, ["prompt", *opts.required_fields], where)
        msgs = _as_messages(record["prompt"], "user", where, "prompt")
        try:
            ids = tok.apply_chat_template(
                msgs, tools=record.get("tools"), add_generation_prompt=True, tokenize=True
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"{where}: cannot render the prompt: {exc}") from exc
        if opts.max_length is not None and len(ids) > opts.max_length:
            raise _Skip("too_long")
        return {"prompt_ids": ids, "records": json.dumps(record, ensure_ascii=False)}
    raise AssertionError(opts.kind)


def _pretrain_text(record: Any, where: str, opts: _Options) -> str:
    if isinstance(record, str):
        return record
    _require(record, [opts.text_field], where)
    text = record[opts.text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {opts.text_field!r} must be a string")
    return text


# ------------------------------------------------------------------------------------ writing


def _dtypes(kind: str, vocab_size: int, window_size: int | None, pack: bool) -> dict[str, Any]:
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
    return {"prompt_ids": ids}


class _Packer:
    """Greedy in-order packing of documents into windows of at most ``window_size`` tokens."""

    def __init__(self, writer: H5Writer, window_size: int) -> None:
        self.writer, self.window_size = writer, window_size
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.pos: list[int] = []
        self.windows = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        if len(self.ids) + len(ids) > self.window_size:
            self.flush()
        self.ids += ids
        self.mask += mask
        self.pos += range(len(ids))

    def flush(self) -> None:
        if self.ids:
            self.writer.add(input_ids=self.ids, loss_mask=self.mask, position_ids=self.pos)
            self.windows += 1
            self.ids, self.mask, self.pos = [], [], []


def _signature(opts: _Options, fingerprint: str, identity: Any, shard_size: int | None) -> str:
    payload = {
        "format_version": FORMAT_VERSION,
        "options": asdict(opts),
        "tokenizer": fingerprint,
        "input": identity,
        "shard_size": shard_size,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _shard_stats(path: Path) -> dict[str, Any] | None:
    """Stats and signature of a finished shard, or None if it cannot be read."""
    try:
        with H5Storage(path) as storage:
            attrs = storage.attrs
    except (DataError, OSError) as exc:
        log.warning("ignoring unreadable shard %s: %s", path, exc)
        return None
    return {"signature": attrs.get("signature"), "stats": attrs.get("stats") or {}}


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        from astrai.tokenizer import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    return tokenizer


def _default_name(input: str) -> str:
    if input.startswith(BUILTIN_PREFIX):
        return input[len(BUILTIN_PREFIX) :].strip("/").replace("/", "-")
    p = Path(input)
    return p.stem if p.is_file() else p.resolve().name


# ---------------------------------------------------------------------------------------- run


class _Run:
    """Feeds records into shards; each shard is a fresh ``H5Writer`` or a finished file that a
    previous run of the same command left (reused, its counts read from its attributes)."""

    def __init__(
        self,
        tok: Any,
        opts: _Options,
        *,
        shard_path: Any,
        sharded: bool,
        dtypes: dict[str, Any],
        string_keys: list[str],
        attrs: dict[str, Any],
        batch_size: int,
    ) -> None:
        self.tok, self.opts = tok, opts
        self.shard_path, self.sharded = shard_path, sharded
        self.dtypes, self.string_keys, self.attrs = dtypes, string_keys, attrs
        self.batch_size = batch_size
        self.totals: Counter = Counter()
        self.counts: Counter = Counter()
        self.shard = -1
        self.writer: H5Writer | None = None
        self.packer: _Packer | None = None
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
            self.packer = _Packer(self.writer, self.opts.window_size)

    def close(self) -> None:
        if self.reused:
            info = _shard_stats(self.shard_path(self.shard)) or {}
            self.totals.update(info.get("stats") or {})
            self.reused_shards += 1
            return
        assert self.writer is not None
        self._flush_pending()
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
            if opts.kind == "pretrain":
                text = _pretrain_text(record, where, opts)
                if not text:
                    raise _Skip("empty")
                self.pending.append(text)
                if len(self.pending) >= self.batch_size:
                    self._flush_pending()
                return
            doc = _encode_record(self.tok, record, where, opts)
        except _Skip as skip:
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
            self.writer.add(**doc)
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


# -------------------------------------------------------------------------------------- main


def prepare(
    kind: str,
    input: str | os.PathLike,
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
    overwrite: bool = False,
    progress: bool = True,
    batch_size: int = 256,
    builtin: Mapping[str, Any] | None = None,
) -> PrepareResult:
    """Tokenize ``input`` into ``<output>/<name>.h5`` (or ``<output>/<name>/`` when sharded).

    ``tokenizer`` is an ``AutoTokenizer`` or its directory; ``name`` defaults to the input's
    stem. Records longer than ``max_length`` tokens are skipped, or cut when ``truncate``.
    ``skip_bad_lines`` skips and counts lines that are not JSON and records that lack a field
    or do not render, instead of stopping at the first one with an error naming file and line.
    ``builtin`` holds options for ``builtin:`` inputs (``n``, ``seed``, ``max_files``, ...).
    Returns the counts; the CLI prints ``result.summary()``.
    """
    started = time.perf_counter()
    if kind not in KINDS:
        raise DataError(f"kind must be one of {KINDS}, got {kind!r}")
    input = os.fspath(input)
    if pack and kind != "sft":
        where = (
            "pretrain data is windowed at load time (PretrainDataset window_size/stride; "
            "reset_position_ids=true for per-document positions)"
            if kind == "pretrain"
            else f"kind={kind} keeps one sequence per record"
        )
        raise DataError(f"pack=true applies to kind=sft only: {where}")
    if pack and not window_size:
        raise DataError("pack=true needs window_size (the length of a packed window)")
    if shard_size is not None and shard_size < 1:
        raise DataError(f"shard_size must be a positive number of records, got {shard_size}")
    if pack:
        max_length = min(max_length or window_size, window_size)  # type: ignore[type-var]
    opts = _Options(
        kind=kind,
        max_length=max_length,
        pack=pack,
        window_size=window_size,
        truncate=truncate,
        skip_bad_lines=skip_bad_lines,
        text_field=text_field,
        add_bos=add_bos,
        add_eos=add_eos,
        required_fields=list(required_fields),
    )
    builtin = dict(builtin or {})
    identity = _input_identity(input, builtin, kind)  # also: input exists and has files
    tok = _load_tokenizer(tokenizer)
    fingerprint = str(tok.fingerprint)
    name = name or _default_name(input)
    signature = _signature(opts, fingerprint, identity, shard_size)
    output_dir = Path(output)
    final = output_dir / (f"{name}.h5" if shard_size is None else name)
    result = PrepareResult(path=str(final), kind=kind)

    output_dir.mkdir(parents=True, exist_ok=True)
    replacing = False
    stale = Path(f"{final}.tmp")
    if stale.is_file():
        log.warning("removing %s left by an interrupted run", stale)
        stale.unlink()
    if final.exists():
        if _finished_signature(final) == signature and not overwrite:
            _add_existing_stats(final, result)
            result.seconds = time.perf_counter() - started
            log.info("%s is already prepared with these options; nothing to do", final)
            return result
        if not overwrite:
            raise DataError(
                f"{final} exists and was prepared from other input or options; pass "
                f"overwrite=true to replace it, or choose another output or name"
            )
        replacing = True

    if shard_size is None:
        tmp_dir = None

        def shard_path(_index: int) -> Path:
            return final
    else:
        tmp_dir = output_dir / f"{name}.tmp"
        tmp_dir.mkdir(exist_ok=True)
        _clean_partial_dir(tmp_dir, signature)

        def shard_path(index: int) -> Path:
            return tmp_dir / f"{name}-{index:05d}.h5"

    run = _Run(
        tok,
        opts,
        shard_path=shard_path,
        sharded=shard_size is not None,
        dtypes=_dtypes(kind, tok.vocab_size, window_size, pack),
        string_keys=["records"] if kind == "prompt" else [],
        attrs={
            "kind": kind,
            "tokenizer_fingerprint": fingerprint,
            "vocab_size": tok.vocab_size,
            "signature": signature,
            "pack": pack,
            "window_size": window_size or 0,
            "created_by": "astrai.data.prepare",
            **{
                f"{role}_token_id": -1 if tid is None else int(tid)
                for role, tid in (
                    ("bos", tok.bos_token_id),
                    ("eos", tok.eos_token_id),
                    ("pad", tok.pad_token_id),
                )
            },
        },
        batch_size=batch_size,
    )
    bar = tqdm(desc=f"prepare {kind}", unit=" rec", disable=not progress, dynamic_ncols=True)
    try:
        run.open()
        in_shard = 0
        for where, record in _iter_input(input, kind, builtin):
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
            records = run.total("records")
            raise DataError(
                f"{input}: empty input, no documents to write"
                + (f" ({records} records, all skipped)" if records else "")
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
        if replacing:  # overwrite=true: the old output goes only now that the new one is done
            shutil.rmtree(final) if final.is_dir() else final.unlink()
        os.replace(tmp_dir, final)
    if replacing:
        log.warning("overwrite=true: replaced %s", final)

    totals = run.totals
    result.records = totals["records"]
    result.documents = totals["documents"]
    result.tokens = totals["tokens"]
    result.windows = totals["windows"]
    result.bad_lines = totals["bad_lines"]
    result.skipped = {
        k.split(":", 1)[1]: v for k, v in sorted(totals.items()) if k.startswith("skipped:") and v
    }
    result.shards_written, result.shards_reused = run.written, run.reused_shards
    result.seconds = time.perf_counter() - started
    log.info(result.summary())
    return result


def _finished_signature(final: Path) -> str | None:
    paths = sorted(final.glob("*.h5")) if final.is_dir() else [final]
    sigs = {(_shard_stats(p) or {}).get("signature") for p in paths}
    return sigs.pop() if len(sigs) == 1 else None


def _add_existing_stats(final: Path, result: PrepareResult) -> None:
    paths = sorted(final.glob("*.h5")) if final.is_dir() else [final]
    total: Counter = Counter()
    for p in paths:
        total.update((_shard_stats(p) or {}).get("stats") or {})
    result.records = total["records"]
    result.documents = total["documents"]
    result.tokens = total["tokens"]
    result.windows = total["windows"]
    result.bad_lines = total["bad_lines"]
    result.skipped = {k.split(":", 1)[1]: v for k, v in total.items() if k.startswith("skipped:")}
    result.shards_reused = len(paths)


def _clean_partial_dir(tmp_dir: Path, signature: str) -> None:
    """Keep finished shards of this very command; drop ``.tmp`` files and other runs' shards."""
    for p in sorted(tmp_dir.iterdir()):
        if p.name.endswith(".tmp"):
            log.warning("removing %s left by an interrupted run", p)
            p.unlink()
        elif p.suffix == ".h5":
            info = _shard_stats(p)
            if info is None or info.get("signature") != signature:
                log.warning("removing %s: left by an interrupted run with other options", p)
                p.unlink()


# --------------------------------------------------------------------------------------- CLI

CONF_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))


def _cli(cfg: Any) -> PrepareResult:
    from omegaconf import OmegaConf

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
    """Entry point of ``python -m astrai.data.prepare`` (Hydra; config ``conf/prepare.yaml``)."""
    import hydra

    from astrai.cli import rename_overrides

    rename_overrides({"tokenizer": "tokenizer_path"})
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="prepare")(_cli)()


if __name__ == "__main__":
    main()
