"""``python -m astrai.verify RUN/receipt.json [spot=5] [seed=0] [run=DIR] [out=FILE]``.

Checks a run against its receipt (`astrai.train.receipt`) and names whatever differs:
- ``receipt``: the leaves hash to the Merkle root (the receipt is whole);
- ``config``: ``.hydra/config.yaml`` against its digest; ``code``: the installed astrai
  package against the run's (another version is a failing row; the rest still run);
- ``data``: the ledger's data fingerprint against the receipt's;
- ``ledger``: every step's row (and its rollouts) against its leaf: a changed row is named
  by its step;
- ``weights``: every checkpoint and export file against its digests: a changed byte is named
  by file and tensor (or as bytes outside the tensors, or the file as unreadable);
- ``replay``: ``spot`` random steps (seeded by ``seed``) re-run from the run's checkpoints
  (`astrai.train.replay`): a step whose loss, gradient norm, weights or random state differ
  from the ledger is named with what differs;
- ``eval``: every claimed score re-computed on the final weights (rebuilt and checked against
  the ledger) with the same suites, settings and seeds: a score that differs is named.

Nothing is written into the run folder. The exit status is 0 only when every row agrees.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("astrai.verify")

__all__ = ["Row", "main", "verify"]


@dataclass
class Row:
    check: str
    subject: str
    ok: bool
    detail: str = ""


class VerifyError(ValueError):
    """The receipt cannot be read or has no run folder."""


def _receipt_rows(receipt: dict[str, Any]) -> list[Row]:
    from astrai.train.receipt import merkle_root

    leaves = [bytes.fromhex(h) for h in receipt["ledger"]["leaves"]]
    root = merkle_root(leaves).hex()
    ok = root == receipt["ledger"]["merkle_root"]
    return [Row("receipt", "Merkle root", ok, "" if ok else f"the leaves hash to {root[:16]}")]


def _config_rows(receipt: dict[str, Any], run: Path) -> list[Row]:
    from astrai.train.receipt import code_digest, config_digest

    name = receipt["config"]["file"]
    path = run / str(name)
    if name is None:
        rows = [
            Row("config", "config", False, "the run saved no config file (launched without Hydra)")
        ]
    elif not path.is_file():
        rows = [Row("config", str(path), False, "missing")]
    else:
        ok = config_digest(path) == receipt["config"]["digest"]
        rows = [Row("config", receipt["config"]["file"], ok, "" if ok else "differs")]
    code, _ = code_digest()
    ok = code == receipt["code"]["digest"]
    detail = (
        "" if ok else f"code differs (the run's: astrai at {receipt['code'].get('git_commit')})"
    )
    return [*rows, Row("code", "astrai package", ok, detail)]


def _ledger_rows(receipt: dict[str, Any], run: Path) -> list[Row]:
    from astrai.train.ledger_store import LedgerFile
    from astrai.train.receipt import leaf_hash, ledger_leaves

    path = run / receipt["ledger"]["file"]
    if not path.is_file():
        return [Row("ledger", str(path), False, "missing")]
    with LedgerFile(path) as ledger:
        data = ledger.meta.get("data_fingerprint")
        leaves = ledger_leaves(ledger)
    rows = [
        Row(
            "data",
            "fingerprint",
            data == receipt["data"],
            "" if data == receipt["data"] else "differs",
        )
    ]
    claimed = receipt["ledger"]["leaves"]
    steps = sorted(leaves)
    first = receipt["ledger"]["first_step"] or 0
    if len(steps) != len(claimed):
        rows.append(
            Row("ledger", "steps", False, f"{len(steps)} rows, the receipt has {len(claimed)}")
        )
    bad = [
        s
        for i, s in enumerate(steps)
        if i >= len(claimed) or leaf_hash(leaves[s]).hex() != claimed[i] or s != first + i
    ]
    for s in bad:
        rows.append(Row("ledger", f"step {s}", False, "the row differs from the receipt"))
    if not bad:
        rows.append(Row("ledger", f"{len(steps)} steps", True))
    return rows


def _weights_rows(receipt: dict[str, Any], run: Path) -> list[Row]:
    from astrai.train.receipt import file_digest, tensor_digests

    rows = []
    for name, claimed in receipt["weights"].items():
        path = run / name
        if not path.is_file():
            rows.append(Row("weights", name, False, "missing"))
            continue
        if file_digest(path) == claimed["file"]:
            rows.append(Row("weights", name, True))
            continue
        try:
            tensors = tensor_digests(path)
        except Exception as err:  # a damaged file is what this check looks for
            rows.append(Row("weights", name, False, f"unreadable: {type(err).__name__}: {err}"))
            continue
        differ = [k for k, v in claimed["tensors"].items() if tensors.get(k) != v]
        differ += [k for k in tensors if k not in claimed["tensors"]]
        detail = (
            f"tensor {', '.join(differ[:5])} differs"
            if differ
            else "bytes outside the tensors differ"
        )
        rows.append(Row("weights", name, False, detail))
    return rows


def _replay_rows(run: Path, steps: list[int], spot: int, seed: int) -> list[Row]:
    from astrai.train.replay import ReplayError, replay

    rows = []
    for step in sorted(random.Random(seed).sample(steps, min(spot, len(steps)))):
        try:
            checks = replay(run, step)
        except ReplayError as err:
            rows.append(Row("replay", f"step {step}", False, str(err)))
            continue
        bad = [c for c in checks if not c.ok]
        detail = "; ".join(f"step {c.step}: {', '.join(c.mismatches)} differ" for c in bad)
        rows.append(Row("replay", f"step {step}", not bad, detail))
    return rows


def _eval_rows(receipt: dict[str, Any], run: Path) -> list[Row]:
    from astrai.train.probe import EvalProbe
    from astrai.train.rebuild import Rebuilder

    claims = receipt["evals"]
    if not claims:
        return []
    rows = []
    with Rebuilder(run) as rebuilder:
        module = rebuilder.at(int(claims[0]["step"]))
        cfg = rebuilder.cfg
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        node = OmegaConf.select(cfg, "callbacks.eval.engine", default=None)
        engine = instantiate(node) if node is not None else None
        size = OmegaConf.select(cfg, "callbacks.eval.max_batch_size", default=32)
        suites = {c["suite"]: OmegaConf.create(c["settings"]) for c in claims}
        got = EvalProbe(suites, engine, int(size))(module, rebuilder.tokenizer)
    for claim in claims:
        for metric, value in claim["metrics"].items():
            key = f"{claim['suite']}/{metric}"
            again = got.get(key)
            ok = again is not None and again == value
            detail = "" if ok else f"claimed {value!r}, re-scored {again!r}"
            rows.append(Row("eval", key, ok, detail))
    return rows


def verify(
    receipt_path: str | Path, spot: int = 5, seed: int = 0, run: str | Path | None = None
) -> list[Row]:
    """Every check of the receipt at ``receipt_path`` against ``run`` (its folder)."""
    path = Path(receipt_path)
    try:
        receipt = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VerifyError(f"{path}: not a readable receipt ({err})") from None
    if not isinstance(receipt, dict) or receipt.get("receipt_version") != 1:
        raise VerifyError(f"{path}: not a receipt of version 1")
    run = Path(run) if run is not None else path.parent
    rows = _receipt_rows(receipt) + _config_rows(receipt, run) + _ledger_rows(receipt, run)
    rows += _weights_rows(receipt, run)
    ledger = receipt["ledger"]
    steps = list(range(ledger["first_step"], ledger["last_step"] + 1)) if ledger["steps"] else []
    rows += _replay_rows(run, steps, int(spot), int(seed))
    rows += _eval_rows(receipt, run)
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    table = [("check", "subject", "verdict", "detail")]
    table += [(r.check, r.subject, "agrees" if r.ok else "DIFFERS", r.detail) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    lines = [
        "  ".join([*(f"{v:<{w}}" for v, w in zip(t[:3], widths)), t[3]]).rstrip() for t in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for arg in argv:
        if arg in ("-h", "--help"):
            raise SystemExit(__doc__)
        key, eq, value = arg.removeprefix("--").partition("=")
        if not eq:
            if "receipt" in args:
                raise SystemExit(f"astrai.verify: one receipt, got {args['receipt']} and {arg}")
            args["receipt"] = arg
            continue
        if key not in ("spot", "seed", "run", "out"):
            raise SystemExit(f"astrai.verify: unknown option {key} (spot, seed, run, out)")
        args[key] = value
    if "receipt" not in args:
        raise SystemExit(
            "usage: python -m astrai.verify RUN/receipt.json [spot=5] [seed=0] [out=FILE]"
        )
    for key in ("spot", "seed"):
        if key in args:
            try:
                args[key] = int(args[key])
            except ValueError:
                raise SystemExit(f"astrai.verify: {key}={args[key]} is not a number") from None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from astrai.train.replay import setup_cli

    setup_cli()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = verify(args["receipt"], args.get("spot", 5), args.get("seed", 0), args.get("run"))
    except VerifyError as err:
        raise SystemExit(f"astrai.verify: {err}") from None
    print(format_rows(rows))
    if "out" in args:
        from astrai.eval.report import write_json

        write_json(args["out"], [asdict(r) for r in rows])
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
