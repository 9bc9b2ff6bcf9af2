"""``python -m astrai.train.bisect RUN probe='eval=[arithmetic]' when='exact_match < 0.5'``.

Finds the first optimizer step of a ``ledger=true`` run after which the probe's condition
holds, by bisection over rebuilt weights (`astrai.train.rebuild`: the nearest checkpoint plus
a ledger replay, every replayed step checked, so the weights probed are the run's, bit for
bit). It assumes the behaviour, once there, stays (as ``git bisect`` assumes of a bug): the
end is probed first (it must hold there, else "never"), then the start (if it holds there,
"from the start"), then halves: at most ceil(log2(steps)) + 2 probes.

Options: ``lo=`` / ``hi=`` (the steps to search between; default the start and the last
step), ``out=FILE`` (JSON), ``--attribute`` (then rank the found step's rollout groups or
batch slices by how much each pushed towards the condition: `astrai.train.attribute`),
``slices=N`` (8), ``top=N`` (5: groups shown with their text).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("astrai.train.bisect")

__all__ = ["BisectResult", "Probed", "bisect", "main", "max_probes"]


@dataclass
class Probed:
    step: int
    metrics: dict[str, float]
    holds: bool


@dataclass
class BisectResult:
    """``found``: the first step whose weights meet the condition; None with ``verdict``
    "never" (not even at the end) or "from the start" (already at the start)."""

    run: str
    condition: str
    probe: str
    verdict: str
    found: int | None
    probes: list[Probed] = field(default_factory=list)
    replayed_steps: int = 0
    attribution: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def max_probes(steps: int) -> int:
    """The most probes a bisection over ``steps`` steps takes."""
    return math.ceil(math.log2(max(steps, 1))) + 2


def bisect(
    run: str | Path,
    probe: str | Callable[..., Mapping[str, float]],
    when: str,
    lo: int = 0,
    hi: int | None = None,
    attribute: bool = False,
    slices: int = 8,
) -> BisectResult:
    """The first step in ``(lo, hi]`` at which ``when`` holds on ``probe``'s metrics."""
    from astrai.train.attribute import attribute as attribute_step
    from astrai.train.probe import Condition, parse_probe
    from astrai.train.rebuild import Rebuilder
    from astrai.train.replay import ReplayError

    condition = Condition.parse(when)
    with Rebuilder(run) as rebuilder:
        measure = parse_probe(probe, rebuilder.cfg)
        hi = rebuilder.last_step if hi is None else int(hi)
        lo = int(lo)
        if not 0 <= lo < hi:
            raise ReplayError(f"lo={lo}, hi={hi}: need 0 <= lo < hi")
        for s in (lo, hi):
            rebuilder.check_step(s)
        result = BisectResult(str(run), str(condition), repr(measure), "", None)

        def probe_at(step: int) -> bool:
            module = rebuilder.at(step)
            metrics = measure(module, rebuilder.tokenizer)
            holds = condition.holds(metrics)
            result.probes.append(Probed(step, metrics, holds))
            value = metrics[condition.key(metrics)]
            log.info(
                "probe %d: step %d: %s = %.6g: %s",
                len(result.probes),
                step,
                condition.key(metrics),
                value,
                "holds" if holds else "does not hold",
            )
            return holds

        if not probe_at(hi):
            result.verdict = "never"
        elif probe_at(lo):
            result.verdict = "from the start" if lo == 0 else f"already at step {lo}"
        else:
            good, bad = lo, hi  # the condition does not hold at `good`, holds at `bad`
            while bad - good > 1:
                mid = (good + bad) // 2
                if probe_at(mid):
                    bad = mid
                else:
                    good = mid
            result.verdict, result.found = "found", bad
        result.replayed_steps = rebuilder.replayed
        if attribute and result.found is not None:
            before = next(p for p in result.probes if p.step == result.found - 1)
            key = condition.key(before.metrics)
            attribution = attribute_step(
                rebuilder, result.found, measure, condition, slices, before.metrics[key]
            )
            result.attribution = attribution.to_dict()
            result.replayed_steps = rebuilder.replayed
    return result


def format_result(result: BisectResult) -> str:
    lines = [f"{'probe':>5}  {'step':>6}  holds  metrics"]
    for i, p in enumerate(result.probes, 1):
        shown = ", ".join(f"{k}={v:.4g}" for k, v in p.metrics.items())
        lines.append(f"{i:>5}  {p.step:>6}  {'yes' if p.holds else 'no':<5}  {shown}")
    if result.found is not None:
        lines.append(f"first step where {result.condition}: {result.found}")
    else:
        lines.append(f"{result.condition}: {result.verdict}")
    lines.append(f"({len(result.probes)} probes, {result.replayed_steps} steps replayed)")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> dict[str, Any]:
    """``RUN probe=... when=... [lo=] [hi=] [out=] [slices=] [top=] [--attribute]``."""
    args: dict[str, Any] = {"attribute": False}
    for arg in argv:
        if arg in ("-h", "--help"):
            raise SystemExit(__doc__)
        if arg in ("--attribute", "attribute=true"):
            args["attribute"] = True
            continue
        key, eq, value = arg.removeprefix("--").partition("=")
        if not eq:
            if "run" in args:
                raise SystemExit(
                    f"astrai.train.bisect: one run folder, got {args['run']} and {arg}"
                )
            args["run"] = arg
            continue
        if key not in ("probe", "when", "lo", "hi", "out", "slices", "top", "run"):
            raise SystemExit(
                f"astrai.train.bisect: unknown option {key} (probe, when, lo, hi, out, slices, "
                "top, --attribute)"
            )
        args[key] = value
    for need in ("run", "probe", "when"):
        if need not in args:
            raise SystemExit(
                "usage: python -m astrai.train.bisect RUN probe='eval=[arithmetic]' "
                "when='exact_match < 0.5' [--attribute] [out=FILE]"
            )
    for key in ("lo", "hi", "slices", "top"):
        if key in args:
            try:
                args[key] = int(args[key])
            except ValueError:
                raise SystemExit(
                    f"astrai.train.bisect: {key}={args[key]} is not a number"
                ) from None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from astrai.train.attribute import Attribution, Unit, format_attribution
    from astrai.train.probe import ProbeError
    from astrai.train.replay import ReplayError, setup_cli

    setup_cli()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = bisect(
            args["run"],
            args["probe"],
            args["when"],
            lo=args.get("lo", 0),
            hi=args.get("hi"),
            attribute=args["attribute"],
            slices=args.get("slices", 8),
        )
    except (ReplayError, ProbeError, FileNotFoundError) as err:
        raise SystemExit(f"astrai.train.bisect: {err}") from None
    print(format_result(result))
    if result.attribution is not None:
        a = dict(result.attribution)
        a["units"] = [Unit(**u) for u in a["units"]]
        print(format_attribution(Attribution(**a), top=args.get("top", 5)))
    if "out" in args:
        from astrai.eval.report import write_json

        write_json(args["out"], result.to_dict())
    return 0 if result.found is not None else 1


if __name__ == "__main__":
    sys.exit(main())
