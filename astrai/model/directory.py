"""Is a folder a model directory? Answered from file names alone, without torch.

`serve`, `generate` and `eval` take the same `model_path` and check it here first, so a
wrong path is one line naming what is missing, in a second, instead of a traceback after
torch and the model code have been imported. `astrai.model.hub` reads the same names.
Keep this module free of heavy imports: the commands import it before anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"

EXPECTED = (
    f"expected a save_pretrained or Hugging Face directory: {CONFIG_NAME} + {WEIGHTS_NAME} "
    f"(or {INDEX_NAME} and its shards) + {TOKENIZER_NAME}"
)


def model_dir_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be loaded as a model directory (None: the files are there).

    Only names are looked at; a file that is there but broken is the loader's error.
    """
    path = Path(path).expanduser()
    if not path.exists():
        return "model directory not found (run `make train` first, or pass model_path=<dir>)"
    if not path.is_dir():
        return f"not a directory ({EXPECTED})"
    missing = [CONFIG_NAME] if not (path / CONFIG_NAME).is_file() else []
    if not (path / WEIGHTS_NAME).is_file() and not (path / INDEX_NAME).is_file():
        pickled = any(path.glob("*.bin")) or any(path.glob("*.pt"))
        missing.append(
            f"{WEIGHTS_NAME} (only pickle *.bin / *.pt weights, which astrai never loads: "
            "convert them to safetensors)"
            if pickled
            else WEIGHTS_NAME
        )
    if not (path / TOKENIZER_NAME).is_file():
        missing.append(TOKENIZER_NAME)
    if not missing:
        return None
    return f"not a model directory: no {', no '.join(missing)} ({EXPECTED})"


def check_model_dir(path: str | os.PathLike, key: str = "model_path") -> Path:
    """`path` (user expanded) if it looks like a model directory; otherwise a one-line
    `SystemExit` naming `key`, the path and what is missing."""
    problem = model_dir_problem(path)
    if problem is not None:
        raise SystemExit(f"{key}={path}: {problem}")
    return Path(path).expanduser()
