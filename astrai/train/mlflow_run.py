"""MLflow for a training run without a server: Lightning's `MLFlowLogger` on a local file
store under the run folder (conf/logger/mlflow.yaml).

MLflow 3 keeps its file store in maintenance mode and refuses it unless the environment
sets `MLFLOW_ALLOW_FILE_STORE=true`. A run that names a folder (or a `file:` URI) as its
store has chosen it, so `mlflow_logger` sets that opt-out for this process, unless the
environment already decides it; a server (`http://...`) or a database URI
(`sqlite:///run.db`) is passed through untouched.

MLflow also refuses a parameter logged again with another value. A run logs its whole config
first (astrai.train.runner), then Lightning logs the module's hyperparameters under some of
the same keys (`model/_target_` names the factory by another path): `RunMLFlowLogger` writes
each key once, the config's value.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["ALLOW_FILE_STORE", "RunMLFlowLogger", "as_tracking_uri", "flat_params", "mlflow_logger"]

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
    uri = as_tracking_uri(tracking_uri)
    if uri.startswith("file:"):
        os.environ.setdefault(ALLOW_FILE_STORE, "true")
    return RunMLFlowLogger(tracking_uri=uri, **kwargs)


def flat_params(params: Mapping[str, Any] | Namespace, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level, keys joined with "/" (Lightning's layout for params)."""
    items = vars(params) if isinstance(params, Namespace) else params
    out: dict[str, Any] = {}
    for key, value in items.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping | Namespace):
            out.update(flat_params(value, f"{name}/"))
        else:
            out[name] = value
    return out


class RunMLFlowLogger(MLFlowLogger):
    """Lightning's `MLFlowLogger` writing each parameter key once (the first value wins):
    MLflow refuses a parameter whose value changes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged_params: set[str] = set()
        self.param_groups: set[str] = set()

    @rank_zero_only
    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        new = {k: v for k, v in flat_params(params).items() if not self._taken(k)}
        if new:
            super().log_hyperparams(new)
            self.logged_params.update(new)
            self.param_groups.update(p for k in new for p in _ancestors(k))

    def _taken(self, key: str) -> bool:
        """`key`, a group of logged keys, or under a logged key (the file store keeps a
        parameter `a/b` as a file under the folder `a`: `a` cannot be a value then)."""
        return (
            key in self.logged_params
            or key in self.param_groups
            or any(p in self.logged_params for p in _ancestors(key))
        )


def _ancestors(key: str) -> list[str]:
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]
