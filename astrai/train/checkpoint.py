"""Which checkpoint files are whole: `ckpt_path=last` never resumes from a broken one.

`AtomicCheckpointIO` (astrai/train/checkpoint_io.py) makes every file our runs write whole;
a file copied by hand or written by another tool may still be cut short, so
`astrai.train.runner.resolve_ckpt_path` checks what it resumes from with `is_complete` and
falls back to the newest complete checkpoint, saying so. No Lightning import here, so that
importing the runner (config composition, `--cfg job`) stays light.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["is_complete", "newest_complete"]


def is_complete(path: Path) -> bool:
    """Whether `path` is a whole checkpoint: a `torch.save` zip archive, whose central
    directory is written last (a cut-short file has none), or a sharded checkpoint folder
    with its `.metadata`, which `torch.distributed.checkpoint` writes last."""
    if path.is_dir():
        return (path / ".metadata").is_file()
    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def newest_complete(candidates: list[Path]) -> Path | None:
    """The newest complete checkpoint among `candidates` (by modification time); each
    incomplete one is named in a warning."""
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        if is_complete(path):
            return path
        log.warning("checkpoint %s is incomplete (cut short while written?); skipped", path)
    return None
