"""The two-command set-up: `make setup` is idempotent and CI runs the README's test command."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_setup_is_up_to_date_after_install():
    # `make -q` exits 0 only when the target needs no work: a second `make setup`
    # on an installed tree must not reinstall anything.
    if not (ROOT / ".venv" / ".astrai-installed").exists():
        pytest.skip("suite not run through `make test` (no .venv stamp)")
    result = subprocess.run(["make", "-q", "setup"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make train" in readme
    assert "make test" in ci


def test_makefile_installs_torch_first_then_the_package():
    makefile = (ROOT / "Makefile").read_text()
    torch_line = makefile.index('install --quiet "$(TORCH_SPEC)"')
    package_line = makefile.index('install --quiet -e ".[dev]"')
    assert torch_line < package_line
    assert "TORCH_SPEC ?= torch==2.13.0" in makefile


def test_version_comes_from_pyproject():
    import tomllib

    import astrai

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert astrai.__version__ == project["version"]
