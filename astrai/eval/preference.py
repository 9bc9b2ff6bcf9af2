"""Held-out preference accuracy of any checkpoint: ``python -m astrai.eval.preference``.

Every preference method logs its own implicit reward (DPO's and KTO's ``beta * (pi - ref)``,
SimPO's average log-prob, ORPO's odds), so their ``val/rewards/accuracy`` figures are not one
measurement. This one is: on the same held-out pairs, a pair counts as right when the
policy's response log-probability moved further up for the chosen answer than for the
rejected one, relative to a reference (the run's start):
``(pi_c - ref_c) > (pi_r - ref_r)``, DPO's implicit reward, whose ranking does not depend
on beta. Without a reference the policy's own ``reduction`` of log-probs ranks (``mean``:
SimPO's reward). A reward model directory (``*ForSequenceClassification``) ranks by its score.

::

    python -m astrai.eval.preference --policy outputs/tiny_simpo/latest/export \\
        --reference outputs/tiny_sft_start/latest/export --pairs data/prepared/.../onpolicy_val.h5
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class PreferenceAccuracy:
    """Right pairs out of ``n``, with the 95% Wilson interval of the rate."""

    n: int
    correct: int
    accuracy: float
    low: float
    high: float


def _scores(model: torch.nn.Module, loader, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    from astrai.likelihood import preference_logprobs

    chosen, rejected = [], []
    with torch.no_grad():
        for batch in loader:
            c, r = preference_logprobs(model, batch, reduction)
            chosen.append(c.double())
            rejected.append(r.double())
    return torch.cat(chosen), torch.cat(rejected)


def _reward_scores(path: Path, loader) -> tuple[torch.Tensor, torch.Tensor]:
    from astrai.likelihood import reward_inputs
    from astrai.model.reward import last_token_rewards, load_reward_model

    model = load_reward_model(path, dtype=torch.float32).eval()
    chosen, rejected = [], []
    with torch.no_grad():
        for batch in loader:
            ids, last = reward_inputs(batch)
            rewards = last_token_rewards(model, ids, last).double()
            b = rewards.shape[0] // 2
            chosen.append(rewards[:b])
            rejected.append(rewards[b:])
    return torch.cat(chosen), torch.cat(rejected)


def preference_accuracy(
    policy: str | Path,
    pairs: str | Path,
    *,
    reference: str | Path | None = None,
    reduction: str | None = None,
    batch_size: int = 32,
) -> PreferenceAccuracy:
    """Rank every pair of ``pairs`` (a prepared ``preference`` storage) by the policy's
    implicit reward against ``reference`` (summed log-probs, the default with a reference),
    by the policy's own ``reduction`` of log-probs without one (default ``mean``), or by a
    reward model's score; ties count as wrong."""
    from torch.utils.data import DataLoader

    from astrai.data import PreferenceDataset
    from astrai.eval.intervals import wilson_interval
    from astrai.model import load_pretrained
    from astrai.model.reward import reward_dir_problem

    dataset = PreferenceDataset(str(pairs))
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=dataset.collate)
    if reward_dir_problem(policy) is None:  # it has a score head: a reward model
        if reference is not None:
            raise ValueError("--reference: a reward model ranks by its score alone")
        chosen, rejected = _reward_scores(Path(policy), loader)
    else:
        reduction = reduction or ("sum" if reference is not None else "mean")
        chosen, rejected = _scores(load_pretrained(policy, dtype=torch.float32), loader, reduction)
        if reference is not None:
            ref = load_pretrained(reference, dtype=torch.float32)
            ref_c, ref_r = _scores(ref, loader, reduction)
            chosen, rejected = chosen - ref_c, rejected - ref_r
    correct = int((chosen > rejected).sum())
    n = len(chosen)
    low, high = wilson_interval(correct, n)
    return PreferenceAccuracy(n=n, correct=correct, accuracy=correct / n, low=low, high=high)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.eval.preference", description=__doc__)
    parser.add_argument("--policy", required=True, help="the export to judge")
    parser.add_argument("--pairs", required=True, help="a prepared preference storage (.h5)")
    parser.add_argument("--reference", help="the run's start: rank by pi - ref")
    parser.add_argument("--reduction", choices=("sum", "mean"), help="log-prob reduction")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    for name in ("policy", "pairs", "reference"):
        value = getattr(args, name)
        if value is not None and not Path(value).exists():
            parser.error(f"--{name}: {value} does not exist")
    result = preference_accuracy(
        args.policy,
        args.pairs,
        reference=args.reference,
        reduction=args.reduction,
        batch_size=args.batch_size,
    )
    print(json.dumps(asdict(result)))  # the command's output, not a log line
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
