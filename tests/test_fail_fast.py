"""Config errors of `serve`, `generate` and `eval` come before torch, Lightning, the web app
or the model code are imported: one line naming the key, no traceback.

Each command runs with `python -X importtime`, which lists every module the process
imported; since it exits at the error, a heavy module in that list was imported before it.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "fastapi", "uvicorn", "astrai.model.hub", "astrai.inference.engine")


def run(*args: str) -> tuple[subprocess.CompletedProcess, list[str], set[str]]:
    """(process, its output lines other than importtime's, the modules it imported)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (p.stdout + p.stderr).splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    said = [line for line in lines if line.strip() and not line.startswith("import time:")]
    return p, said, modules


def assert_one_clean_line(said: list[str], modules: set[str], *expected: str) -> None:
    assert len(said) == 1, said
    assert all(text in said[0] for text in expected), said
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or m in HEAVY)
    assert not heavy, f"imported before the error: {heavy[:10]}"


@pytest.fixture
def not_a_model(tmp_path) -> Path:
    folder = tmp_path / "conf_like"  # exists, holds no model
    folder.mkdir()
    (folder / "serve.yaml").write_text("port: 8000\n")
    return folder


@pytest.fixture
def model_files(tmp_path) -> Path:
    """A model directory's file names, empty: loading it would fail, checking it passes."""
    folder = tmp_path / "export"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("")
    return folder


@pytest.mark.parametrize(
    "command", [["astrai.serve"], ["astrai.generate", "input=i", "output=o"], ["astrai.eval"]]
)
def test_a_folder_that_is_not_a_model_is_one_line(command, not_a_model):
    p, said, modules = run(*command, f"model_path={not_a_model}")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert_one_clean_line(
        said, modules, f"model_path={not_a_model}: not a model directory: no config.json"
    )


def test_a_missing_folder_is_one_line(tmp_path):
    p, said, modules = run("astrai.serve", f"model_path={tmp_path / 'nope'}")
    assert p.returncode != 0
    assert_one_clean_line(said, modules, "model directory not found", "make train")


def test_a_busy_port_fails_before_anything_heavy(model_files):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        p, said, modules = run("astrai.serve", f"model_path={model_files}", f"port={port}")
    assert p.returncode != 0
    assert_one_clean_line(said, modules, f"port={port}", "in use")


@pytest.mark.parametrize(
    "args,expected",
    [
        (["astrai.serve", "max_tokens_policy=truncate"], "max_tokens_policy must be one of"),
        (["astrai.serve", "tool_call_format=oops"], "tool_call_format: "),
        (["astrai.generate", "input=/nope.jsonl", "output=o"], "input=/nope.jsonl: file not"),
        (
            ["astrai.generate", "input=pyproject.toml", "output=o", "max_tokens_policy=x"],
            "max_tokens_policy must be one of",
        ),
        (
            ["astrai.generate", "input=pyproject.toml", "output=o", "top_p=1.5"],
            "top_p must be in (0, 1], got 1.5",
        ),
        (["astrai.eval", "eval=[generation]", "suites.generation.path=/nope.jsonl"], "/nope"),
    ],
)
def test_settings_errors_come_before_anything_heavy(args, expected, model_files):
    p, said, modules = run(*args, f"model_path={model_files}")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert_one_clean_line(said, modules, expected)


def test_packages_import_their_names_on_first_use():
    code = (
        "import sys\n"
        "import astrai.eval, astrai.inference, astrai.model, astrai.serve\n"
        "import astrai.model.directory, astrai.inference.params\n"
        "assert 'torch' not in sys.modules, 'torch imported by a package'\n"
        "from astrai.serve import Server, ServeSettings, create_app\n"
        "from astrai.model import AutoModel\n"
        "from astrai.eval import PerplexitySuite\n"
        "import astrai.inference as inference\n"
        "assert inference.InferenceEngine.__name__ == 'InferenceEngine'\n"
        "assert callable(create_app) and Server and ServeSettings and AutoModel\n"
        "assert 'torch' in sys.modules\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def test_an_unknown_name_is_still_an_attribute_error():
    import astrai.serve

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        astrai.serve.nope  # noqa: B018
