"""Where a client may load LoRA adapters from, and which adapter names are acceptable.

Torch-free, so that `python -m astrai.serve` checks `allowed_lora_roots` and the
`lora_modules` names before anything heavy is imported.

A client's `lora_path` (`POST /v1/load_lora_adapter`, only mounted with
`allow_runtime_lora=true`) is resolved against the operator's `allowed_lora_roots` in two
steps, so that a refusal says nothing about the file system outside them:

1. lexically: the path (a relative one is taken inside the first root) is normalised
   (`..` collapsed) without touching the disk, and must lie inside a root as given or as
   its real path; anything else is refused with one fixed message, whether or not it
   exists;
2. physically: only then is its real path taken (following symlinks inside the root), and
   a real path outside every root's real path (a symlink escaping the root) is refused
   with the same message.

The adapter is then loaded from that real path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

#: the longest adapter name accepted (vLLM has no limit; names end up in logs and URLs)
MAX_LORA_NAME = 128


class LoRAPathNotAllowed(ValueError):
    """A `lora_path` outside `allowed_lora_roots` (the message never names the disk)."""


def check_lora_name(name: object, key: str = "lora_name") -> str:
    """`name` if it can name an adapter: a non-empty string of at most `MAX_LORA_NAME`
    printable characters without path separators, other than the training run's live
    adapter (`policy`). A ValueError naming `key` otherwise."""
    from astrai.inference.adapters import LIVE_ADAPTER  # imports torch: only when asked

    if not isinstance(name, str) or not name:
        raise ValueError(f"{key}: must be a non-empty string, got {name!r}")
    if len(name) > MAX_LORA_NAME:
        raise ValueError(f"{key}: at most {MAX_LORA_NAME} characters, got {len(name)}")
    if any(sep in name for sep in ("/", "\\")):
        raise ValueError(f"{key}: a name, not a path (no '/' or '\\'), got {name!r}")
    if not name.isprintable():
        raise ValueError(f"{key}: control or other unprintable characters in {name!r}")
    if name == LIVE_ADAPTER:
        raise ValueError(
            f"{key}: {LIVE_ADAPTER!r} is the name of a training run's live adapter; pick another"
        )
    return name


def _inside(path: str, root: str) -> bool:
    """Lexically: `path` is `root` or below it (both absolute and normalised)."""
    return os.path.commonpath([path, root]) == root


@dataclass(frozen=True)
class AdapterRoots:
    """The directories clients may load adapters from (`allowed_lora_roots`): each as the
    operator gave it (absolute, normalised) and as its real path."""

    given: tuple[str, ...]
    real: tuple[str, ...]

    @classmethod
    def of(cls, roots: Sequence[str], key: str = "allowed_lora_roots") -> AdapterRoots:
        """Check the operator's roots: at least one, each an existing directory; a ValueError
        naming `key` otherwise."""
        if isinstance(roots, str):
            roots = [roots]
        if not roots:
            raise ValueError(
                f"{key}: allow_runtime_lora=true needs the directories clients may load "
                f"adapters from, e.g. {key}=[/srv/adapters]"
            )
        given, real = [], []
        for root in roots:
            if not isinstance(root, str) or not root:
                raise ValueError(f"{key}: expected directory paths, got {root!r}")
            path = os.path.abspath(os.path.expanduser(root))
            if not os.path.isdir(path):
                raise ValueError(f"{key}: {root} is not a directory")
            given.append(path)
            real.append(os.path.realpath(path))
        return cls(tuple(given), tuple(real))

    def resolve(self, lora_path: str) -> str:
        """The real directory to load `lora_path` from; `LoRAPathNotAllowed` (one message
        for every refusal) when it is not inside a root. See the module docstring."""
        refused = LoRAPathNotAllowed(
            f"lora_path: {lora_path!r} is not inside the directories this server loads "
            "adapters from (allowed_lora_roots)"
        )
        if "\0" in lora_path:
            raise refused
        candidate = os.path.normpath(os.path.join(self.given[0], lora_path))
        if not any(_inside(candidate, root) for root in (*self.given, *self.real)):
            raise refused  # nothing outside was looked at
        real = os.path.realpath(candidate)
        if not any(_inside(real, root) for root in self.real):
            raise refused  # a symlink inside a root that leads out of it
        return real
