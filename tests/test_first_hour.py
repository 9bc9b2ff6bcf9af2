"""The shared start of every command (#17): the torch thread policy, one key for a model
directory (`model_path=`) with the right key named for a wrong one, and the threads the
policy sets in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.cli_keys import model_args
from astrai.runtime import busy_cores, choose_threads, sampled_busy_cores

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- thread policy
@pytest.mark.parametrize(
    ("cores", "load", "expected"),
    [
        (2, 0.0, 2),  # a quiet 2-core machine: both cores
        (2, 0.3, 2),  # background noise is not a busy process
        (2, 1.0, 1),  # one busy process: the other core
        (2, 1.2, 1),
        (2, 8.0, 1),  # oversubscribed: one thread, never zero
        (16, 4.0, 12),
        (16, 0.0, 16),
        (4, None, 4),  # no load average (not Linux): all cores
    ],
)
def test_threads_follow_the_free_cores(cores, load, expected):
    assert choose_threads(cores, load) == expected


def test_threads_shrink_with_load_and_stay_in_range():
    for cores in (1, 2, 3, 8, 64):
        counts = [choose_threads(cores, load / 4) for load in range(0, 4 * 3 * cores)]
        assert counts[0] == cores and all(1 <= n <= cores for n in counts)
        assert counts == sorted(counts, reverse=True)  # more load never means more threads


def test_an_explicit_count_wins():
    assert choose_threads(2, 8.0, requested=4) == 4
    assert choose_threads(2, 8.0, requested=0) == 1  # 0 / null: the policy


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_busy_cores_sees_a_process_that_just_started():
    """A competitor started a moment ago already counts (a 1-minute load average would not
    see it yet), and the figure stays within the cores this process may use."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        sampled = sampled_busy_cores(window=0.5)
        busy = busy_cores(window=0.5)  # the busier of this sample and the load average
    finally:
        spinner.kill()
        spinner.wait()
    assert sampled is not None and 0.7 <= sampled <= len(os.sched_getaffinity(0)) + 0.05
    assert busy is not None and busy >= 0.7


def _threads_in_fresh_process(requested, env):
    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO);"
        "from astrai.runtime import set_threads;"
        f"set_threads({requested!r});"
        "print(torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    full = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return tuple(map(int, p.stdout.split())), p.stderr


@pytest.mark.slow  # fresh interpreters importing torch
def test_set_threads_applies_and_logs_the_choice():
    (intra, inter), log = _threads_in_fresh_process(1, {})
    assert (intra, inter) == (1, 1) and log.count("torch threads: 1 (threads=)") == 1
    (intra, _), log = _threads_in_fresh_process(None, {"OMP_NUM_THREADS": "1"})
    assert intra == 1 and "torch threads: 1 (OMP_NUM_THREADS)" in log
    (intra, _), log = _threads_in_fresh_process(None, {})
    cores = len(os.sched_getaffinity(0))
    assert 1 <= intra <= cores and f"({cores} cores; busy: " in log and " over 1 min)" in log


# ------------------------------------------------------------------------- one vocabulary
def test_model_path_means_the_model_group_in_train_and_bench():
    assert model_args("train", ["model_path=/m", "debug=fast"]) == [
        "model=pretrained",
        "model.path=/m",
        "tokenizer=from_model",
        "debug=fast",
    ]
    # a chosen tokenizer is kept; flags pass through
    assert model_args("train", ["-m", "model_path=/m", "tokenizer=stdlib_bpe"]) == [
        "-m",
        "model=pretrained",
        "model.path=/m",
        "tokenizer=stdlib_bpe",
    ]
    assert model_args("bench", ["model_path=/m", "requests=2"]) == [
        "model=pretrained",
        "model.path=/m",
        "requests=2",
    ]
    assert model_args("train", ["model=pretrained", "model.path=/m"]) == [
        "model=pretrained",
        "model.path=/m",
    ]
    with pytest.raises(SystemExit, match="either model_path=<dir> or model=<preset>"):
        model_args("train", ["model_path=/m", "model=tiny"])


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
@pytest.mark.parametrize("key", ["model.path", "model", "+model.path", "model_dir"])
def test_a_wrong_model_key_names_model_path(command, key):
    with pytest.raises(SystemExit, match="model_path=/ckpt"):
        model_args(command, [f"{key}=/ckpt"])
    assert model_args(command, ["model_path=/ckpt", "model_name=x"]) == [
        "model_path=/ckpt",
        "model_name=x",
    ]


@pytest.mark.parametrize("command", ["train", "bench"])
def test_another_tools_key_names_model_path(command):
    with pytest.raises(SystemExit, match="model_path=/ckpt"):
        model_args(command, ["model_dir=/ckpt"])


@pytest.mark.slow  # `--cfg job` composes without training (a few seconds)
def test_train_cli_takes_model_path(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "astrai.train", f"model_path={tmp_path}", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "_target_: astrai.model.pretrained_model" in p.stdout
    assert f"path: {tmp_path}" in p.stdout and "path: ${model.path}" in p.stdout


@pytest.mark.slow  # subprocesses importing hydra and torch
@pytest.mark.parametrize(
    ("command", "args"),
    [("eval", ["model.path={d}"]), ("bench", ["engine", "model_dir={d}"])],
)
def test_wrong_key_through_the_cli(command, args, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", f"astrai.{command}", *(a.format(d=tmp_path) for a in args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and f"model_path={tmp_path}" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.slow  # subprocesses importing hydra (and torch, for generate)
@pytest.mark.parametrize(
    ("command", "args", "meant"),
    [
        ("train", ["lr=1e-3", "trainer.max_step=3"], ["lr: ", "optim.lr", "trainer.max_steps"]),
        ("serve", ["prot=8001"], ["prot: ", "port"]),
        ("generate", ["input=i", "output=o", "max_token=3"], ["max_token: ", "max_tokens"]),
    ],
)
def test_unknown_keys_are_named_with_the_key_meant(command, args, meant, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", f"astrai.{command}", *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    for text in meant:  # every unknown key at once, each with the key it may mean
        assert text in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "not in struct" not in p.stderr
    assert not (tmp_path / "run").exists()  # nothing ran


# ------------------------------------------------------------------------- experiment spelling
def test_the_plus_form_fills_the_experiment_slot():
    """`+experiment=NAME` (and `++`, and the other slots of train.yaml) is read as the slot's
    override; other plus keys and flags are left to Hydra."""
    from astrai.cli_keys import normalise_experiment

    args = ["-m", "+experiment=tiny_sft,tiny_dpo", "++debug=fast", "+hardware=cpu_smoke"]
    assert normalise_experiment(args) == [
        "-m",
        "experiment=tiny_sft,tiny_dpo",
        "debug=fast",
        "hardware=cpu_smoke",
    ]
    kept = ["+model.vocab_size=512", "experiment=tiny_sft", "--cfg", "job", "+eval@x=y"]
    assert normalise_experiment(kept) == kept


def test_every_command_line_goes_through_one_function():
    """The entry points call `command_line` (the one place a command line is normalised),
    not the pieces it is made of."""
    entry_points = [
        "astrai/train/__main__.py",
        "astrai/serve/__main__.py",
        "astrai/generate.py",
        "astrai/eval/__main__.py",
        "astrai/data/prepare.py",
        "astrai/bench/__main__.py",
    ]
    for path in entry_points:
        text = (ROOT / path).read_text()
        assert "command_line(" in text, path
        assert "model_args(" not in text and "check_overrides(" not in text, path


def test_prepare_names_the_tokenizer_key():
    """`tokenizer=DIR` on prepare (the training group's name) names `tokenizer_path`, as a
    wrong model key does on serve, and a misspelt key gets the keys it may mean."""
    from astrai.cli_keys import command_line

    with pytest.raises(
        SystemExit, match=r"prepare: unknown key 'tokenizer'; did you mean tokenizer_path=/tok\?"
    ):
        command_line("prepare", ["kind=sft", "tokenizer=/tok"])
    with pytest.raises(
        SystemExit, match=r"tokenizer_pth: not a key of prepare; did you mean tokenizer_path"
    ):
        command_line("prepare", ["tokenizer_pth=/tok"])
    assert command_line("prepare", ["kind=sft", "tokenizer_path=/tok"]) == [
        "kind=sft",
        "tokenizer_path=/tok",
    ]
