"""Files other users can read, and writes a full disk cannot leave half-done.

Every writer in astrai writes under a temporary name and renames the file into place, so a
kill or a full disk keeps the previous file whole. Two things that pattern gets wrong by
default are fixed here, in one place:

- mode: `tempfile.mkstemp` and safetensors create files as 0600, so an export renamed into
  place would be unreadable by other users and by containers running as another user.
  `publish` gives the file the mode a plain `open()` would (0666 less the process umask)
  before the rename.
- a full disk: torch's zip writer reports it as "unexpected pos" (the `OSError` is only its
  context) and safetensors with its own error type, neither naming the file. `DiskFullError`
  is one line that names the file and says `No space left on device`; `is_disk_full`
  recognises the cases.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DiskFullError", "is_disk_full", "naming_full_disk", "publish", "umask_mode"]


def _umask() -> int:
    # Linux shows it without changing it; elsewhere set and restore it (a moment in which
    # another thread's new file would get mode 0666 & ~0o022)
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode() -> int:
    """The mode `open()` gives a new file in this process now: 0666 less the umask."""
    return 0o666 & ~_umask()


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename the finished temporary file `tmp` over `final`, with `umask_mode()`."""
    os.chmod(tmp, umask_mode())
    os.replace(tmp, final)


class DiskFullError(OSError):
    """A write ran out of space. The message names the file and what is still whole."""

    def __init__(self, path: str | os.PathLike, kept: str = "") -> None:
        self.message = f"{path}: No space left on device" + (f" ({kept})" if kept else "")
        super().__init__(errno.ENOSPC, self.message, str(path))

    def __str__(self) -> str:
        return self.message


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or its cause) is a full disk: an `OSError` with `ENOSPC`, or a Rust
    I/O error as safetensors reports it ("No space left on device (os error 28)")."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        if f"(os error {errno.ENOSPC})" in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@contextlib.contextmanager
def naming_full_disk(path: str | os.PathLike, kept: str = "") -> Iterator[None]:
    """Turn a full disk inside the block into a `DiskFullError` naming `path`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if is_disk_full(err):
            raise DiskFullError(path, kept) from err
        raise
