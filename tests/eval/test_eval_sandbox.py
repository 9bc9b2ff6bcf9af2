"""The sandbox contains what a generated program does: an infinite loop, an unbounded
allocation and a read of an environment secret all end as failures, and the caller
carries on."""

import os

import pytest

from astrai.eval.sandbox import run_program, run_programs, sandbox_env

SECRET = "ASTRAI_TEST_FAKE_SECRET"

LOOP = "while True:\n    pass\n"
ALLOCATE = "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n"
READ_SECRET = f"import os\nprint('secret:', os.environ[{SECRET!r}])\n"
OK = "print(sum(range(10)))\n"


def test_bad_programs_fail_and_the_run_survives(monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    assert os.environ[SECRET] == "hunter2"  # the secret is in this process's environment
    results = run_programs([LOOP, ALLOCATE, READ_SECRET, OK], workers=4, timeout=3.0, memory_mb=256)
    loop, allocate, secret, ok = results
    assert loop.status == "timeout" and not loop.passed
    assert allocate.status == "memory" and "MemoryError" in allocate.stderr
    assert secret.status == "failed" and "KeyError" in secret.stderr
    assert "hunter2" not in secret.stdout + secret.stderr
    assert ok.passed and ok.stdout.strip() == "45"


def test_the_environment_is_built_from_nothing(monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    result = run_program("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\n")
    names, cwd = result.stdout.strip().splitlines()
    assert eval(names) == sorted(sandbox_env("/x"))
    assert os.path.basename(cwd).startswith("astrai-sandbox-")
    assert not os.path.exists(cwd)  # the fresh directory is gone afterwards


def test_output_is_truncated_and_exit_codes_count():
    result = run_program("print('x' * 100000)\nraise SystemExit(3)\n", max_output=100)
    assert result.status == "failed" and result.returncode == 3
    assert result.stdout.startswith("x" * 100) and len(result.stdout) < 200
    assert "[truncated]" in result.stdout


def test_background_children_are_killed_with_the_program(tmp_path):
    marker = tmp_path / "marker"
    child = f"import time, pathlib\ntime.sleep(2)\npathlib.Path({str(marker)!r}).write_text('x')\n"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\n"
    result = run_program(code, timeout=5.0)
    assert result.passed
    import time

    time.sleep(3)  # past the child's sleep: had it survived, it would have written
    assert not marker.exists()


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        run_program(OK, timeout=0)
