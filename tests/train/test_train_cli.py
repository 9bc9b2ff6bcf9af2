"""`python -m astrai.train` end to end on small data (subprocesses, CPU).

Covers: the tiny experiments in fast mode, run outputs (checkpoints, export, latest link,
CSV logs), exact resume after SIGKILL, W&B run-id reuse, 2-process DDP against one process
with twice the batch, multirun folders and concurrent sweeps, and a NaN stop.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from train_helpers import REPO, SMALL, TINY_MODEL, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
QUIET = ["callbacks.progress_bar=null", "trainer.enable_model_summary=false"]


def _weights(export: Path) -> dict[str, torch.Tensor]:
    return load_file(export / "model.safetensors")


def _metrics(run: Path) -> list[dict[str, str]]:
    import csv

    rows: list[dict[str, str]] = []
    for f in sorted((run / "csv").glob("*/metrics.csv")) + sorted(
        (run / "csv").glob("metrics.csv")
    ):
        with open(f) as fh:
            rows.extend(csv.DictReader(fh))
    return rows


def _last(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key)]
    assert values, f"no {key} logged"
    return values[-1]


def test_tiny_pretrain_fast_outputs(tmp_path: Path, data_dir: Path) -> None:
    """No experiment = tiny_pretrain; a run writes checkpoints, an export, logs, latest link.
    A debug=fast run goes to outputs/debug/ with its own latest links: outputs/latest (what
    `make serve` serves) is left to real runs."""
    dirs = [
        f"paths.root_dir={tmp_path}",
        f"paths.data_dir={data_dir}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    cli(["debug=fast", *SMALL, *QUIET, *dirs])
    run = tmp_path / "run"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / ".hydra" / "config.yaml").is_file()
    from astrai.model import AutoModel
    from astrai.tokenizer import AutoTokenizer

    model = AutoModel.from_pretrained(run / "export")
    tok = AutoTokenizer.from_pretrained(run / "export")
    assert model.config.vocab_size == 4096 and 3_000_000 < model.num_parameters() < 6_000_000
    assert len(tok) <= model.config.vocab_size
    state = json.loads((run / "export" / "training_state.json").read_text())
    assert state["global_step"] == 3
    assert not (tmp_path / "outputs" / "latest").exists()
    latest = tmp_path / "outputs" / "debug" / "latest"
    assert (latest / "export" / "model.safetensors").is_file()
    assert latest.resolve() == run.resolve()
    assert (tmp_path / "outputs" / "debug" / "tiny_pretrain" / "latest").resolve() == run.resolve()
    rows = _metrics(run)
    assert _last(rows, "val/loss") > 0 and _last(rows, "train/loss") > 0
    assert any(r.get("lr/hidden") for r in rows)


def test_tiny_sft_fast_with_lora(tmp_path: Path, data_dir: Path) -> None:
    """tiny_sft (with its eval-generation callback) through the CLI, training LoRA adapters:
    the export holds merged plain weights."""
    cli(
        [
            "experiment=tiny_sft",
            "debug=fast",
            "tokenizer.train.max_bytes=400000",
            "data.train.prepare.builtin.n=300",
            "data.val.prepare.builtin.n=64",
            "callbacks.eval.suites.arithmetic.num_prompts=4",
            "callbacks.eval.suites.arithmetic.max_tokens=8",
            "strategy.lora={r: 4, lora_alpha: 8}",
            *QUIET,
            *run_dirs(tmp_path, data_dir),
        ]
    )
    run = tmp_path / "run"
    w = _weights(run / "export")
    assert w and not any("lora" in k for k in w)
    rows = _metrics(run)
    assert _last(rows, "train/assistant_tokens") > 0
    assert any(r.get("eval/arithmetic/exact_match") for r in rows)
    assert (run / "eval_samples.jsonl").is_file()
    assert (tmp_path / "outputs" / "tiny_sft" / "latest").resolve() == run.resolve()


def test_sigkill_and_resume_is_bit_identical(tmp_path: Path, data_dir: Path) -> None:
    """Killed mid-step at a random step and resumed from last.ckpt: the same final weights as
    an uninterrupted run, bit for bit (CPU, fp32); W&B continues the same run id."""
    steps = 10
    common = [
        *TINY_MODEL,
        *SMALL,
        *QUIET,
        f"trainer.max_steps={steps}",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "optim.schedule.warmup_steps=3",
        "data.batch_size=4",
    ]
    cli([*common, *run_dirs(tmp_path / "a", data_dir)])
    kill_at = random.Random().randint(2, steps - 2)
    b = [*common, "logger=wandb", *run_dirs(tmp_path / "b", data_dir)]
    env = {"PYTHONPATH": str(HERE)}
    killed = cli(
        [*b, "+callbacks.kill._target_=_callbacks.KillAtStep", f"+callbacks.kill.step={kill_at}"],
        check=False,
        env=env,
    )
    assert killed.returncode == -9, (kill_at, killed.stderr[-3000:])
    run_b = tmp_path / "b" / "run"
    assert not (run_b / "export").exists()
    first_id = json.loads((run_b / "checkpoints" / "wandb_run.json").read_text())["id"]
    cli([*b, "ckpt_path=last"])
    a, bw = _weights(tmp_path / "a" / "run" / "export"), _weights(run_b / "export")
    assert a.keys() == bw.keys()
    different = [k for k in a if not torch.equal(a[k], bw[k])]
    assert not different, f"killed at step {kill_at}: {different}"
    assert json.loads((run_b / "checkpoints" / "wandb_run.json").read_text())["id"] == first_id
    runs = sorted(p.name for p in (run_b / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(first_id) for r in runs), runs


def test_ddp_two_processes_match_one_with_twice_the_batch(tmp_path: Path, data_dir: Path) -> None:
    common = [
        *TINY_MODEL,
        *SMALL,
        *QUIET,
        "name=ddp_check",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.limit_val_batches=2",
        "optim.lr=1e-2",
        f"paths.data_dir={data_dir}",
    ]
    cli(
        [*common, "data.batch_size=8", "data.val_batch_size=8", f"paths.log_dir={tmp_path / 'one'}"]
    )
    ddp = [
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "data.batch_size=4",
        "data.val_batch_size=4",
    ]
    cli([*common, *ddp, f"paths.log_dir={tmp_path / 'two'}"])
    # Lightning started rank 1 inside the same run folder: one folder per run
    (one,) = [p for p in (tmp_path / "one" / "ddp_check").iterdir() if not p.is_symlink()]
    (two,) = [p for p in (tmp_path / "two" / "ddp_check").iterdir() if not p.is_symlink()]
    assert (two / "train_ddp_process_1.log").is_file()
    loss1, loss2 = _last(_metrics(one), "val/loss"), _last(_metrics(two), "val/loss")
    assert loss2 == pytest.approx(loss1, rel=1e-4)
    w1, w2 = _weights(one / "export"), _weights(two / "export")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)


def test_two_concurrent_sweeps_do_not_collide(tmp_path: Path, data_dir: Path) -> None:
    """Two 2-job sweeps started at the same moment: four separate job folders."""
    args = [
        "-m",
        *TINY_MODEL,
        *SMALL,
        *QUIET,
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.val_check_interval=2",
        "export=false",
        "optim.lr=1e-3,3e-4",
        f"paths.data_dir={data_dir}",
        f"paths.log_dir={tmp_path / 'outputs'}",
    ]
    cli(
        [
            "debug=fast",
            *SMALL,
            *TINY_MODEL,
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp_path / 'warm'}",
        ]
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "astrai.train", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    sweeps = sorted((tmp_path / "outputs" / "tiny_pretrain" / "multirun").iterdir())
    assert len(sweeps) == 2, sweeps
    for sweep in sweeps:
        jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
        assert jobs == ["0", "1"], (sweep, jobs)
        lrs = set()
        for job in ("0", "1"):
            assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
            overrides = (sweep / job / ".hydra" / "overrides.yaml").read_text()
            lrs.add(next(line for line in overrides.splitlines() if "optim.lr" in line))
        assert len(lrs) == 2


def test_nan_stops_training_and_keeps_last_good_checkpoint(tmp_path: Path, data_dir: Path) -> None:
    env = {"PYTHONPATH": str(HERE)}
    proc = cli(
        [
            *TINY_MODEL,
            *SMALL,
            *QUIET,
            "trainer.max_steps=8",
            "trainer.val_check_interval=8",
            "callbacks.model_checkpoint.every_n_train_steps=1",
            "+callbacks.nan._target_=_callbacks.NaNAtStep",
            "+callbacks.nan.step=4",
            *run_dirs(tmp_path, data_dir),
        ],
        check=False,
        env=env,
    )
    assert proc.returncode != 0
    assert "NonFiniteLossError" in proc.stderr and "at global step 4" in proc.stderr
    assert "last checkpoint" in proc.stderr
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    assert not (tmp_path / "run" / "export").exists()


def test_missing_data_path_fails_before_building_anything(tmp_path: Path, data_dir: Path) -> None:
    start = time.time()
    proc = cli(
        ["data.train.source=/nonexistent/corpus.jsonl", *run_dirs(tmp_path, data_dir)],
        check=False,
    )
    assert proc.returncode != 0
    assert "data.train.source: /nonexistent/corpus.jsonl does not exist" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert time.time() - start < 120


def test_both_experiment_spellings_let_later_slots_win() -> None:
    """`+experiment=NAME` (Hydra's docs) and `experiment=NAME` (the template's) fill
    train.yaml's slot, and a later slot wins over it in both (debug=fast shortens the
    experiment, hardware=cpu_smoke shrinks it)."""
    for spelling in ("+experiment=sft_1b", "experiment=sft_1b"):
        proc = cli([spelling, "debug=fast", "hardware=cpu_smoke", "--cfg", "job"], timeout=120)
        cfg = OmegaConf.create(proc.stdout)
        assert cfg.name == "sft_1b" and cfg.trainer.max_steps == 2, spelling
        assert cfg.trainer.accelerator == "cpu" and cfg.model.hidden_size == 64, spelling


def test_problems_found_while_preparing_are_one_line(tmp_path: Path, data_dir: Path) -> None:
    """#54.9: what only preparing the data shows is one line naming the fix, no traceback:
    a record without `messages`, and SFT records packed into fewer windows than one batch
    (64 short chats in 512-token windows: more than the pre-run bound allows for, fewer
    than 8 once tokenized)."""
    chat = {
        "messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    }
    good = tmp_path / "chats.jsonl"
    good.write_text((json.dumps(chat) + "\n") * 64)
    bad = tmp_path / "bad.jsonl"
    bad.write_text((json.dumps(chat) + "\n") * 40 + json.dumps({"text": "no messages"}) + "\n")
    sft = [
        "+experiment=tiny_sft",
        "data=sft_files",
        "callbacks=default",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.train.prepare.window_size=512",
        *SMALL[:1],
        *TINY_MODEL,
        *QUIET,
    ]
    for source, batch, expected in (
        (good, 8, "records are packed into 512-token windows"),
        (bad, 2, "+data.<split>.prepare.skip_bad_lines=true"),
    ):
        run = tmp_path / source.stem
        args = [f"data.train.source={source}", f"data.val.source={good}"]
        proc = cli([*sft, *args, f"data.batch_size={batch}", *run_dirs(run, data_dir)], check=False)
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
