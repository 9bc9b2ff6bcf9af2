"""`astrai.train.receipt`: what a ledger run's receipt.json commits to, checked against
independent computations (hashlib over the documented Merkle construction, the ledger's own
values, the checkpoints' tensors)."""

from __future__ import annotations

import hashlib
import json

import h5py
import pytest
import torch
import yaml
from receipt_helpers import receipt_run

from astrai.train.receipt import config_digest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(reference_run):
    return receipt_run(reference_run)


def _b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def _mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 section 2.1, written from the RFC with BLAKE2b-256 (leaf hashes given)."""
    n = len(leaves)
    if n == 1:
        return leaves[0]
    k = 1 << ((n - 1).bit_length() - 1)  # the largest power of two smaller than n
    return _b(b"\x01" + _mth(leaves[:k]) + _mth(leaves[k:]))


def test_the_receipt_commits_to_the_run(run):
    receipt = json.loads((run / "receipt.json").read_text())
    ledger = receipt["ledger"]
    assert (ledger["steps"], ledger["first_step"], ledger["last_step"]) == (4, 1, 4)
    leaves = [bytes.fromhex(h) for h in ledger["leaves"]]
    assert _mth(leaves).hex() == ledger["merkle_root"]
    with h5py.File(run / "ledger.h5") as f:
        assert ledger["start_digest"] == f.attrs["start_digest"]
        assert ledger["final_weights_digest"] == f["steps/weights_digest"][-1].decode()
        assert json.loads(f.attrs["data_fingerprint_json"]) == receipt["data"]
    # the checkpoints: step 2, step 4 and last; each tensor's digest from its bytes
    names = set(receipt["weights"])
    assert {"checkpoints/step000002.ckpt", "checkpoints/last.ckpt"} <= names
    assert any(n.startswith("export/") and n.endswith(".safetensors") for n in names)
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    name, t = next(iter(state["state_dict"].items()))
    raw = (
        f"{t.dtype}:{tuple(t.shape)};".encode() + t.contiguous().view(torch.uint8).numpy().tobytes()
    )
    claimed = receipt["weights"]["checkpoints/last.ckpt"]["tensors"][f"state_dict.{name}"]
    assert claimed == hashlib.blake2b(raw, digest_size=32).hexdigest()
    # the final evaluation with its settings and seed
    (claim,) = receipt["evals"]
    assert claim["suite"] == "arithmetic" and claim["step"] == 4 and claim["seed"] == 0
    assert set(claim["metrics"]) >= {"exact_match", "format"}
    assert claim["settings"]["num_prompts"] == 4 and claim["count"] == 4
    assert len(receipt["code"]["digest"]) == 64 and receipt["code"]["torch"] == torch.__version__


def test_the_config_digest_survives_reserialization(run, tmp_path):
    original = run / ".hydra" / "config.yaml"
    again = tmp_path / "config.yaml"
    data = yaml.safe_load(original.read_text())
    again.write_text(yaml.safe_dump(data, sort_keys=False, indent=4, width=40))
    assert again.read_text() != original.read_text()
    assert config_digest(again) == config_digest(original)
    data["optim"]["lr"] = float(data["optim"]["lr"]) * 2
    again.write_text(yaml.safe_dump(data))
    assert config_digest(again) != config_digest(original)
