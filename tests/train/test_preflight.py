"""Checks before a training run (astrai/train/preflight.py): through the real CLI, each bad
config fails in seconds with every problem in one message naming the key and the fix, a
non-zero status, no traceback, and nothing on disk (no run folder, no data, no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_helpers import cli, run_dirs

from astrai.train import preflight, runner
from astrai.train.runner import compose

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
# lines that only expensive work writes: tokenizer training, data preparation, model building,
# Lightning's start, the run folder
EXPENSIVE = ("training a", "prepared", "Seed set", "output folder", "GPU available", "saved model")


def _problems(*overrides: str) -> list[str]:
    return preflight.problems(compose(list(overrides)))


def _fails_before_any_work(tmp_path: Path, *args: str) -> str:
    """Run the CLI with `args`: it must fail with our message and leave nothing behind."""
    data = tmp_path / "data"
    proc = cli([*args, *run_dirs(tmp_path, data)], check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "problem" in proc.stderr and "nothing was run" in proc.stderr, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not [line for line in out.splitlines() if any(e in line for e in EXPENSIVE)], out
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "left on disk"
    return proc.stderr


# ---------------------------------------------------------------------- in process (fast)
def test_a_good_config_has_no_problems() -> None:
    assert _problems() == []
    assert _problems("experiment=tiny_sft") == []


def test_missing_paths_are_all_named() -> None:
    found = _problems("data.train.source=/nope/a.jsonl", "data.val.source=/nope/b.jsonl")
    assert found == [
        "data.train.source: /nope/a.jsonl does not exist",
        "data.val.source: /nope/b.jsonl does not exist",
    ]


def test_a_mixtures_bad_entries_are_named_before_the_run() -> None:
    mix = ["data=arithmetic_sft_mix", "strategy=sft"]
    assert _problems(*mix) == []
    found = _problems(*mix, "data.train.sources.2.source=/nope/c.jsonl")
    assert found == ["data.train.sources[2].source: /nope/c.jsonl does not exist"]
    assert _problems(*mix, "data.train.sources.1.weight=-1", "data.use_dynamic_bsz=true") == [
        "data.use_dynamic_bsz=true cuts each training batch as one padding-free row of at most "
        "data.max_token_len_per_gpu tokens; it needs data.padding_free=true",
        "data.train.sources[1].weight: must be positive and finite, got -1 (remove the entry "
        "to leave a source out)",
        "data.use_dynamic_bsz: not with data.train.sources (a mixture's batches are "
        "data.batch_size samples); set data.use_dynamic_bsz=false",
    ]


@NO_GPU
def test_gpu_recipes_name_the_cpu_override() -> None:
    for name in ("sft_1b", "pretrain_1b", "pretrain_1b_moe", "dpo_1b", "grpo_1b"):
        found = [p for p in _problems(f"experiment={name}") if p.startswith("trainer.")]
        assert len(found) == 1, (name, found)
        assert "needs CUDA GPUs" in found[0]
        assert f"experiment={name} hardware=cpu_smoke" in found[0]
        assert _problems(f"experiment={name}", "hardware=cpu_smoke") == [], name
    # a sweep that a cluster launcher submits from a login node leaves the GPUs to its jobs
    cfg = compose(["experiment=sft_1b"])
    assert not [p for p in preflight.problems(cfg, hardware=False) if p.startswith("trainer.")]


def test_more_devices_than_gpus(monkeypatch) -> None:
    """On a one-GPU machine (simulated), devices=8 is named."""
    monkeypatch.setattr(preflight, "cuda_device_count", lambda: 1)
    found = [p for p in _problems("experiment=sft_1b") if p.startswith("trainer.")]
    assert found == [
        "trainer.devices=8: this machine has 1 GPU(s); pass trainer.devices=1 (the global "
        "batch then shrinks: raise trainer.accumulate_grad_batches to keep it)"
    ]
    assert not [p for p in _problems("experiment=sft_1b", "trainer.devices=1") if "trainer" in p]


def test_start_export_of_dpo_and_grpo(tmp_path: Path) -> None:
    for name in ("tiny_dpo", "tiny_grpo"):
        found = _problems(f"experiment={name}", f"paths.log_dir={tmp_path}")
        assert len(found) == 1, found  # the on-policy data's own complaint is not repeated
        assert found[0].startswith("strategy.init_from: ")
        assert "python -m astrai.train +experiment=tiny_sft_start" in found[0]
        assert "strategy.init_from=null" in found[0]
    # the 1B DPO and GRPO (model.path) name the stage whose export they start from
    for name in ("dpo_1b", "grpo_1b"):
        found = [p for p in _problems(f"experiment={name}") if p.startswith("model.path")]
        assert len(found) == 1 and "python -m astrai.train +experiment=sft_1b" in found[0]
    # an explicit fresh start: GRPO runs; DPO's on-policy pairs still need a policy to sample
    assert _problems("experiment=tiny_grpo", "strategy.init_from=null") == []
    found = _problems("experiment=tiny_dpo", "strategy.init_from=null")
    assert [p.split(":")[0] for p in found] == ["data.train.source", "data.val.source"]
    assert all("OnPolicyPairs.policy" in p for p in found)


def test_second_models_of_distill_and_ppo_must_exist(tmp_path: Path) -> None:
    """The teacher's export and a critic's start path are named as `init_from` is; PPO and
    distillation name the stage their model.path typically comes from."""
    found = _problems("experiment=tiny_distill", f"paths.log_dir={tmp_path}")
    assert [p.split(":")[0] for p in found] == [
        "strategy.init_from",
        "strategy.teacher_model_name_or_path",
    ], found
    assert "`python -m astrai.train +experiment=tiny_sft` first" in found[1]
    assert "strategy.teacher_model_name_or_path=null" in found[1]
    start = tmp_path / "tiny_sft_start" / "latest" / "export"
    start.mkdir(parents=True)
    assert (
        _problems(
            "experiment=tiny_distill",
            f"paths.log_dir={tmp_path}",
            "strategy.teacher_model_name_or_path=null",
        )
        == []
    )
    found = _problems("experiment=tiny_ppo", f"paths.log_dir={tmp_path}")
    assert found == [], found  # critic.init: policy is not a path
    found = _problems(
        "experiment=tiny_ppo", f"paths.log_dir={tmp_path}", "strategy.critic.init=/nope/critic"
    )
    assert found == [
        "strategy.critic.init: /nope/critic does not exist (the export the critic starts "
        "from); pass strategy.critic.init=<an earlier run's export directory>, or "
        "strategy.critic.init=policy to start it from the policy"
    ]
    for target in ("PPOModule", "DistillModule"):
        assert preflight.START_STAGES[target] == "sft_1b"


def test_ckpt_path_last_needs_a_checkpoint_and_auto_does_not(tmp_path: Path) -> None:
    found = _problems("ckpt_path=last", f"paths.log_dir={tmp_path}")
    assert len(found) == 1 and found[0].startswith("ckpt_path=last: no checkpoint")
    assert "ckpt_path=auto" in found[0]
    assert _problems("ckpt_path=auto", f"paths.log_dir={tmp_path}") == []
    assert _problems(f"ckpt_path={tmp_path / 'x.ckpt'}") == [
        f"ckpt_path: {tmp_path / 'x.ckpt'} does not exist"
    ]
    assert runner.resolve_ckpt_path("auto", tmp_path / "run", tmp_path, "x") is None


def test_a_run_folder_holding_checkpoints_needs_ckpt_path(tmp_path: Path) -> None:
    """Started again in a folder with checkpoints (a fixed hydra.run.dir) and no ckpt_path:
    refused, naming ckpt_path=last and a new folder (never a silent resume or restart)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = compose([f"paths.log_dir={tmp_path}"])
    assert preflight.problems(cfg, run_dir=run) == []  # an empty checkpoints folder is fine
    (run / "checkpoints" / "interrupted.ckpt").write_bytes(b"x")
    (found,) = preflight.problems(cfg, run_dir=run)
    assert found.startswith(f"hydra.run.dir: {run} already holds checkpoints (interrupted.ckpt)")
    assert "ckpt_path=last" in found and "new folder" in found
    resume = compose(["ckpt_path=auto", f"paths.log_dir={tmp_path}"])
    assert preflight.problems(resume, run_dir=run) == []


@pytest.mark.slow
def test_cli_refuses_a_run_folder_holding_checkpoints(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"kept")
    proc = cli([*run_dirs(tmp_path, tmp_path / "data")], check=False, timeout=120)
    assert proc.returncode != 0 and "already holds checkpoints (last.ckpt)" in proc.stderr
    assert (checkpoints / "last.ckpt").read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_cli_checks_every_sweep_job_before_the_first(tmp_path: Path) -> None:
    """A bad value in the last job of a grid is named with its overrides before job 0 runs."""
    err = _fails_before_any_work(
        tmp_path,
        "-m",
        "+experiment=tiny_sft",
        "optim.lr=1e-3,3e-3",
        "data.val.source=builtin:arithmetic/sft/val,/nope/val.jsonl",
    )
    assert "2 of 4 sweep jobs have problems" in err, err
    assert "job 1 (data.val.source=/nope/val.jsonl optim.lr=0.001)" in err or (
        "job 1 (optim.lr=0.001 data.val.source=/nope/val.jsonl)" in err
    ), err
    assert "job 3 (optim.lr=0.003 data.val.source=/nope/val.jsonl)" in err, err
    assert err.count("data.val.source: /nope/val.jsonl does not exist") == 2, err


@pytest.mark.skipif(
    Path("/proc/driver/nvidia").exists(), reason="counting GPUs imports torch where a driver is"
)
def test_a_config_error_is_found_without_importing_torch(tmp_path: Path) -> None:
    """The preflight of a CPU machine needs neither torch nor Lightning (seconds saved on a
    loaded machine): Python's import profile (`-X importtime`) shows neither, for a GPU recipe
    and for a preset model with a missing corpus (whose vocabulary is checked too)."""
    for args, expected in (
        (["+experiment=sft_1b"], "model.path: required"),
        (["data.train.source=/nope"], "data.train.source: /nope does not exist"),
    ):
        proc = cli(
            [*args, *run_dirs(tmp_path, tmp_path / "d")],
            check=False,
            timeout=120,
            env={"PYTHONPROFILEIMPORTTIME": "1"},
        )
        assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
        lines = proc.stderr.splitlines()
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")
        }
        assert "hydra" in imported  # the measure works
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "lightning"))
        assert not heavy, (args, heavy[:10])


def test_too_little_data_for_one_batch(tmp_path: Path) -> None:
    found = _problems("experiment=tiny_sft", "data.train.prepare.builtin.n=31")
    assert len(found) == 1 and found[0].startswith("data.train: at most 31 training samples")
    assert "data.batch_size=32" in found[0] and "lower data.batch_size" in found[0]
    assert _problems("experiment=tiny_sft", "data.train.prepare.builtin.n=32") == []
    # a JSONL file: its non-empty lines bound the records
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": []}\n\n' * 3)
    sft = ["experiment=tiny_sft", f"data.train.source={chats}", "data.batch_size=4"]
    assert "at most 3 training samples" in _problems(*sft)[0]
    assert _problems(*sft, "data.batch_size=3") == []
    # a pretraining corpus: its bytes bound the tokens (a token covers a byte or more)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x" * 1000)
    pre = [f"data.train.source={corpus}", "data.batch_size=8"]  # 128-token windows
    assert "at most 7 training samples" in _problems(*pre)[0]
    corpus.write_text("x" * 5000)
    assert _problems(*pre) == []


def _chats(path: Path, n: int, broken: int | None = None) -> Path:
    import json

    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"{i}+1?"},
                    {"role": "assistant", "content": str(i + 1)},
                ]
            }
        )
        for i in range(n)
    ]
    if broken is not None:
        lines[broken - 1] = '{"messages": [broken'
    path.write_text("\n".join(lines) + "\n")
    return path


def _sft(path: Path, *more: str) -> list[str]:
    return [
        "experiment=tiny_sft",
        "data=sft_files",
        f"data.train.source={path}",
        f"data.val.source={path}",
        *more,
    ]


def test_a_broken_jsonl_line_is_named_before_the_run(tmp_path: Path) -> None:
    """#54.9: found here, naming file and line, not while preparing once the run folder and
    the model exist; `skip_bad_lines` (the fix it names) turns the check off."""
    chats = _chats(tmp_path / "chats.jsonl", 64, broken=31)
    found = _problems(*_sft(chats, "data.train.prepare.pack=false"))
    assert found == [
        f"data.train.source: {chats}:31: not valid JSON (Expecting value at column 15); fix the "
        "line, or skip such lines with +data.train.prepare.skip_bad_lines=true",
        f"data.val.source: {chats}:31: not valid JSON (Expecting value at column 15); fix the "
        "line, or skip such lines with +data.val.prepare.skip_bad_lines=true",
    ]
    skip = [f"+data.{s}.prepare.skip_bad_lines=true" for s in ("train", "val")]
    assert _problems(*_sft(chats, "data.train.prepare.pack=false", *skip)) == []


def test_sft_records_packed_into_too_few_windows(tmp_path: Path) -> None:
    """#54.9: 64 short chats are 64 records but, packed into 4096-token windows (sft_files),
    at most three samples: fewer than one batch of 8; the message says so."""
    chats = _chats(tmp_path / "chats.jsonl", 64)
    (found,) = _problems(*_sft(chats))
    assert found.startswith("data.train: at most 3 training samples (packed windows"), found
    assert "window_size=4096" in found and "data.train.prepare.pack=false" in found
    assert _problems(*_sft(chats, "data.train.prepare.pack=false")) == []  # 64 records


def test_settings_lightning_and_torch_refuse_are_named() -> None:
    """#54.9: a value Lightning's Trainer or torch's optimizer refuses, before the model."""
    assert _problems("trainer.max_steps=abc") == [
        "trainer.max_steps='abc': lightning.Trainer takes int"
    ]
    assert _problems("optim.lr=-1e-3") == ["optim.lr: Invalid learning rate: -0.001"]
    assert _problems("optim.betas=[0.9,1.5]") == [
        "optim.betas: Invalid beta parameter at index 1: 1.5"
    ]
    (found,) = _problems("+optim.lrr=3")
    assert found.startswith("optim: ") and "'lrr'" in found


def test_tokenizer_larger_than_the_model_vocabulary() -> None:
    assert _problems("model=tiny", "tokenizer.train.vocab_size=1024") == [
        "tokenizer.train.vocab_size: the tokenizer has 1024 tokens but model preset 'tiny' "
        "has vocab_size=512; use tokenizer.train.vocab_size<=512 or a model with "
        "vocab_size >= 1024 (+model.vocab_size=1024)"
    ]
    assert _problems("model=tiny", "tokenizer.train.vocab_size=512") == []


# ---------------------------------------------------------------------- the real CLI
@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["data.train.source=/nonexistent/corpus.jsonl"], ["data.train.source: /nonexistent"]),
        (["experiment=tiny_dpo"], ["strategy.init_from:", "experiment=tiny_sft_start"]),
        (["experiment=tiny_grpo"], ["strategy.init_from:", "strategy.init_from=null"]),
        (["ckpt_path=last"], ["ckpt_path=last: no checkpoint", "ckpt_path=auto"]),
        (
            ["experiment=tiny_sft", "data.train.prepare.builtin.n=4"],
            ["data.train: at most 4 training samples", "lower data.batch_size"],
        ),
        (
            ["model=tiny", "tokenizer.train.vocab_size=1024"],
            ["tokenizer.train.vocab_size: the tokenizer has 1024", "+model.vocab_size=1024"],
        ),
        (["trainer.max_steps=abc"], ["trainer.max_steps='abc': lightning.Trainer takes int"]),
        (["optim.lr=-1e-3"], ["optim.lr: Invalid learning rate: -0.001"]),
        pytest.param(
            ["experiment=sft_1b"],
            ["trainer.accelerator=gpu: needs CUDA", "experiment=sft_1b hardware=cpu_smoke"],
            marks=NO_GPU,
        ),
        pytest.param(
            ["experiment=pretrain_1b"],
            ["trainer.strategy=FSDP", "experiment=pretrain_1b hardware=cpu_smoke"],
            marks=NO_GPU,
        ),
    ],
)
def test_cli_fails_before_any_work(tmp_path: Path, args: list[str], expected: list[str]) -> None:
    err = _fails_before_any_work(tmp_path, *args)
    for text in expected:
        assert text in err, err


@pytest.mark.slow
def test_cli_reports_every_problem_at_once(tmp_path: Path) -> None:
    err = _fails_before_any_work(
        tmp_path,
        "experiment=tiny_sft",
        "data.val.source=/nope/val.jsonl",
        "strategy.init_from=/nope/export",
        "ckpt_path=last",
        "data.train.prepare.builtin.n=8",  # 8 chats, batches of 32
        "tokenizer.train.vocab_size=8192",
    )
    expected = [
        "data.val.source: /nope/val.jsonl does not exist",
        "strategy.init_from: /nope/export does not exist",
        "ckpt_path=last: no checkpoint",
        "tokenizer.train.vocab_size: the tokenizer has 8192 tokens",
        "data.train: at most 8 training samples",
    ]
    assert f"{len(expected)} problems" in err, err
    for text in expected:
        assert text in err, err


@pytest.mark.slow
def test_cli_misspelt_key_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    proc = cli(["trainer.max_stepz=3", *run_dirs(tmp_path, tmp_path)], check=False, timeout=120)
    assert proc.returncode != 0
    assert "trainer.max_stepz" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_zero_training_batches_fail_the_run(tmp_path: Path, data_dir: Path) -> None:
    """What only preparation tells (a built-in corpus' token count): Lightning ends `fit`
    without a batch, and the run fails with our message and writes no export."""
    proc = cli(
        [
            "model=tiny",
            "tokenizer.train.vocab_size=512",
            "tokenizer.train.max_bytes=400000",
            "data.train.prepare.builtin.max_bytes=3000",
            "data.val.prepare.builtin.max_bytes=60000",
            "data.batch_size=64",
            "debug=fast",
            *run_dirs(tmp_path, data_dir),
        ],
        check=False,
    )
    assert proc.returncode != 0
    assert "data.train: no training batches" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "export").exists()


@NO_GPU
def test_compile_without_a_compiler_is_named(monkeypatch) -> None:
    """`model.compile=true` on CPU needs a C++ compiler: without one it is a preflight
    problem naming the option (not a traceback at the first step)."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    found = _problems("model.compile=true")
    assert len(found) == 1 and found[0].startswith("model.compile=true"), found
    assert "model.compile=false" in found[0]
    assert _problems("model.compile=false") == []
