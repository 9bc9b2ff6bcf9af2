"""Fully sharded data parallel on CPU processes (`trainer=fsdp2`, torch's `fully_shard` over
gloo): 2 ranks of batch 4 train as 1 process of batch 8 does, step by step, and export the
same model as 2 DDP ranks; the export is the full model gathered from the shards.

The per-step loss compared is the mean over ranks of each rank's loss (tests/train/
_scale_callbacks.py), i.e. the loss of the whole global batch: the CSV log holds rank 0's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import SMALL, TINY_MODEL, cli

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS = 20
COMMON = [
    *TINY_MODEL,
    *SMALL,
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "optim.lr=1e-2",
    # below the gradient norms of these steps (0.6-0.8): clipping acts on most of them, so
    # the sharded norm must be the whole gradient's
    "trainer.gradient_clip_val=0.5",
]
ONE = ["data.batch_size=8", "data.val_batch_size=8"]
TWO = ["trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=4", "data.val_batch_size=4"]


def _run(tmp: Path, data_dir: Path, extra: list[str]) -> Path:
    losses = tmp / "losses.jsonl"
    cli(
        [
            *COMMON,
            *extra,
            "+callbacks.losses._target_=_scale_callbacks.GlobalLoss",
            f"+callbacks.losses.path={losses}",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp / 'outputs'}",
            f"hydra.run.dir={tmp / 'run'}",
        ],
        env={"PYTHONPATH": str(HERE)},
    )
    return tmp


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _grad_norms(run: Path) -> list[float]:
    import csv

    (metrics,) = (run / "run" / "csv").glob("*/metrics.csv")
    with open(metrics) as fh:
        return [float(r["train/grad_norm"]) for r in csv.DictReader(fh) if r["train/grad_norm"]]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "run" / "export" / "model.safetensors")


def test_fsdp_two_processes_match_one_with_twice_the_batch_and_ddp(
    tmp_path: Path, data_dir: Path
) -> None:
    one = _run(tmp_path / "one", data_dir, ONE)
    ddp = _run(tmp_path / "ddp", data_dir, ["trainer=ddp", *TWO])
    fsdp = _run(tmp_path / "fsdp", data_dir, ["trainer=fsdp2", *TWO])
    shards = sorted(p.name for p in (fsdp / "run" / "checkpoints" / "last.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], shards

    l1, lddp, lfsdp = _losses(one), _losses(ddp), _losses(fsdp)
    assert sorted(lfsdp) == sorted(l1) == list(range(1, STEPS + 1))
    worst = max(abs(lfsdp[s] - l1[s]) for s in l1)
    assert worst <= 1e-5, f"FSDP vs 1 process: max |loss difference| {worst:.2e}"
    worst_ddp = max(abs(lfsdp[s] - lddp[s]) for s in l1)
    assert worst_ddp <= 1e-5, f"FSDP vs DDP: max |loss difference| {worst_ddp:.2e}"
    # the logged gradient norm is the whole gradient's, not rank 0's shard
    n1, nfsdp = _grad_norms(one), _grad_norms(fsdp)
    assert any(n > 0.5 for n in n1), n1  # clipping engaged
    torch.testing.assert_close(torch.tensor(nfsdp), torch.tensor(n1), rtol=1e-4, atol=0)

    # the export is the full model (gathered on rank 0), equal to DDP's and to 1 process's
    w1, wddp, wfsdp = _weights(one), _weights(ddp), _weights(fsdp)
    assert wfsdp.keys() == wddp.keys() == w1.keys()
    for key in w1:
        assert wfsdp[key].shape == w1[key].shape, key
        torch.testing.assert_close(wfsdp[key], wddp[key], rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(wfsdp[key], w1[key], rtol=0, atol=1e-5, msg=key)
