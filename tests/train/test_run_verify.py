"""`python -m astrai.verify receipt.json`: an untouched run verifies; one changed ledger row,
one flipped checkpoint byte or one altered claimed score fails, naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import h5py
import pytest
from receipt_helpers import receipt_run
from train_helpers import REPO

from astrai.verify import verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(reference_run):
    return receipt_run(reference_run)


def failing(rows):
    return [(r.check, r.subject, r.detail) for r in rows if not r.ok]


def test_an_untouched_run_verifies(run, tmp_path):
    out = tmp_path / "verify.json"
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.verify", str(run / "receipt.json"), "spot=2", f"out={out}"],
        cwd=REPO,
        env={**os.environ, "WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    checks = {r["check"] for r in rows}
    assert {"receipt", "config", "code", "data", "ledger", "weights", "replay", "eval"} <= checks
    assert all(r["ok"] for r in rows)
    assert sum(r["check"] == "replay" for r in rows) == 2
    assert "DIFFERS" not in proc.stdout


def test_tampering_is_named(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # one ledger row: step 3's loss
    with h5py.File(copy / "ledger.h5", "a") as f:
        i = list(f["steps/step"][:]).index(3)
        f["steps/loss"][i] += 1e-3
    # one byte inside a tensor's storage in the step-2 checkpoint (a zip: rewrite one member)
    ckpt = copy / "checkpoints" / "step000002.ckpt"
    with zipfile.ZipFile(ckpt) as z:
        members = {n: z.read(n) for n in z.namelist()}
    storage = max((n for n in members if "/data/" in n), key=lambda n: len(members[n]))
    data = bytearray(members[storage])
    data[len(data) // 2] ^= 0xFF
    members[storage] = bytes(data)
    with zipfile.ZipFile(ckpt, "w", zipfile.ZIP_STORED) as z:
        for n, b in members.items():
            z.writestr(n, b)
    # one claimed score
    receipt = json.loads((copy / "receipt.json").read_text())
    claim = receipt["evals"][0]
    claim["metrics"]["format"] = claim["metrics"]["format"] + 0.25
    (copy / "receipt.json").write_text(json.dumps(receipt))

    bad = failing(verify(copy / "receipt.json", spot=0))
    subjects = {(c, s) for c, s, _ in bad}
    assert ("ledger", "step 3") in subjects
    assert ("eval", "arithmetic/format") in subjects
    weights = [d for c, s, d in bad if (c, s) == ("weights", "checkpoints/step000002.ckpt")]
    assert weights and "tensor state_dict." in weights[0], bad
    assert len(bad) == 3, bad  # nothing else: the config, code, data and other files agree
