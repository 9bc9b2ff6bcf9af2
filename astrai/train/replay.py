"""``python -m astrai.train.replay RUN step=K [--until K2] [out=replay.json]``.

Re-runs optimizer step K of a run trained with ``ledger=true`` and checks it against the
step ledger: the loss (each micro-batch's), the gradient norm, the weights after the step (a
digest of every parameter's bytes), the random state after it and the batch it consumed.
The run is rebuilt from its own config (``RUN/.hydra/config.yaml``) and resumed from its
newest checkpoint before step K (``step<N>.ckpt``, ``last.ckpt``, an interruption's, or the
checkpoint the run itself resumed from); with none, from the start, whose weights must match
the ledger's start digest. Every step from there to K (or K2) is re-run and checked; nothing is
written into RUN. GRPO steps take their rollouts from the ledger (token ids, behaviour
log-probs, rewards), so no engine samples. The exit status is 0 when every check agrees.

Before any step runs, the data the run read is compared with the ledger's fingerprint: a
changed file is refused, naming it. Replay runs one process with the run's thread count.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("astrai.train.replay")

__all__ = [
    "ReplayError",
    "StepCheck",
    "check_data",
    "check_start",
    "find_checkpoint",
    "fit_from",
    "main",
    "rebuild_start",
    "replay",
]

#: what each replayed step is checked on
CHECKS = ("micro_loss", "grad_norm", "weights_digest", "rng_digest", "batch_digest", "sample_ids")


class ReplayError(ValueError):
    """The run cannot be replayed as asked (no ledger, no such step, changed data, ...)."""


def load_run_config(run: Path) -> DictConfig:
    """The run's composed config, its output folder pointed at ``run``."""
    from astrai.train.runner import register_resolvers

    path = run / ".hydra" / "config.yaml"
    if not path.is_file():
        raise ReplayError(f"{run}: no .hydra/config.yaml (not a run folder of astrai.train)")
    register_resolvers()
    cfg = OmegaConf.load(path)
    cfg.paths.output_dir = str(run)
    return cfg


def checkpoint_steps(paths: Sequence[Path]) -> dict[Path, int]:
    """``{checkpoint: global_step}`` of the complete checkpoints among ``paths``."""
    import torch

    from astrai.train.checkpoint import is_complete

    out = {}
    for path in paths:
        if path.is_file() and is_complete(path):
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            out[path] = int(state.get("global_step", -1))
    return out


def find_checkpoint(run: Path, step: int, resumed_from: str | None) -> tuple[Path | None, int]:
    """The newest checkpoint written before optimizer step ``step`` (its global step <
    ``step``): ``(path, its step)``, or ``(None, 0)`` when there is none."""
    candidates = sorted((run / "checkpoints").glob("*.ckpt"))
    if resumed_from:
        candidates.append(Path(resumed_from))
    found = [(s, p) for p, s in checkpoint_steps(candidates).items() if 0 <= s < step]
    if not found:
        return None, 0
    s, p = max(found, key=lambda sp: (sp[0], sp[1].stat().st_mtime))
    return p, s


class StepCheck:
    """One replayed step against its ledger row."""

    def __init__(self, step: int, recorded: Mapping[str, Any], replayed: Mapping[str, Any]):
        self.step = step
        self.recorded = dict(recorded)
        self.replayed = dict(replayed)
        self.mismatches = [
            key
            for key in CHECKS
            if not (key == "weights_digest" and not recorded[key])  # thinned digests
            and recorded[key] != replayed[key]
        ]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        keys = ("loss", "grad_norm", "weights_digest", "rng_digest", "batch_digest")
        return {
            "step": self.step,
            "ok": self.ok,
            "mismatches": self.mismatches,
            "recorded": {k: self.recorded[k] for k in (*keys, "micro_loss")},
            "replayed": {k: self.replayed[k] for k in (*keys, "micro_loss")},
        }


def replay_callback(ledger: Any, until: int, checks: list[StepCheck], checked: bool = True) -> Any:
    """A `StepLedger` that compares each step with the ledger instead of writing it, and
    stops the fit after step ``until``. ``checked=False``: a counterfactual step (its batch
    altered on purpose), run on the ledger's rollouts and not compared."""
    from astrai.train.ledger import StepLedger

    class ReplayCheck(StepLedger):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from astrai.train.ledger import sample_positions
            from astrai.train.strategies.grpo.replay_source import ReplaySource
            from astrai.train.strategies.grpo.source import RolloutModule

            self.recording = True  # (self.file stays None: rows are compared, not written)
            self.recorded_step = int(trainer.global_step)
            self.position = sample_positions(trainer.datamodule)
            if isinstance(pl_module, RolloutModule):  # the ledger's rollouts, no engine
                pl_module.wrap_source(lambda source: ReplaySource(ledger.rollout, source))

        def step_ended(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
            if not checked:
                trainer.should_stop = step >= until
                return
            check = StepCheck(step, ledger.step(step), record)
            checks.append(check)
            log.info("step %d: %s", step, "agrees" if check.ok else f"differs: {check.mismatches}")
            if "batch_digest" in check.mismatches or "sample_ids" in check.mismatches:
                trainer.should_stop = True
            if step >= until:
                trainer.should_stop = True

    return ReplayCheck(path=ledger.path)


def check_data(cfg: DictConfig, datamodule: Any, saved: Any) -> None:
    from astrai.data.datamodule import AstraiDataModule
    from astrai.data.fingerprint import data_changes
    from astrai.data.storage.h5 import DamagedDataError

    if saved is None or not isinstance(datamodule, AstraiDataModule):
        return
    try:
        current = datamodule.data_fingerprint()
    except DamagedDataError as err:  # its bytes no longer match the checksum stored with them
        raise ReplayError(
            f"the data changed since the run wrote its ledger; replay refused:\n{err}"
        ) from None
    changes = data_changes(saved, current)
    if changes:
        lines = [f"data.{split}: {line}" for split, found in changes.items() for line in found]
        raise ReplayError(
            "the data changed since the run wrote its ledger; replay refused:\n" + "\n".join(lines)
        )


def replay(run: str | Path, step: int, until: int | None = None) -> list[StepCheck]:
    """Re-run optimizer steps ``step..until`` of ``run`` (and the steps from the checkpoint
    before ``step`` up to it) and check each against the ledger."""
    from astrai.train.ledger_store import LedgerFile

    run = Path(run)
    until = step if until is None else int(until)
    if step < 1 or until < step:
        raise ReplayError(f"step={step}, until={until}: need 1 <= step <= until")
    cfg = load_run_config(run)
    ledger = LedgerFile(run / "ledger.h5")
    try:
        meta = ledger.meta
        have = set(ledger.steps)
        missing = [k for k in range(step, until + 1) if k not in have]
        if missing:
            span = f"{min(have)}..{max(have)}" if have else "none"
            raise ReplayError(f"{ledger.path}: steps {missing} are not in the ledger ({span})")
        if int(meta.get("world_size", 1)) != 1:
            raise ReplayError(
                f"{ledger.path}: the run had {meta['world_size']} ranks; replay re-runs steps "
                "in one process and needs a one-process run"
            )
        ckpt, ckpt_step = find_checkpoint(run, step, meta.get("resumed_from"))
        start = int(meta.get("start_step", 0))
        if ckpt is None and start != 0:
            raise ReplayError(
                f"{run / 'checkpoints'}: no checkpoint before step {step}, and the ledger starts "
                f"at step {start} (resumed from {meta.get('resumed_from')})"
            )
        missing = [k for k in range(ckpt_step + 1, step) if k not in have]
        if missing:
            raise ReplayError(
                f"{ledger.path}: steps {missing} between the checkpoint (step {ckpt_step}) and "
                f"step {step} are not in the ledger"
            )
        return _run(cfg, ledger, meta, ckpt, ckpt_step, until)
    finally:
        ledger.close()


def rebuild_start(cfg: DictConfig, meta: Mapping[str, Any]) -> tuple[Any, Any]:
    """The run's data module and module as its seed builds them, with the run's thread count,
    the data checked against the ledger's fingerprint first."""
    import torch

    from astrai.train.runner import build_run

    torch.set_num_threads(int(meta.get("threads", torch.get_num_threads())))
    datamodule, module = build_run(cfg)
    check_data(cfg, datamodule, meta.get("data_fingerprint"))
    return datamodule, module


def check_start(module: Any, meta: Mapping[str, Any]) -> None:
    """The rebuilt start weights are the run's (the ledger's start digest)."""
    from astrai.train.ledger import weights_digest

    if weights_digest(module.state_dict().items()) != meta.get("start_digest"):
        raise ReplayError(
            "the rebuilt start weights differ from the run's (strategy.init_from or "
            "model.path now points at other weights?); replay needs a checkpoint before the step"
        )


def fit_from(
    cfg: DictConfig, datamodule: Any, module: Any, ckpt: Path | None, callbacks: list[Any]
) -> None:
    """Train ``module`` from ``ckpt`` (None: its current weights, step 0) with the run's
    trainer settings and only ``callbacks`` (one of them stops the fit), writing nothing."""
    from hydra.utils import instantiate

    with tempfile.TemporaryDirectory(prefix="astrai-replay-") as scratch:
        trainer = instantiate(
            cfg.trainer,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=scratch,
        )
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt) if ckpt else None)


def _run(
    cfg: DictConfig, ledger: Any, meta: Mapping[str, Any], ckpt: Path | None, at: int, until: int
) -> list[StepCheck]:
    datamodule, module = rebuild_start(cfg, meta)
    if ckpt is None:
        check_start(module, meta)
    log.info("replaying steps %d..%d from %s", at + 1, until, ckpt or "the start (seed)")
    checks: list[StepCheck] = []
    fit_from(cfg, datamodule, module, ckpt, [replay_callback(ledger, until, checks)])
    return checks


def format_checks(checks: Sequence[StepCheck]) -> str:
    rows = [("step", "loss (ledger)", "loss (replay)", "grad norm", "weights", "verdict")]
    for c in checks:
        rows.append(
            (
                str(c.step),
                f"{c.recorded['loss']:.9g}",
                f"{c.replayed['loss']:.9g}",
                f"{c.replayed['grad_norm']:.9g}",
                c.replayed["weights_digest"][:12] or "-",
                "exact" if c.ok else "DIFFERS: " + ", ".join(c.mismatches),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    """``RUN step=K [until=K2 | --until K2] [out=FILE]``."""
    args: dict[str, Any] = {}
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("-h", "--help"):
            raise SystemExit(__doc__)
        if arg == "--until":
            if not rest:
                raise SystemExit("astrai.train.replay: --until needs a step")
            arg = f"until={rest.pop(0)}"
        arg = arg.removeprefix("--")
        if "=" not in arg:
            if "run" in args:
                raise SystemExit(
                    f"astrai.train.replay: one run folder, got {args['run']} and {arg}"
                )
            args["run"] = arg
            continue
        key, value = arg.split("=", 1)
        if key not in ("step", "until", "out", "run"):
            raise SystemExit(f"astrai.train.replay: unknown option {key} (step, until, out)")
        args[key] = value
    if "run" not in args or "step" not in args:
        raise SystemExit("usage: python -m astrai.train.replay RUN step=K [--until K2] [out=FILE]")
    for key in ("step", "until"):
        if key in args:
            try:
                args[key] = int(args[key])
            except ValueError:
                raise SystemExit(f"astrai.train.replay: {key}={args[key]} is not a step") from None
    return args


def setup_cli() -> None:
    """Logging for the commands that re-run a run's steps (replay, bisect, verify)."""
    from astrai.runtime import setup_logging

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    setup_logging("info", lightning=True)
    # a re-run leaves out the run's callbacks (checkpointing, export, loggers) on purpose
    warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")


def main(argv: Sequence[str] | None = None) -> int:
    setup_cli()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        checks = replay(args["run"], args["step"], args.get("until"))
    except (ReplayError, FileNotFoundError, KeyError) as err:
        raise SystemExit(f"astrai.train.replay: {err}") from None
    print(format_checks(checks))
    if "out" in args:
        from astrai.eval.report import write_json

        write_json(args["out"], [c.to_dict() for c in checks])
    wanted = set(range(args["step"], (args.get("until") or args["step"]) + 1))
    done = {c.step for c in checks if c.ok}
    return 0 if wanted <= done and all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
