"""Is a folder a model directory? Answered from file names alone, without torch.

`serve`, `generate` and `eval` take the same `model_path` and check it here first, so a
wrong path is one line naming what is missing, in a second, instead of a traceback after
torch and the model code have been imported. `astrai.model.hub` reads the same names.
A reward model's export (`strategy=reward`: a `*ForSequenceClassification` config.json)
given where a generative model is expected is named as such, with the flag that serves it;
so is a value model's (PPO's critic: `*ForTokenClassification`).
Keep this module free of heavy imports: the commands import it before anything else.
"""

from __future__ import annotations

import json
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


def _architecture_with(path: str | os.PathLike, suffix: str) -> str | None:
    """The architecture ending in `suffix` that `path`'s config.json declares, else None
    (also when the file is missing or unreadable: the loader names those problems)."""
    try:
        data = json.loads((Path(path).expanduser() / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    architectures = data.get("architectures") if isinstance(data, dict) else None
    for name in architectures if isinstance(architectures, list) else ():
        if isinstance(name, str) and name.endswith(suffix):
            return name
    return None


def reward_architecture(path: str | os.PathLike) -> str | None:
    """The `*ForSequenceClassification` architecture `path`'s config.json declares (a reward
    model's export), else None."""
    return _architecture_with(path, "ForSequenceClassification")


def value_architecture(path: str | os.PathLike) -> str | None:
    """The `*ForTokenClassification` architecture `path`'s config.json declares (a value
    model's export: PPO's critic, `astrai.model.value`), else None."""
    return _architecture_with(path, "ForTokenClassification")


def check_model_dir(
    path: str | os.PathLike, key: str = "model_path", *, generative: bool = True
) -> Path:
    """`path` (user expanded) if it looks like a model directory; otherwise a one-line
    `SystemExit` naming `key`, the path and what is missing. With `generative` (a model to
    generate with), a reward model's directory is refused too, naming `reward_model=`, and
    a value model's (PPO's critic)."""
    problem = model_dir_problem(path)
    if problem is None and generative:
        architecture = reward_architecture(path)
        if architecture is not None:
            problem = (
                f"a reward model ({architecture}, a strategy=reward export): it scores "
                f"text, it does not generate; serve it with python -m astrai.serve "
                f"reward_model={path} next to a generative model_path=<dir>"
            )
        architecture = value_architecture(path) if problem is None else None
        if architecture is not None:
            problem = (
                f"a value model ({architecture}, PPO's critic, as in a strategy=ppo "
                "export's critic/ folder): it scores tokens, it does not generate; pass the "
                "policy's export as model_path=<dir>"
            )
    if problem is not None:
        raise SystemExit(f"{key}={path}: {problem}")
    return Path(path).expanduser()
