"""`hydra/launcher=submitit_local`: a sweep whose jobs submitit runs, each in a process of its
own, through the same launcher code as `hydra/launcher=slurm` (hydra-submitit-launcher; only
the executor differs), and the SLURM launcher config composes with the trainer's sizes."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from train_helpers import SMALL, TINY_MODEL, cli

from astrai.train.runner import compose


def test_submitit_local_sweep_writes_two_job_folders_with_exports(
    tmp_path: Path, data_dir: Path
) -> None:
    sweep = tmp_path / "multirun"
    proc = cli(
        [
            "-m",
            "hydra/launcher=submitit_local",
            *TINY_MODEL,
            *SMALL,
            "callbacks.progress_bar=null",
            "trainer.enable_model_summary=false",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1",
            "optim.lr=1e-3,3e-4",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp_path / 'outputs'}",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    out = proc.stdout + proc.stderr
    assert "Submitit 'local' sweep output dir" in out, out[-3000:]
    lrs = set()
    for job in ("0", "1"):
        assert (sweep / job / "export" / "model.safetensors").is_file(), job
        assert (sweep / job / "export" / "config.json").is_file(), job
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file(), job
        overrides = OmegaConf.load(sweep / job / ".hydra" / "overrides.yaml")
        lrs |= {o for o in overrides if o.startswith("optim.lr=")}
        assert f"{sweep / job / 'export'}" in out  # the sweep's report lists each export
    assert lrs == {"optim.lr=0.001", "optim.lr=0.0003"}
    # submitit ran each job itself: one folder per submitted job, with its result
    submitted = [p for p in (sweep / ".submitit").iterdir() if any(p.glob("*_result.pkl"))]
    assert len(submitted) == 2, sorted(p.name for p in (sweep / ".submitit").iterdir())


def test_slurm_launcher_asks_for_the_trainers_nodes_and_gpus() -> None:
    cfg = compose(
        [
            "hydra/launcher=slurm",
            "trainer=fsdp2",
            "trainer.devices=8",
            "trainer.num_nodes=4",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=60",
        ]
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 8, 8)
    assert (launcher.partition, launcher.timeout_min) == ("gpu", 60)
