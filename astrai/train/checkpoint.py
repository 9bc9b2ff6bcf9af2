"""Which checkpoints are whole: `ckpt_path=last` never resumes from a broken one.

`AtomicCheckpointIO` (astrai/train/checkpoint_io.py) makes every file our runs write whole;
a file copied by hand, cut short by a full disk elsewhere or damaged on disk may still be
broken, so `astrai.train.runner.resolve_ckpt_path` verifies what it resumes from with
`checkpoint_problem` and takes the newest whole checkpoint of the run, naming each broken
one. A single-file checkpoint (a `torch.save` zip) is read once, streaming, and the CRC-32
of every member checked against its zip directory (about 1 GB/s from the page cache, disk
speed otherwise; logged); a sharded one (a `torch.distributed.checkpoint` folder) has no
checksums: its `.metadata` must load, every shard file it lists must be there and long
enough, and Lightning's `meta.pt` passes the CRC check. A result is kept for the process
(keyed by the size, mtime and inode of each file), so the preflight check and the run verify
once.

No Lightning import here (torch only for sharded folders), so that importing the runner
(config composition, `--cfg job`) stays light.
"""

from __future__ import annotations

import logging
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "LIGHTNING_META",
    "checkpoint_problem",
    "is_complete",
    "newest_complete",
    "remove_stale_temps",
    "temp_name",
]

#: what Lightning's sharded checkpoint keeps besides the tensors (loops, schedules, data)
LIGHTNING_META = "meta.pt"
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")
_VERIFIED: dict[tuple[str, tuple[tuple[Any, ...], ...]], str | None] = {}


def temp_name(path: Path) -> Path:
    """Where this process writes `path` before renaming it into place: `.<name>.tmp<pid>`."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files (`temp_name`) of writes killed in `folder`: those whose
    process is no longer running. Returns them; each is named in a warning."""
    removed = []
    if not folder.is_dir():
        return removed
    for path in sorted(folder.iterdir()):
        match = _TEMP.match(path.name)
        if match is None or not path.is_file() or _running(int(match["pid"])):
            continue
        size = path.stat().st_size
        path.unlink(missing_ok=True)
        removed.append(path)
        log.warning("removed %s (%.1f MB), left by a write that was killed", path, size / 1e6)
    return removed


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if not any(m.filename.endswith("data.pkl") for m in members):
                return "not a torch checkpoint (a zip archive without data.pkl)"
            started = time.perf_counter()
            bad = archive.testzip()  # reads every member, checking its CRC-32
    except zipfile.BadZipFile as err:
        if "directory" in str(err) or "File is not a zip file" in str(err):
            return "cut short (no zip directory: stopped while it was written?)"
        return f"damaged ({err})"
    except (OSError, EOFError) as err:
        return f"unreadable ({err})"
    if bad is not None:
        return f"damaged: member {bad} fails its check (CRC-32 or header)"
    log.info(
        "checkpoint %s verified (CRC-32 of %d members, %.2f GB) in %.1f s",
        path,
        len(members),
        sum(m.file_size for m in members) / 1e9,
        time.perf_counter() - started,
    )
    return None


def _sharded_problem(path: Path) -> str | None:
    if not (path / ".metadata").is_file():
        return "cut short (a sharded checkpoint folder without .metadata)"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a pickle: anything may come out of a damaged one
        return f"damaged: its .metadata cannot be read ({type(err).__name__}: {err})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if not file.is_file():
            return f"incomplete: shard file {name} is missing"
        if file.stat().st_size < end:
            return f"cut short: shard file {name} holds {file.stat().st_size} of {end} bytes"
    if (path / LIGHTNING_META).is_file():
        problem = _zip_problem(path / LIGHTNING_META)
        if problem is not None:
            return f"{LIGHTNING_META}: {problem}"
    return None


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` is not a whole checkpoint (None: it is). See the module docstring for what
    is verified; the answer is computed once per version of the file."""
    try:
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        stats = tuple((f.name, *_stat_key(f)) for f in files)
    except OSError:
        return "missing"
    key = (os.path.realpath(path), stats)
    if key not in _VERIFIED:
        _VERIFIED[key] = _sharded_problem(path) if path.is_dir() else _zip_problem(path)
    return _VERIFIED[key]


def is_complete(path: Path) -> bool:
    """Whether `path` is a whole checkpoint (`checkpoint_problem` finds nothing)."""
    return checkpoint_problem(path) is None


def newest_complete(candidates: list[Path]) -> Path | None:
    """The newest whole checkpoint among `candidates` (by modification time); each broken
    one is named in a warning with what is wrong."""
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is %s; skipped", path, problem)
    return None
