"""`python -m astrai.eval`: a smoke run on a tiny model writes the JSON and prints the table;
bad task files stop it, naming file and line, before any model is loaded."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from suite_helpers import write_jsonl

from astrai.eval.__main__ import CONF_DIR, run

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "Question: What is 2 + 3?\nAnswer: 5\n" * 20]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, build_model_dir):
    return build_model_dir(tmp_path_factory.mktemp("model"), TEXTS)


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("eval", list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def test_default_config_composes_every_suite():
    cfg = config()
    assert set(cfg["suites"]) == {"perplexity", "multiple_choice", "arithmetic", "code"}
    assert cfg["suites"]["arithmetic"]["task_options"] == cfg["arithmetic"]
    picked = config("eval=[stdlib,code]", "suites.code.k=[1,2]", "suites.code.num_samples=2")
    assert set(picked["suites"]) == {"stdlib", "code"} and picked["suites"]["code"]["k"] == [1, 2]


def test_cli_smoke_run_writes_json(model_dir, tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.eval",
            f"model_path={model_dir}",
            f"out={out}",
            "eval=[perplexity,multiple_choice,arithmetic,code]",
            "suites.perplexity.limit=2",
            "suites.arithmetic.num_prompts=3",
            "suites.arithmetic.max_tokens=8",
            "suites.code.max_tokens=8",
            "suites.code.limit=2",
            "engine.max_batch_size=4",
            "device=cpu",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    suites = data["suites"]
    assert set(suites) == {"perplexity", "multiple_choice", "arithmetic", "code"}
    assert {"nll", "ppl", "bpb", "doc_ppl_p50"} <= set(suites["perplexity"]["metrics"])
    assert {"acc", "acc_norm"} <= set(suites["multiple_choice"]["metrics"])
    assert len(suites["arithmetic"]["samples"]) == 3
    assert "pass@1" in suites["code"]["metrics"] and len(suites["code"]["samples"]) == 2
    assert data["model_path"] == str(model_dir)
    table = proc.stdout
    assert re.search(r"multiple_choice\s+acc_norm\s+\d", table)
    assert re.search(r"perplexity\s+bpb\s+\d", table)


@pytest.mark.parametrize(
    "suite,rows,message",
    [
        (
            "multiple_choice",
            [{"question": "q", "choices": ["a", "b"], "answer": 0}, "{broken"],
            r":2: not valid JSON",
        ),
        (
            "multiple_choice",
            [
                {"question": "q", "choices": ["a", "b"], "answer": 0},
                {"question": "q", "choices": ["a"], "answer": 0},
            ],
            r":2: field 'choices' needs at least 2 entries",
        ),
        (
            "generation",
            [{"prompt": "hi"}, {"prompt": ""}],
            r":2: field 'prompt' must be a non-empty",
        ),
        (
            "code",
            [{"prompt": "def f():\n", "test": "", "entry_point": "f"}],
            r":1: field 'test' must be a non-empty",
        ),
    ],
)
def test_bad_task_files_fail_before_the_model_loads(tmp_path, suite, rows, message):
    path = write_jsonl(tmp_path / "tasks.jsonl", rows)
    empty = tmp_path / "no_model_here"  # a model's file names, empty: a load would fail
    empty.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (empty / name).write_text("")
    cfg = config(f"eval=[{suite}]", f"suites.{suite}.path={path}", f"model_path={empty}")
    with pytest.raises(SystemExit, match=f"suites.{suite}: " + re.escape(str(path)) + message):
        run(cfg)


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(SystemExit, match="model directory not found"):
        run(config(f"model_path={tmp_path / 'nope'}"))


def test_module_help_exits_cleanly():
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.eval", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "suites" in proc.stdout
    assert Path(CONF_DIR, "eval.yaml").is_file()
