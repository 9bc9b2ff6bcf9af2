"""Weights & Biases for a training run: which mode it runs in, the Lightning logger, and
the W&B run a resumed checkpoint continues.

The mode is decided once, here, and checked before training (`mode_problem`, run by the
preflight): `logger.wandb.mode`, else `WANDB_MODE`, else online when an API key is found
(`WANDB_API_KEY` or the `~/.netrc` entry `wandb login` writes) and offline otherwise. The
values wandb itself writes to `WANDB_MODE` are read as their meaning (`dryrun` is offline,
`run` is online): wandb sets `WANDB_MODE=dryrun` in the process after an offline run, which
the next job of a `-m` grid then sees. Each job finishes its own W&B run (`finish`), so the
jobs of a grid write one offline run each instead of logging into the first.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MODES",
    "STATE_FILE",
    "finish",
    "has_api_key",
    "mode_problem",
    "read_state",
    "resolve_mode",
    "wandb_logger",
]

MODES = ("online", "offline", "disabled")
#: spellings wandb accepts (and writes into WANDB_MODE) for the modes above
ALIASES = {"dryrun": "offline", "run": "online"}
#: the run id and step, next to the checkpoints (`callbacks.WandbRunState` writes it)
STATE_FILE = "wandb_run.json"


def has_api_key() -> bool:
    """An API key is configured: `WANDB_API_KEY`, or a netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    with contextlib.suppress(Exception):
        import netrc

        rc = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc"))
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1]
        return rc.authenticators(host.split("/")[0]) is not None
    return False


def resolve_mode(mode: str | None = None) -> str:
    """online | offline | disabled from `mode` (the config's), `WANDB_MODE` or the key; a
    value that is none of them (nor wandb's `dryrun`/`run`) is a `ValueError` naming it."""
    where = "logger.wandb.mode" if mode else "WANDB_MODE"
    value = mode or os.environ.get("WANDB_MODE") or ("online" if has_api_key() else "offline")
    value = ALIASES.get(str(value).lower(), str(value).lower())
    if value not in MODES:
        raise ValueError(
            f"{where}: {mode or os.environ.get('WANDB_MODE')!r} is not online, offline or "
            "disabled (or wandb's dryrun = offline, run = online)"
        )
    return value


def mode_problem(mode: str | None = None) -> str | None:
    """Why W&B cannot run in the mode it resolves to, with the fix; None when it can."""
    try:
        value = resolve_mode(mode)
    except ValueError as err:
        return str(err)
    if value == "online" and not has_api_key():
        source = "logger.wandb.mode=online" if mode else "WANDB_MODE=online"
        return (
            f"{source}: no W&B API key (WANDB_API_KEY, or the ~/.netrc entry `wandb login` "
            "writes); run `wandb login` or set WANDB_API_KEY, or record offline with "
            "logger.wandb.mode=offline and upload later with `wandb sync`"
        )
    return None


def wandb_logger(
    *, mode: str | None = None, resume_state: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """A Lightning `WandbLogger` in the resolved mode, continuing the W&B run recorded in the
    checkpoint being resumed (`resume_state`: id and step).

    Online, the run is rewound to the checkpoint's step (`resume_from`), so steps logged
    after the checkpoint and before the interruption are not duplicated.
    """
    from astrai.train.wandb_logger import WandbLogger  # (no `anonymous` warning)

    mode = resolve_mode(mode)
    if resume_state and resume_state.get("id"):
        if mode == "online" and resume_state.get("step") is not None:
            kwargs["resume_from"] = f"{resume_state['id']}?_step={int(resume_state['step'])}"
            kwargs["resume"] = None  # mutually exclusive with resume_from
        else:
            kwargs.update(id=resume_state["id"], resume="allow")
    else:  # chosen here (not by wandb) so that it is known before the run starts
        kwargs.setdefault("id", secrets.token_hex(4))
    return WandbLogger(offline=mode == "offline", mode=mode, **kwargs)


def read_state(ckpt: Path | None) -> dict[str, Any] | None:
    """The W&B run (id, step) stored with a checkpoint by `WandbRunState`."""
    if ckpt is None:
        return None
    side = ckpt.parent / STATE_FILE
    with contextlib.suppress(Exception):
        import torch

        state = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=False)
        for key, value in (state.get("callbacks") or {}).items():
            if str(key).startswith("WandbRunState") and value.get("id"):
                return dict(value)
    if side.is_file():
        return json.loads(side.read_text())
    return None


def finish(loggers: list[Any], *, failed: bool = False) -> None:
    """End the W&B run of this job (exit code 1 when it failed), so that the next job of a
    sweep (same process) starts its own instead of Lightning reusing the one in progress."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(lg, WandbLogger) for lg in loggers):
        import wandb

        wandb.finish(exit_code=1 if failed else 0)
