"""MLflow for a training run without a server: Lightning's `MLFlowLogger` on a local file
store under the run folder (conf/logger/mlflow.yaml).

MLflow 3 keeps its file store in maintenance mode and refuses it unless the environment
sets `MLFLOW_ALLOW_FILE_STORE=true`. A run that names a folder (or a `file:` URI) as its
store has chosen it, so `mlflow_logger` sets that opt-out for this process, unless the
environment already decides it; a server (`http://...`) or a database URI
(`sqlite:///run.db`) is passed through untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["ALLOW_FILE_STORE", "as_tracking_uri", "mlflow_logger"]

#: MLflow 3's opt-out of its refusal of the file store
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"


def as_tracking_uri(where: str | os.PathLike) -> str:
    """`where` as MLflow's tracking URI: a plain folder becomes an absolute `file:` URI (the
    store is then found wherever the process runs); a URI with a scheme is kept."""
    text = str(where)
    if "://" in text or text.startswith("file:"):
        return text
    return Path(text).expanduser().resolve().as_uri()


def mlflow_logger(tracking_uri: str | os.PathLike, **kwargs: Any) -> Any:
    """Lightning's `MLFlowLogger` (`kwargs` are its own: experiment_name, run_name, tags,
    prefix, artifact_location, log_model, run_id) writing to `tracking_uri`: a folder is a
    file store, allowed for this process (`ALLOW_FILE_STORE`) unless the environment says
    otherwise."""
    from lightning.pytorch.loggers import MLFlowLogger

    uri = as_tracking_uri(tracking_uri)
    if uri.startswith("file:"):
        os.environ.setdefault(ALLOW_FILE_STORE, "true")
    return MLFlowLogger(tracking_uri=uri, **kwargs)
