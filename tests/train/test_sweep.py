"""The learning-rate grid (conf/hparams_search/lr_grid.yaml) and the sweep plot
(`python -m astrai.train.plot sweep`), on fabricated multirun folders and one real `-m` run."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from train_helpers import SMALL, TINY_MODEL, cli

from astrai.train import plot
from astrai.train.runner import compose

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _job(
    root: Path, name: str, overrides: list[str], rows: list[dict[str, object]], lr: float = 3e-3
) -> Path:
    """A job folder as Hydra and Lightning's CSVLogger leave it (`lr`: its config's)."""
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    config = {"name": "tiny_sft", "optim": {"lr": lr, "weight_decay": 0.1}}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    logs = job / "csv" / "a1b2c3"
    logs.mkdir(parents=True)
    fields = sorted({k for r in rows for k in r} | {"step", "epoch"})
    with open(logs / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({"epoch": 0, **r})
    return job


@pytest.fixture
def multirun(tmp_path: Path) -> Path:
    """Four jobs: exact match logged by three (job 1's last value is not its best), never by
    job 2; job 10 sorts after 2 (numeric order) and has its lr in its config only."""
    root = tmp_path / "multirun" / "2025-01-01_00-00-00_abcdef"
    _job(
        root,
        "0",
        ["experiment=tiny_sft", "optim.lr=1e-3"],
        [
            {"step": 100, "eval/arithmetic/exact_match": 0.25, "val/loss": 2.0},
            {"step": 400, "eval/arithmetic/exact_match": 0.5, "val/loss": 1.5},
        ],
    )
    _job(
        root,
        "1",
        ["experiment=tiny_sft", "optim.lr=3e-3"],
        [
            {"step": 100, "eval/arithmetic/exact_match": 0.75},
            {"step": 200, "train/loss": 1.0},
            {"step": 400, "eval/arithmetic/exact_match": 0.625},
        ],
    )
    _job(root, "2", ["experiment=tiny_sft", "++optim.lr=1e-2"], [{"step": 5, "train/loss": 9.0}])
    # no lr in the overrides: read from the job's config
    _job(root, "10", ["seed=1"], [{"step": 400, "eval/arithmetic/exact_match": 0.0}], lr=0.03)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_sweep_plot_writes_png_and_table(multirun: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "lr_sweep.png"
    plot.main(
        [
            "sweep",
            str(multirun),
            "--param",
            "optim.lr",
            "--metric",
            "eval/arithmetic/exact_match",
            "--out",
            str(out),
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert printed["plot"] == str(out)
    with open(out.with_suffix(".csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]
    assert [float(r["optim.lr"]) for r in rows] == [1e-3, 3e-3, 1e-2, 0.03]
    assert [r["eval/arithmetic/exact_match"] for r in rows] == [
        "0.5",
        "0.625",
        "",
        "0.0",
    ]  # last values
    md = out.with_suffix(".md").read_text().splitlines()
    assert md[0] == "| job | optim.lr | eval/arithmetic/exact_match |"
    assert md[2:] == [
        "| 0 | 1e-3 | 0.5 |",
        "| 1 | 3e-3 | **0.625** |",
        "| 2 | 1e-2 | missing |",
        "| 10 | 0.03 | 0 |",
    ]


def test_sweep_plot_best_value_and_lower_is_better(multirun: Path, tmp_path: Path) -> None:
    out = tmp_path / "best.png"
    args = ["sweep", str(multirun), "--param", "optim.lr", "--out", str(out)]
    plot.main([*args, "--metric", "eval/arithmetic/exact_match", "--reduce", "max"])
    with open(out.with_suffix(".csv")) as fh:
        assert [r["eval/arithmetic/exact_match"] for r in csv.DictReader(fh)] == [
            "0.5",
            "0.75",
            "",
            "0.0",
        ]
    plot.main([*args, "--metric", "val/loss", "--reduce", "min"])
    md = out.with_suffix(".md").read_text()
    assert "| 0 | 1e-3 | **1.5** |" in md and md.count("missing") == 3


def test_sweep_plot_errors_name_the_problem(multirun: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="job folders"):
        plot.main(["sweep", str(tmp_path / "empty"), "--param", "optim.lr", "--metric", "x"])
    with pytest.raises(ValueError, match=r"sets optim\.nope"):
        plot.main(["sweep", str(multirun), "--param", "optim.nope", "--metric", "val/loss"])


def test_single_run_plot_still_works(multirun: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "curves.png"
    plot.main([str(multirun / "0"), "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert json.loads(capsys.readouterr().out)["final"]["eval/arithmetic/exact_match"] == 0.5


def test_single_run_plot_adds_named_metric_panels(multirun: Path, tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    out = tmp_path / "extra.png"
    fig_sizes: list[tuple[float, float]] = []
    real = plt.subplots

    def spy(*args, **kwargs):
        fig, axes = real(*args, **kwargs)
        fig_sizes.append(axes.shape)
        return fig, axes

    plt.subplots = spy
    try:
        plot.main([str(multirun / "0"), "--out", str(out), "--metrics", "val/loss"])
    finally:
        plt.subplots = real
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert fig_sizes == [(1, 3)]  # loss, eval scores, val/loss on its own
    with pytest.raises(KeyError, match="train/kl"):
        plot.main([str(multirun / "0"), "--out", str(out), "--metrics", "train/kl"])


def test_lr_grid_is_a_log_grid_for_the_basic_sweeper() -> None:
    cfg = compose(["experiment=tiny_sft", "hparams_search=lr_grid", "paths.output_dir=unused"])
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert cfg.hydra.sweeper._target_.endswith("BasicSweeper")
    lrs = [float(v) for v in cfg.hydra.sweeper.params["optim.lr"].split(",")]
    assert len(lrs) == 5 and lrs == sorted(lrs)
    ratios = {round(b / a, 6) for a, b in itertools.pairwise(lrs)}
    assert all(3 <= r <= 3.34 for r in ratios), ratios  # half-decade steps
    assert lrs[0] < cfg.optim.lr < lrs[-1]  # brackets the experiment's own rate
    # the sweep folders are unique per launch and per job (test_train_cli runs two at once)
    sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
    assert "${astrai.uid:}" in sweep["dir"] and sweep["subdir"] == "${hydra.job.num}"


@pytest.mark.slow
def test_lr_grid_runs_one_folder_per_job(tmp_path: Path, data_dir: Path) -> None:
    """`-m experiment=tiny_sft hparams_search=lr_grid debug=fast` with a 2-value lr on the
    command line: two jobs, two folders, each with its lr, and the sweep plot reads them."""
    cli(
        [
            "-m",
            "experiment=tiny_sft",
            "hparams_search=lr_grid",
            "debug=fast",
            "optim.lr=1e-3,1e-2",
            *TINY_MODEL,
            *SMALL[:1],
            "data.train.prepare.builtin.n=200",
            "data.val.prepare.builtin.n=32",
            "callbacks.eval.suites.arithmetic.num_prompts=4",
            "callbacks.eval.suites.arithmetic.max_tokens=8",
            "callbacks.eval.at_start=false",
            "export=false",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp_path / 'outputs'}",
        ]
    )
    (sweep,) = (tmp_path / "outputs" / "tiny_sft" / "multirun").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    out = tmp_path / "lr.png"
    plot.main(
        ["sweep", str(sweep), "--param", "optim.lr", "--metric", "val/loss", "--out", str(out)]
    )
    with open(out.with_suffix(".csv")) as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["optim.lr"]) for r in rows] == [1e-3, 1e-2]
    assert all(float(r["val/loss"]) > 0 for r in rows)
    for job in ("0", "1"):
        saved = yaml.safe_load((sweep / job / ".hydra" / "config.yaml").read_text())
        assert saved["optim"]["lr"] == [1e-3, 1e-2][int(job)]


def test_compare_plot_draws_runs_on_shared_axes(tmp_path: Path, capsys) -> None:
    dense = _job(
        tmp_path, "dense", [], [{"step": 10, "val/loss": 3.0}, {"step": 20, "val/loss": 2.5}]
    )
    moe = _job(tmp_path, "moe", [], [{"step": 10, "val/loss": 2.9}, {"step": 20, "val/loss": 2.25}])
    out = tmp_path / "cmp.png"
    plot.main(["compare", str(dense), str(moe), "--metrics", "val/loss", "--labels", "d,m",
               "--out", str(out)])  # fmt: skip
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert json.loads(capsys.readouterr().out)["final"] == {
        "d": {"val/loss": 2.5},
        "m": {"val/loss": 2.25},
    }
    assert out.with_suffix(".md").read_text().splitlines()[2:] == [
        "| d | 2.5000 |",
        "| m | 2.2500 |",
    ]
    with pytest.raises(KeyError, match="not logged"):
        plot.main(["compare", str(dense), "--metrics", "train/loss", "--out", str(out)])


def test_sweep_report_names_every_swept_key(tmp_path: Path, caplog) -> None:
    """#54.11: two Optuna trials that drew the same `optim.weight_decay` still show it: the
    sweeper's search space names the swept keys, not only the values that differ."""
    import logging

    from astrai.train.sweep import SweepReport

    root = tmp_path / "multirun"
    for job, lr in (("0", "0.001"), ("1", "0.003")):
        _job(root, job, [f"optim.lr={lr}", "optim.weight_decay=0.1", "debug=fast"], [])
    config = OmegaConf.create(
        {
            "hydra": {
                "sweep": {"dir": str(root)},
                "sweeper": {
                    "params": {
                        "optim.lr": "tag(log, interval(1e-4, 1e-2))",
                        "optim.weight_decay": "choice(0.0, 0.05, 0.1)",
                    }
                },
                "overrides": {"task": ["hparams_search=optuna", "debug=fast"]},
            }
        }
    )
    with caplog.at_level(logging.INFO, logger="astrai.train.sweep"):
        SweepReport().on_multirun_end(config)
    assert "job 0 (optim.lr=0.001 optim.weight_decay=0.1)" in caplog.text, caplog.text
    assert "job 1 (optim.lr=0.003 optim.weight_decay=0.1)" in caplog.text
    assert "debug=fast" not in caplog.text.split("\n", 1)[1]  # not swept: not a job's name


def test_the_optuna_sweep_does_not_print_alembics_plugin_lines() -> None:
    """#54.11: Optuna imports alembic, which logs each migration plugin it loads at INFO
    through Hydra's logging; conf/hydra/default.yaml sets alembic to WARNING there."""
    import subprocess
    import sys

    from train_helpers import REPO

    code = (
        "from hydra.core.utils import configure_log\n"
        "from astrai.train.runner import compose\n"
        "cfg = compose(['hparams_search=optuna'])\n"
        "configure_log(cfg.hydra.hydra_logging, False)\n"
        "import optuna.storages._rdb.storage\n"
        "import logging; logging.getLogger('alembic.x').info('still shown: %s', 'alembic info')\n"
        "logging.getLogger('alembic.x').warning('still shown: %s', 'alembic warning')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "setup plugin" not in p.stdout and "alembic info" not in p.stdout, p.stdout
    assert "still shown: alembic warning" in p.stdout


@pytest.mark.slow
def test_an_optuna_study_in_sqlite_storage_runs_from_the_command_line(tmp_path, data_dir) -> None:
    """The storage conf/hparams_search/optuna.yaml documents (`sqlite:///optuna.db`, to
    share a study between workers) works: optuna 2.x, which hydra-optuna-sweeper pins, needs
    SQLAlchemy 1.x (with 2.x it failed inside its schema check, an AssertionError
    traceback), so the dev extras pin it."""
    import optuna
    from train_helpers import cli, run_dirs

    db = tmp_path / "optuna.db"
    cli(
        [
            "-m",
            "hparams_search=optuna",
            "debug=fast",
            "model=tiny",
            "tokenizer.train.vocab_size=512",
            "tokenizer.train.max_bytes=400000",
            "data.train.prepare.builtin.max_bytes=300000",
            "data.val.prepare.builtin.max_bytes=60000",
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.sampler.n_startup_trials=2",
            f"hydra.sweeper.storage=sqlite:///{db}",
            *run_dirs(tmp_path, data_dir),
        ],
        timeout=600,
    )
    study = optuna.load_study(study_name="tiny_pretrain", storage=f"sqlite:///{db}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2 and all(t.value is not None for t in done)
    assert {"optim.lr", "optim.weight_decay"} <= set(done[0].params)
