"""Verifying proposed tokens: sample each position as without speculation, and compare.

A speculative row's forward gives logits for its newest token and each proposal after it.
Position j of every row still verifying is sampled with the request's own sampling
pipeline, generator, penalties, logits processors and grammar, exactly as a plain decode
step would sample it at that point of the sequence (the tokens emitted before it are
visible to the penalties and processors); the row goes on while the sample equals its
proposal (`astrai.inference.speculative` says why this keeps the target distribution and
each seeded stream). A grammar completed, a fault, or a sample that differs ends the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from astrai.inference.constrain import GrammarRows
from astrai.inference.isolation import IsolatedSample
from astrai.inference.logprobs import TopLogprobs
from astrai.inference.task import Task

if TYPE_CHECKING:
    from astrai.inference.scheduler import StepPlan


@dataclass
class Verified:
    """Per sampler: its first token (`tokens`, `logprobs`, `tops`), the tokens after it
    (`more`), how many proposals it accepted (`accepted`); `faults` and `stopped` index
    samplers as a plain step's do."""

    tokens: list[int]
    logprobs: list[float]
    tops: list[TopLogprobs] | None
    accepted: list[int]
    more: dict[int, list[tuple[int, float, TopLogprobs]]] = field(default_factory=dict)
    faults: dict[int, str] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)


def verify(
    logits: torch.Tensor,
    samplers: Sequence[Task],
    drafts: Sequence[Sequence[int]],
    first: Sequence[int],
    sample: Callable[[torch.Tensor, Sequence[Task]], IsolatedSample],
    grammar: GrammarRows,
) -> Verified:
    """`logits` rows `first[s] .. first[s] + len(drafts[s])` are sampler `s`'s positions
    (its newest token, then each proposal); `sample(rows, tasks)` is the runner's isolated
    sampling. The samplers' `output_ids` are extended while verifying (what the next
    position's penalties see) and restored before returning."""
    n = len(samplers)
    emitted: list[list[tuple[int, float, TopLogprobs]]] = [[] for _ in range(n)]
    out = Verified([0] * n, [0.0] * n, None, [0] * n)
    alive, j = list(range(n)), 0
    try:
        while alive:
            idx = torch.tensor([first[s] + j for s in alive], device=logits.device)
            rows = logits.index_select(0, idx)
            tasks = [samplers[s] for s in alive]
            masked = grammar.mask(rows, tasks)
            drawn = sample(rows, tasks)
            drawn.faults.update(masked)
            complete = grammar.advance(tasks, drawn.token_ids, drawn.faults)
            going = []
            for r, s in enumerate(alive):
                if r in drawn.faults:
                    if not emitted[s]:  # a later position's fault is met again next step
                        out.faults[s] = drawn.faults[r]
                    continue
                tok = drawn.token_ids[r]
                top = drawn.top_logprobs[r] if drawn.top_logprobs is not None else ()
                emitted[s].append((tok, drawn.logprobs[r], top))
                tasks[r].output_ids.append(tok)
                if r in complete:
                    out.stopped.add(s)
                elif j < len(drafts[s]) and tok == drafts[s][j]:
                    going.append(s)
            alive, j = going, j + 1
    finally:
        for s, tokens in enumerate(emitted):
            if tokens:
                del samplers[s].output_ids[-len(tokens) :]
    any_top = any(top for tokens in emitted for _, _, top in tokens)
    out.tops = [()] * n if any_top else None
    for s, tokens in enumerate(emitted):
        if not tokens:
            continue
        out.tokens[s], out.logprobs[s], top = tokens[0]
        if out.tops is not None:
            out.tops[s] = top
        out.accepted[s] = len(tokens) - 1
        if len(tokens) > 1:
            out.more[s] = tokens[1:]
    return out


def with_drafts(plan: StepPlan, drafts: Mapping[int, list[int]]) -> StepPlan:
    """`plan` with row `i`'s proposals `drafts[i]` fed after its newest token (its KV is
    reserved: `StepPlan.draft_budgets`), as one extend row."""
    out = dataclasses.replace(
        plan, q_lens=[], seq_lens=[], token_ids=[], positions=[], sample_rows=[]
    )
    offset = 0
    for i, (q, seq) in enumerate(zip(plan.q_lens, plan.seq_lens)):
        extra = drafts.get(i, [])
        start = seq - q
        out.token_ids.extend(plan.token_ids[offset : offset + q])
        out.token_ids.extend(extra)
        offset += q
        n = q + len(extra)
        out.q_lens.append(n)
        out.seq_lens.append(start + n)
        out.positions.extend(range(start, start + n))
    out.sample_rows = list(plan.sample_rows)
    return out
