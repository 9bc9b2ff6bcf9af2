"""Fault isolation of a step's sampling: one request's fault fails that request only.

Anything a request brings into the step's sampling (its logits processors, its seed, its
parameters) can raise. `sample_isolated` runs the processors row by row, then samples the
whole batch at once; if that raises, it restores the seeded generators, samples row by row,
and reports each failing row with its cause, so only those requests end (`aborted`) and the
others get exactly the tokens a clean batch would have given them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from astrai.inference.logprobs import TopLogprobs
from astrai.inference.processors import apply_logits_processors, describe
from astrai.inference.sampling import SamplingBatchCache, sample_batch
from astrai.inference.scoring import top_alternatives
from astrai.inference.task import Task

logger = logging.getLogger(__name__)


@dataclass
class IsolatedSample:
    """One step's draws: `token_ids` / `logprobs` per sampling row (0 for faulted rows),
    `top_logprobs` (None when no row asks) and `faults` `{row: error}`."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs] | None
    faults: dict[int, str] = field(default_factory=dict)
    # The batch's token ids on the device (None after a row-by-row fallback).
    device_tokens: torch.Tensor | None = None


def sample_isolated(
    logits: torch.Tensor,
    tasks: Sequence[Task],
    cache: SamplingBatchCache,
    generator_of: Callable[[Task], torch.Generator | None],
    generated: Sequence[Sequence[int]] | None = None,
) -> IsolatedSample:
    """Sample one token per row of `logits` for `tasks`, failing only the rows that fault.

    `generator_of(task)`: the task's own generator (seeded requests); `cache`: the runner's
    batch layout cache; `generated`: each row's tokens so far, for penalties and logits
    processors (None: each task's `output_ids`). Faulted rows keep a placeholder token the
    caller must drop.
    """
    if generated is None:
        generated = [t.output_ids for t in tasks]
    if any(t.params.logits_processors for t in tasks):
        logits = logits.float().clone()
        faults = apply_logits_processors(
            logits, [t.params.logits_processors for t in tasks], generated
        )
    else:
        logits = logits.float()
        faults = {}
    gens: list[torch.Generator | None] = []
    for i, task in enumerate(tasks):
        try:
            gens.append(generator_of(task))
        except Exception as err:
            gens.append(None)
            faults[i] = f"seed {task.params.seed!r} unusable: {describe(err)}"
    states = [None if g is None else g.get_state() for g in gens]
    params = [t.params for t in tasks]
    ks = [t.params.logprobs for t in tasks]
    try:
        tokens, logprobs = sample_batch(
            logits,
            cache.get(params, logits.device),
            generated=generated,
            generators=gens,
        )
        top = top_alternatives(logits, ks)
        return IsolatedSample(tokens.tolist(), logprobs.tolist(), top, faults, tokens)
    except Exception as err:
        logger.warning("batched sampling failed (%s); sampling row by row", describe(err))
    for gen, state in zip(gens, states):
        if gen is not None:
            gen.set_state(state)
    out = IsolatedSample([0] * len(tasks), [0.0] * len(tasks), None, faults)
    for i, task in enumerate(tasks):
        if i in faults:
            continue
        try:
            tok, lp = sample_batch(
                logits[i : i + 1],
                [task.params],
                generated=[generated[i]],
                generators=[gens[i]],
            )
            top = top_alternatives(logits[i : i + 1], [ks[i]])
        except Exception as err:
            faults[i] = f"sampling failed: {describe(err)}"
            logger.warning("request %d: %s", task.id, faults[i])
            continue
        out.token_ids[i], out.logprobs[i] = int(tok[0]), float(lp[0])
        if top is not None:
            out.top_logprobs = out.top_logprobs or [()] * len(tasks)
            out.top_logprobs[i] = top[0]
    return out
