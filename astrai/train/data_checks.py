"""The training data's pre-run checks (`astrai.train.preflight`): what the config and the
files tell in seconds, before a tokenizer is trained, data prepared or a model built.

- size: enough training samples for one batch per device, from an upper bound of the
  samples: built-in arithmetic `n`, JSONL line counts, and byte sizes as a token bound
  (byte-level BPE: a token covers one byte or more) for corpora and for SFT records packed
  into windows (`prepare.pack`: many records make one sample, so a file of many short chats
  can still give fewer samples than one batch);
- settings: `data.use_dynamic_bsz` and `data.max_token_len_per_gpu` (verl's token budget,
  with `data.padding_free`), as the data module refuses them;
- syntax: every line of a JSONL file the run prepares is JSON (files up to
  `JSONL_CHECK_BYTES`), so a broken line fails here, naming file and line, not during
  preparation once the run folder and the model exist (`prepare.skip_bad_lines=true` skips
  such lines instead).

What only preparation can tell is checked by `runner.train` after `fit`
(`NoTrainingBatchesError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from astrai.data.builtin import is_builtin
from astrai.data.storage import DataError, JsonStorage

__all__ = [
    "JSONL_CHECK_BYTES",
    "RECORD_SLACK_TOKENS",
    "batching_problems",
    "data_problems",
    "jsonl_problems",
    "mixture_problems",
    "packed_windows_bound",
    "sample_bound",
]

SPLITS = ("train", "val", "test")
TEXT_SUFFIXES = (".jsonl", ".txt", ".md", ".py")  # raw corpora whose bytes bound the tokens
#: JSONL files are parsed line by line before the run up to this size in all (about a second)
JSONL_CHECK_BYTES = 64 << 20
#: tokens a chat template may add to a record beyond its JSON bytes (a default system prompt)
RECORD_SLACK_TOKENS = 64


def _lines_at_least(files: Iterable[Path], need: int) -> int:
    """Non-empty lines in `files`, counted up to `need` (a big file is not read to its end)."""
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                n += bool(line.strip())
                if n >= need:
                    return n
    return n


def _files(source: Path) -> list[Path]:
    return sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]


def _line_sizes(files: Iterable[Path]) -> Iterator[int]:
    for f in files:
        with open(f, "rb") as fh:
            yield from (len(line) for line in fh if line.strip())


def packed_windows_bound(line_bytes: Iterable[int], window: int, max_length: int, need: int) -> int:
    """An upper bound on the windows that greedy in-order packing of records of at most
    `line_bytes[i] + RECORD_SLACK_TOKENS` tokens (each cut at `max_length`) into `window`
    tokens makes, read up to `need`: every window but the last holds more than `window` minus
    the longest record, so windows <= tokens // (window - longest + 1) + 1, and <= records."""
    records = tokens = longest = 0
    bound = 0
    for size in line_bytes:
        t = min(size + RECORD_SLACK_TOKENS, max_length, window)
        records, tokens, longest = records + 1, tokens + t, max(longest, t)
        bound = min(records, tokens // (window - longest + 1) + 1)
        if bound >= need:
            break
    return bound


def sample_bound(spec: DictConfig, need: int) -> tuple[int, str] | None:
    """An upper bound on the training samples of `spec` (`need` or more: enough) with what it
    counts, or None when only preparing the data would tell."""
    source = spec.get("source")
    prepare = spec.get("prepare")
    if not isinstance(source, str) or prepare is None:
        return None  # record sources, already prepared storage
    pretrain = "Pretrain" in str(spec.get("_target_", ""))
    window = spec.get("window_size") if pretrain else None
    if is_builtin(source):
        n = OmegaConf.select(prepare, "builtin.n", default=None)
        if pretrain or not source.startswith("builtin:arithmetic") or n is None:
            return None
        return int(n), "records"  # one per problem; packing and truncation only merge or drop
    files = _files(Path(source))
    if not pretrain:
        if not all(f.suffix == ".jsonl" for f in files):
            return None
        size = prepare.get("window_size")
        if prepare.get("pack") and isinstance(size, int) and size > 0:
            longest = prepare.get("max_length") or size
            bound = packed_windows_bound(_line_sizes(files), size, int(longest), need)
            return bound, f"packed windows (data.train.prepare.pack, window_size={size})"
        return _lines_at_least(files, need), "records (one per JSONL line)"
    stride = spec.get("stride") or window
    text = all(f.suffix in TEXT_SUFFIXES for f in files)
    if not text or not isinstance(window, int) or not isinstance(stride, int) or stride < 1:
        return None
    # byte-level BPE: a token covers one byte or more, + 2 special tokens per document (a line
    # or a file); lines are counted for a small corpus only (a big one has enough anyway)
    size = sum(f.stat().st_size for f in files)
    docs = (_lines_at_least(files, size) if size < 2**24 else size) + len(files)
    tokens = size + 2 * docs
    return ((tokens - window - 1) // stride + 1 if tokens > window else 0), "windows"


def data_problems(cfg: DictConfig, world: int) -> list[str]:
    """The training split's size (one batch per device of `world`), and every split's JSONL
    syntax."""
    data = cfg.get("data") or {}
    found = [*batching_problems(data), *jsonl_problems(data), *mixture_problems(data)]
    spec = data.get("train")
    if spec is None:
        return found
    # with use_dynamic_bsz a batch holds what the token budget allows: one sample at least
    batch = 1 if data.get("use_dynamic_bsz") is True else int(data.get("batch_size", 1))
    need = batch * world if data.get("drop_last", False) else world
    try:
        bound = sample_bound(spec, need)
    except OSError:
        return found
    if bound is None or bound[0] >= need:
        return found
    have, what = bound
    per = (
        f"data.batch_size={batch} x {world} device(s)" if world > 1 else f"data.batch_size={batch}"
    )
    hint = (
        "; pack fewer records per sample with a smaller data.train.prepare.window_size, or "
        "data.train.prepare.pack=false"
        if what.startswith("packed")
        else ""
    )
    return [
        *found,
        f"data.train: at most {have} training samples ({what}), fewer than one batch ({per}, "
        f"data.drop_last={data.get('drop_last')}): no training step would run; lower "
        f"data.batch_size or give more data{hint}",
    ]


def mixture_problems(data: Any) -> list[str]:
    """Every split's ``sources`` (a mixture, `astrai.data.mixture`), checked as the data
    module checks them, naming ``data.<split>.sources[i]``."""
    if not data or not any(
        data.get(split) is not None and "sources" in data[split] for split in SPLITS
    ):
        return []
    from astrai.data.mixture import check_entries, mixture_options  # torch: mixtures only

    found = []
    for split in SPLITS:
        spec = data.get(split)
        if spec is None or "sources" not in spec:
            continue
        try:
            entries = spec.sources
            if OmegaConf.is_config(entries):
                entries = OmegaConf.to_container(entries, resolve=True)
            check_entries(split, entries, None)
            mixture_options(split, spec)
        except ValueError as err:
            found.append(str(err))
        if data.get("use_dynamic_bsz") is True:
            found.append(
                f"data.use_dynamic_bsz: not with data.{split}.sources (a mixture's batches "
                "are data.batch_size samples); set data.use_dynamic_bsz=false"
            )
    return found


def batching_problems(data: Any) -> list[str]:
    """`data.padding_free`, `data.use_dynamic_bsz` and `data.max_token_len_per_gpu`, checked
    as the data module checks them (`astrai.data.budget.training_batches`)."""
    keys = ("padding_free", "use_dynamic_bsz", "max_token_len_per_gpu")
    if not data or not any(key in data for key in keys[1:]):
        return []
    from astrai.data.budget import training_batches  # torch: only for configs that set them

    try:
        training_batches(**{key: data.get(key) for key in keys if key in data})
    except ValueError as err:
        return [str(err)]
    return []


def jsonl_problems(data: Any) -> list[str]:
    """The first line that is not JSON in each JSONL file a split prepares (its `prepare:`
    block does not set `skip_bad_lines`), while the files hold `JSONL_CHECK_BYTES` or less."""
    files: list[tuple[str, Path]] = []
    for split in SPLITS:
        spec = data.get(split) if data else None
        prepare = spec.get("prepare") if spec is not None else None
        source = spec.get("source") if spec is not None else None
        if prepare is None or not isinstance(source, str) or is_builtin(source):
            continue
        if prepare.get("skip_bad_lines"):
            continue
        path = Path(source)
        if path.exists():
            files += [(split, f) for f in _files(path) if f.suffix == ".jsonl"]
    if sum(f.stat().st_size for _, f in files) > JSONL_CHECK_BYTES:
        return []  # preparation finds it (one line, `python -m astrai.train`)
    found = []
    for split, path in files:
        bad = next(
            (
                r
                for _, r in JsonStorage(path).iter_records(with_errors=True)
                if isinstance(r, DataError)
            ),
            None,
        )
        if bad is not None:
            found.append(
                f"data.{split}.source: {bad}; fix the line, or skip such lines with "
                f"+data.{split}.prepare.skip_bad_lines=true"
            )
    return found
