"""``python -m astrai.serve embedding_model=<dir>``: the separate embedding export that
``POST /v1/embeddings`` answers with under its own name (`embedding_model_name`).

Checked at start-up from file names alone (no torch), before anything loads: a missing
directory, config or weights is a SystemExit naming `embedding_model` and the path. The
directory's own tokenizer is used when it has one (``tokenizer.json``), else the served
model's. The model loads on the served model's device and dtype, with no KV cache or engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.model.directory import (
    CONFIG_NAME,
    INDEX_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    check_model_dir,
)

if TYPE_CHECKING:
    from astrai.inference.embedding import Embedder

KEY = "embedding_model"


def check_embedding_dir(path: str) -> Path:
    """`path` (user expanded) if it can be an embedding export; else a SystemExit naming
    `embedding_model`, the path and what is missing (a tokenizer is optional)."""
    root = Path(path).expanduser()
    if (root / TOKENIZER_NAME).is_file():
        return check_model_dir(root, key=KEY, generative=False)
    if not root.is_dir():
        raise SystemExit(f"{KEY}={path}: not a directory (an embedding model export)")
    missing = [] if (root / CONFIG_NAME).is_file() else [CONFIG_NAME]
    if not (root / WEIGHTS_NAME).is_file() and not (root / INDEX_NAME).is_file():
        missing.append(WEIGHTS_NAME)
    if missing:
        raise SystemExit(
            f"{KEY}={path}: not a model directory: no {', no '.join(missing)} (expected a "
            f"save_pretrained or Hugging Face directory: {CONFIG_NAME} + {WEIGHTS_NAME}, and "
            f"{TOKENIZER_NAME} unless the served model's tokenizer fits)"
        )
    return root


def build_embedding(
    cfg: dict[str, Any], name: str | None, pooling_type: str, device: str, dtype: Any
) -> Embedder | None:
    """The separate embedding export of `cfg` (None without `embedding_model`), pooled by
    `pooling_type`, listed as `name`; a directory the loader refuses is a SystemExit naming
    the key."""
    if not cfg.get(KEY):
        return None
    from astrai.inference.embedding import Embedder
    from astrai.model import CheckpointError
    from astrai.tokenizer import AutoTokenizer

    root = check_embedding_dir(str(cfg[KEY]))
    served_tokenizer = None
    if not (root / TOKENIZER_NAME).is_file():
        served_tokenizer = AutoTokenizer.from_pretrained(Path(str(cfg["model_path"])).expanduser())
    try:
        return Embedder.from_pretrained(
            root,
            pooling_type,
            tokenizer=served_tokenizer,
            name=name,
            device=device,
            dtype=dtype,
        )
    except (CheckpointError, ValueError, OSError) as err:
        raise SystemExit(f"{KEY}={cfg[KEY]}: {err}") from None
