"""`python -m astrai.train debug=fast` as a new user sees it (#17): each log line once, no
logger advertisement, no warning a user cannot act on, no `Epoch 0/-2`, one line saying how
many torch threads run; `log_level=debug` shows what was filtered; the run's plot is titled
with the run's name even through `outputs/latest`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from train_helpers import REPO, SMALL, TINY_MODEL, cli, run_dirs

pytestmark = pytest.mark.slow

#: text of the warnings this run used to print (each matched by a QUIET_WARNINGS pattern)
FILTERED = ("was called without a model", "there is no last checkpoint available")
#: a log record as Hydra's handler prints it: "[date time][logger][LEVEL] - message"
RECORD = re.compile(r"^\[[\d\- :,]+\]\[[\w.]+\]\[[A-Z]+\] - (.*)$")


def _train(tmp: Path, data_dir: Path, *extra: str) -> str:
    proc = cli(["debug=fast", *SMALL, *TINY_MODEL, *run_dirs(tmp, data_dir), *extra])
    return proc.stdout + proc.stderr


def test_default_output_is_quiet(tmp_path: Path, data_dir: Path) -> None:
    out = _train(tmp_path, data_dir)
    records = [m.group(1) for line in out.splitlines() if (m := RECORD.match(line))]
    assert any("Seed set to 1234" in r for r in records), out[-3000:]
    # each line once: Lightning's own stderr handler ("INFO: ...") is gone
    twice = [r for r, n in Counter(records).items() if n > 1]
    assert not twice, twice
    assert not [line for line in out.splitlines() if line.startswith("INFO: ")]
    assert "litlogger" not in out and "Tip:" not in out
    for text in FILTERED:
        assert text not in out
    assert "Warning" not in out and "deprecated" not in out, out[-3000:]
    assert "Epoch 0/-2" not in out
    assert sum("torch threads:" in r for r in records) == 1

    # the run's plot is titled with the run's name, also through the `latest` link
    latest = tmp_path / "outputs" / "latest"
    assert latest.is_symlink()
    plot = subprocess.run(
        [sys.executable, "-m", "astrai.train.plot", str(latest), "--out", str(tmp_path / "c.png")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 0, plot.stderr[-2000:]
    assert json.loads(plot.stdout)["title"] == "tiny_pretrain run"  # experiment, run folder
    assert (tmp_path / "c.png").stat().st_size > 0


def test_log_level_debug_shows_everything(tmp_path: Path, data_dir: Path) -> None:
    out = _train(tmp_path, data_dir, "log_level=debug")
    for text in FILTERED:
        assert text in out, f"{text!r} not shown with log_level=debug"
    assert "litlogger" in out
