"""`python -m astrai.train.bisect`: the first step at which a probe's condition holds, in a
run whose reward flips at a known step, with at most ceil(log2(steps)) + 2 probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _probes import weight_norm
from bisect_helpers import ENV, FLIP, STEPS, planted_run, sparse_copy
from train_helpers import REPO

from astrai.train.bisect import bisect, max_probes, parse_args
from astrai.train.probe import ProbeError
from astrai.train.rebuild import Rebuilder
from astrai.train.replay import ReplayError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def planted(reference_run):
    return planted_run(reference_run)


def test_bisect_finds_the_planted_step(planted, tmp_path):
    """Before FLIP every reward is 0 (no update at all); from FLIP the weights move. The
    copy keeps one checkpoint (step 4) and the last: the other states are rebuilt."""
    run = sparse_copy(planted, tmp_path / "run", keep=("step000004.ckpt", "last.ckpt"))
    with Rebuilder(run) as rebuilder:
        start = weight_norm(rebuilder.at(0), None)["norm"]
    out = tmp_path / "bisect.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.train.bisect",
            str(run),
            "probe=_probes.weight_norm",
            f"when=norm != {start!r}",
            f"out={out}",
        ],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline", **ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["found"] == FLIP
    assert len(result["probes"]) <= max_probes(STEPS) == 5
    assert f"first step where norm != {start:g}: {FLIP}" in proc.stdout
    probed = {p["step"]: p["holds"] for p in result["probes"]}
    assert all(holds == (step >= FLIP) for step, holds in probed.items())


def test_bisect_reports_never_and_from_the_start(planted):
    with Rebuilder(planted) as rebuilder:
        start = weight_norm(rebuilder.at(0), None)["norm"]
    never = bisect(planted, weight_norm, f"norm < {start / 2!r}")
    assert never.verdict == "never" and never.found is None and len(never.probes) == 1
    always = bisect(planted, weight_norm, "norm > 0")
    assert always.verdict == "from the start" and always.found is None


def test_bisect_refuses_bad_input(planted, tmp_path):
    with pytest.raises(ProbeError, match="metric op number"):
        bisect(planted, weight_norm, "norm is large")
    with pytest.raises(
        ProbeError, match=r"'exact_match' is not among the probe's metrics \(norm\)"
    ):
        bisect(planted, weight_norm, "exact_match < 0.5")
    with pytest.raises(ReplayError, match="step 12 is not in the ledger"):
        bisect(planted, weight_norm, "norm > 0", hi=12)
    with pytest.raises(ProbeError, match="probe=nonsense"):
        bisect(planted, "nonsense", "norm > 0")
    with pytest.raises(SystemExit, match="unknown option step"):
        parse_args([str(planted), "probe=eval=[arithmetic]", "when=x < 1", "step=3"])
