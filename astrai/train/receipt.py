"""Run receipts: what a ``ledger=true`` run claims, in one file a reader can check.

``<run dir>/receipt.json`` (written at the end of training, after the export; also when the
run stops on an interruption, holding the steps it finished) commits to:
- ``config``: the BLAKE2b-256 of the run's composed config (``.hydra/config.yaml`` loaded
  unresolved and written as sorted, compact JSON, so re-serializing the YAML changes nothing);
- ``code``: the digest of the astrai package's files (sorted relative paths and bytes) and,
  for information, the versions of python, torch, lightning, transformers and the git commit;
- ``data``: the ledger's data fingerprint (every file the data splits read);
- ``ledger``: a Merkle root over one leaf per optimizer step (its whole ledger row in a
  canonical encoding, with the rollouts sampled for it), and the leaves themselves;
- ``checkpoints`` and ``export``: per file a digest of its bytes and a digest per tensor
  (a checkpoint's every tensor, model and optimizer state; a safetensors file's tensors);
- ``evals``: the final evaluation results, each suite's settings (seeds included) and the
  step and weights digest they were computed on.

The Merkle tree is RFC 6962's (Certificate Transparency) with BLAKE2b-256: a leaf hashes
``0x00 || data``, a node ``0x01 || left || right``; a tree of n > 1 leaves splits at the
largest power of two below n; the empty tree's root is the hash of nothing.
`python -m astrai.verify receipt.json` checks all of it (`astrai.verify`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from astrai.train.ledger_store import LedgerFile

log = logging.getLogger(__name__)

__all__ = [
    "RECEIPT_VERSION",
    "code_digest",
    "config_digest",
    "file_digest",
    "leaf_hash",
    "ledger_leaves",
    "merkle_root",
    "tensor_digests",
    "write_after_fit",
    "write_receipt",
]

RECEIPT_VERSION = 1
PACKAGE = Path(__file__).resolve().parents[1]


def _h(data: bytes = b"") -> Any:
    return hashlib.blake2b(data, digest_size=32)


# ---------------------------------------------------------------------- Merkle tree
def leaf_hash(data: bytes) -> bytes:
    return _h(b"\x00" + data).digest()


def merkle_root(leaves: list[bytes]) -> bytes:
    """RFC 6962's Merkle tree hash from the leaf hashes (`leaf_hash` of each leaf's data)."""
    if not leaves:
        return _h().digest()
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return _h(b"\x01" + merkle_root(leaves[:k]) + merkle_root(leaves[k:])).digest()


def _plain(value: Any) -> Any:
    """A ledger value as exact JSON: floats by their hex form."""
    if isinstance(value, (float, np.floating)):
        return "f:" + float(value).hex()
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    return value


def canonical(value: Any) -> bytes:
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":")).encode()


def ledger_leaves(ledger: LedgerFile) -> dict[int, bytes]:
    """Each step's leaf data: its row and the rollouts sampled for it (sampled after step
    K - 1: GRPO's generation batch of step K), canonically encoded."""
    steps = ledger.steps
    rollouts: dict[int, list[Any]] = {s: [] for s in steps}
    last = max(steps) if steps else 0
    for seed, at in ledger.rollout_index():
        rollouts.setdefault(min(at + 1, last), []).append(dict(ledger.rollout(seed)))
    return {s: canonical({"row": dict(ledger.step(s)), "rollouts": rollouts[s]}) for s in steps}


# ---------------------------------------------------------------------- digests
def config_digest(path: str | Path | Any) -> str:
    """The composed config's digest: loaded unresolved (a file, or the config itself without
    Hydra's own node), written as sorted compact JSON."""
    if isinstance(path, (str, Path)):
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    else:
        data = OmegaConf.to_container(path, resolve=False)
        data.pop("hydra", None)
    return _h(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_digest(root: Path = PACKAGE) -> tuple[str, int]:
    """The digest of the package's files (sorted relative paths and bytes; caches left out)
    and their count."""
    h = _h()
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\x00")
        h.update(p.read_bytes())
    return h.hexdigest(), len(files)


def file_digest(path: str | Path) -> str:
    h = _h()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensors(value: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}.{i}")


def tensor_digests(path: str | Path) -> dict[str, str]:
    """A digest per tensor of a checkpoint (every tensor in it, by its path of keys) or of a
    safetensors file; {} for other files. An unreadable file raises."""
    import torch

    path = Path(path)
    out = {}
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            named = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118 (not a dict)
    elif path.suffix == ".ckpt":
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        named = list(_tensors(state, ""))
    else:
        return {}
    for name, t in named:
        t = t.detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[name] = _h(f"{t.dtype}:{tuple(t.shape)};".encode() + data).hexdigest()
    return out


def weight_files(run: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {file, tensors}}`` of the run's checkpoints and export files."""
    out = {}
    files = sorted((run / "checkpoints").glob("*.ckpt"))
    export = run / "export"
    if export.is_dir():
        files += sorted(p for p in export.rglob("*") if p.is_file())
    for p in files:
        out[p.relative_to(run).as_posix()] = {
            "file": file_digest(p),
            "tensors": tensor_digests(p),
        }
    return out


# ---------------------------------------------------------------------- the receipt
def _versions() -> dict[str, Any]:
    import lightning
    import torch
    import transformers

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=PACKAGE,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "git_commit": commit,
    }


def eval_claims(cfg: Any, history: list[Mapping[str, Any]], last_step: int) -> list[dict]:
    """The final evaluation (the evaluation callback's last, at the run's last step) per
    suite: metrics, settings (seeds included) and the step."""
    if not history or int(history[-1]["step"]) != last_step:
        return []
    final = history[-1]
    nodes = OmegaConf.select(cfg, "callbacks.eval.suites", default=None) or {}
    claims = []
    for name in nodes:
        prefix = f"eval/{name}/"
        metrics = {
            k.removeprefix(prefix): float(v)
            for k, v in final.items()
            if k.startswith(prefix) and not k.endswith(("/count", "/seconds"))
        }
        settings = OmegaConf.to_container(nodes[name], resolve=True)
        claims.append(
            {
                "suite": str(name),
                "metrics": metrics,
                "count": int(final.get(f"{prefix}count", 0)),
                "seed": settings.get("seed", 0),  # the suites' default
                "settings": settings,
                "step": last_step,
            }
        )
    return claims


def write_receipt(run: str | Path, cfg: Any, history: list[Mapping[str, Any]]) -> Path:
    """Write ``<run>/receipt.json`` for a run with a ledger (rank 0, after the export)."""
    run = Path(run)
    with LedgerFile(run / "ledger.h5") as ledger:
        meta = ledger.meta
        leaves = ledger_leaves(ledger)
        steps = sorted(leaves)
        final = ledger.step(steps[-1])["weights_digest"] if steps else meta.get("start_digest")
    hashes = [leaf_hash(leaves[s]) for s in steps]
    saved = run / ".hydra" / "config.yaml"
    code, count = code_digest()
    receipt = {
        "receipt_version": RECEIPT_VERSION,
        "run": run.name,
        "config": {
            # a run launched without Hydra's run folder (the Python API) has no config file
            "file": ".hydra/config.yaml" if saved.is_file() else None,
            "digest": config_digest(saved if saved.is_file() else cfg),
            "overrides": list(OmegaConf.load(run / ".hydra" / "overrides.yaml"))
            if (run / ".hydra" / "overrides.yaml").is_file()
            else [],
        },
        "code": {"digest": code, "files": count, **_versions()},
        "data": meta.get("data_fingerprint"),
        "ledger": {
            "file": "ledger.h5",
            "steps": len(steps),
            "first_step": steps[0] if steps else None,
            "last_step": steps[-1] if steps else None,
            "start_digest": meta.get("start_digest"),
            "final_weights_digest": final,
            "merkle_root": merkle_root(hashes).hex(),
            "leaves": [h.hex() for h in hashes],
        },
        "weights": weight_files(run),
        "evals": eval_claims(cfg, history, steps[-1] if steps else 0),
    }
    path = run / "receipt.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(receipt, indent=1) + "\n")
    tmp.replace(path)
    log.info(
        "receipt: %s (%d steps, Merkle root %s)",
        path,
        len(steps),
        receipt["ledger"]["merkle_root"][:16],
    )
    return path


def write_after_fit(cfg: Any, trainer: Any, callbacks: list[Any], run: str | Path) -> None:
    """The runner's hook after a fit (or an interruption): rank 0 of a ``ledger=true`` run
    writes the receipt, with the evaluation callback's final results."""
    from astrai.train.evaluation import EvalCallback

    run = Path(run)
    if not cfg.get("ledger") or not trainer.is_global_zero or not (run / "ledger.h5").is_file():
        return
    history: list[Mapping[str, Any]] = []
    for cb in callbacks:
        if isinstance(cb, EvalCallback):
            history = cb.history
    write_receipt(run, cfg, history)
