"""Shared pieces of the `python -m astrai.*` command lines."""

from __future__ import annotations

import sys


def model_arg_to_model_path(argv: list[str] | None = None) -> None:
    """Rewrite `model=<dir>` to `model_path=<dir>` in `sys.argv`, in place.

    `model=<dir>` is the documented spelling for serving and generation, but `model` is
    also a config group of the training configs in conf/, which Hydra would try to select.
    """
    args = sys.argv if argv is None else argv
    args[1:] = ["model_path=" + a[6:] if a.startswith("model=") else a for a in args[1:]]
