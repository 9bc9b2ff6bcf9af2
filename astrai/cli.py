"""Shared pieces of the `python -m astrai.*` command lines."""

from __future__ import annotations

import sys

# conf/ holds the training config groups (model, tokenizer, data, ...) next to the
# primary configs of the other commands. Hydra reads `model=<dir>` or `tokenizer=<dir>` on
# the command line as choosing an option of that group, so the commands keep their path
# under another key and accept the documented spelling by renaming it before parsing.


def rename_overrides(renames: dict[str, str], argv: list[str] | None = None) -> None:
    """Rewrite `key=value` to `renames[key]=value` in `sys.argv` (or `argv`), in place."""
    args = sys.argv if argv is None else argv
    out = []
    for arg in args[1:]:
        key, sep, value = arg.partition("=")
        out.append(f"{renames[key]}={value}" if sep and key in renames else arg)
    args[1:] = out


def model_arg_to_model_path(argv: list[str] | None = None) -> None:
    """`model=<dir>` -> `model_path=<dir>` (serve, generate)."""
    rename_overrides({"model": "model_path"}, argv)
