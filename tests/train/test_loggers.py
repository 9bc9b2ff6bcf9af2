"""conf/logger/ (tensorboard, mlflow, many) and astrai.train.mlflow_run: each logger's files
read back by that logger's own reader (TensorBoard's EventAccumulator, MLflow's client on the
file store) hold the run's metrics, equal to the csv logger's. The same short run also checks
the EMA export (`callbacks.ema.export=true`: `<export>/ema` loads like the main export and
holds the checkpoint's average) and `debug=profiler`'s trace."""

from __future__ import annotations

import csv
import json
import os
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from train_helpers import SMALL, TINY_MODEL, cli, run_dirs

from astrai.train.mlflow_run import ALLOW_FILE_STORE, as_tracking_uri, flat_params, mlflow_logger


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """tiny pretrain, 6 steps under debug=profiler, logger=many, an EMA exported."""
    tmp = tmp_path_factory.mktemp("loggers")
    out = tmp / "run"
    cli(
        [
            "debug=profiler",
            "logger=many",
            *TINY_MODEL,
            *SMALL,
            "callbacks.ema.enabled=true",
            "callbacks.ema.decay=0.5",
            "callbacks.ema.export=true",
            "callbacks.progress_bar=null",
            *run_dirs(tmp, data_dir),
            f"paths.output_dir={out}",
        ]
    )
    return out


def _csv_losses(run: Path) -> dict[int, float]:
    (path,) = (run / "csv").glob("*/metrics.csv")
    with path.open() as f:
        return {
            int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]
        }


def test_tensorboard_events_hold_the_runs_metrics(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (folder,) = (run / "tensorboard").iterdir()
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {e.step: e.value for e in events.Scalars("train/loss")}
    expected = _csv_losses(run)
    assert len(expected) == 6 and scalars.keys() == expected.keys()
    for step, value in expected.items():
        assert scalars[step] == pytest.approx(value, rel=1e-6)


def test_mlflow_file_store_holds_the_runs_metrics_and_config(run: Path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(ALLOW_FILE_STORE, "true")
    client = MlflowClient(tracking_uri=as_tracking_uri(run / "mlruns"))
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny_pretrain"]
    (found,) = client.search_runs([experiment.experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    expected = _csv_losses(run)
    assert history.keys() == expected.keys()
    for step, value in expected.items():
        assert history[step] == pytest.approx(value, rel=1e-6)
    params = found.data.params
    assert params["trainer/max_steps"] == "6" and params["callbacks/ema/decay"] == "0.5"
    assert params["model/_target_"] == "astrai.model.preset_model"  # the config's, kept


def test_the_ema_export_loads_and_holds_the_checkpoints_average(run: Path) -> None:
    from astrai.model import load_pretrained

    main, ema = load_pretrained(run / "export"), load_pretrained(run / "export" / "ema")
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    average = state["callbacks"]["EMA"]["average"]
    assert state["callbacks"]["EMA"]["n_averaged"] == 6
    trained = ema.state_dict()
    for name, value in average.items():
        assert name.startswith("model.")
        assert torch.equal(trained[name.removeprefix("model.")], value), name
    assert torch.equal(
        main.state_dict()["embed_tokens.weight"], state["state_dict"]["model.embed_tokens.weight"]
    )
    assert not torch.equal(main.state_dict()["embed_tokens.weight"], trained["embed_tokens.weight"])


def test_debug_profiler_writes_a_trace_of_training_steps(run: Path) -> None:
    traces = list((run / "profiler").glob("*training_step*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3  # the schedule's active steps
    assert (run / "profiler" / "fit-trace.txt").read_text().strip()


def test_tracking_uri_and_flat_params(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert as_tracking_uri("mlruns") == (tmp_path / "mlruns").as_uri()
    assert as_tracking_uri("http://host:5000") == "http://host:5000"
    assert as_tracking_uri("sqlite:///x.db") == "sqlite:///x.db"
    nested = {"a": {"b": 1, "c": Namespace(d=2)}, "e": "x"}
    assert flat_params(nested) == {"a/b": 1, "a/c/d": 2, "e": "x"}


def test_parameters_are_written_once_the_first_value_kept(tmp_path: Path, monkeypatch) -> None:
    """MLflow refuses a changed parameter and a value where a group of parameters is: a run
    logs its config, then Lightning the module's hyperparameters under the same keys."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv(ALLOW_FILE_STORE, raising=False)
    logger = mlflow_logger(tmp_path / "mlruns", experiment_name="x", run_name="r")
    assert os.environ[ALLOW_FILE_STORE] == "true"  # MLflow 3 refuses the file store otherwise
    logger.log_hyperparams({"model": {"_target_": "a.f", "size": 2}, "tokenizer": {"path": "t"}})
    logger.log_hyperparams({"model": {"_target_": "a.b.f"}, "tokenizer": "t", "lr": 0.1})
    logger.log_metrics({"m": 1.0}, step=0)
    logger.finalize("success")
    params = MlflowClient(as_tracking_uri(tmp_path / "mlruns")).get_run(logger.run_id).data.params
    assert params == {
        "model/_target_": "a.f",
        "model/size": "2",
        "tokenizer/path": "t",
        "lr": "0.1",
    }
