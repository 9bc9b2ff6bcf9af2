"""A step's sampling: each sampler's tokens, verifying proposed ones on the way.

Plain decode is speculation with k = 0: one position per sampler, sampled once.

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
from typing import TYPE_CHECKING

import torch

from astrai.inference.constrain import GrammarRows
from astrai.inference.isolation import IsolatedSample
from astrai.inference.step_output import StepOutput
from astrai.inference.task import Task

if TYPE_CHECKING:
    from astrai.inference.scheduler import StepPlan


Sample = Callable[[torch.Tensor, Sequence[Task], Sequence[Sequence[int]] | None], IsolatedSample]


def sample_step(
    logits: torch.Tensor,
    samplers: Sequence[Task],
    sample: Sample,
    grammar: GrammarRows,
    drafts: Sequence[Sequence[int]] | None = None,
    first: Sequence[int] | None = None,
) -> tuple[StepOutput, IsolatedSample]:
    """Each sampler's emitted tokens of one step, and the draws of its first position.

    Plain decode (`drafts` None): row `s` of `logits` is sampler `s`'s one position.
    Speculation: rows `first[s] .. first[s] + len(drafts[s])` are its positions (its
    newest token, then each proposal), sampled while the samples equal the proposals.
    `sample(rows, tasks, generated)` is the runner's isolated sampling; `generated` (None:
    each task's `output_ids`) is what penalties and logits processors see: at a later
    position, the output plus the tokens emitted before it this step (the tasks are not
    touched: `postprocess` appends what was emitted)."""
    rows = logits if first is None else logits.index_select(0, _index(first, 0, logits))
    masked = grammar.mask(rows, samplers)
    drawn = sample(rows, samplers, None)
    faults = drawn.faults
    faults.update(masked)
    stopped = grammar.advance(samplers, drawn.token_ids, faults)
    tops = drawn.top_logprobs
    out = StepOutput(
        [[tok] for tok in drawn.token_ids],
        [[lp] for lp in drawn.logprobs],
        None if tops is None else [[top] for top in tops],
        None if drafts is None else [len(d) for d in drafts],
        faults,
        stopped,
    )
    for s in faults:  # a placeholder: nothing emitted
        out.tokens[s], out.logprobs[s] = [], []
        if out.top_logprobs is not None:
            out.top_logprobs[s] = []
    if drafts is None:
        return out, drawn
    alive = [
        s
        for s, d in enumerate(drafts)
        if d and s not in faults and s not in stopped and out.tokens[s][0] == d[0]
    ]
    j = 1
    while alive:
        rows = logits.index_select(0, _index([first[s] for s in alive], j, logits))
        tasks = [samplers[s] for s in alive]
        masked = grammar.mask(rows, tasks)
        later = sample(rows, tasks, [t.output_ids + out.tokens[s] for t, s in zip(tasks, alive)])
        later.faults.update(masked)  # a later position's fault is met again next step
        complete = grammar.advance(tasks, later.token_ids, later.faults)
        going = []
        for r, s in enumerate(alive):
            if r in later.faults:
                continue
            tok = later.token_ids[r]
            out.tokens[s].append(tok)
            out.logprobs[s].append(later.logprobs[r])
            if out.top_logprobs is not None:  # None: no sampler asked at the first position
                top = later.top_logprobs[r] if later.top_logprobs is not None else ()
                out.top_logprobs[s].append(top)
            if r in complete:
                out.stopped.add(s)
            elif j < len(drafts[s]) and tok == drafts[s][j]:
                going.append(s)
        alive, j = going, j + 1
    return out, drawn


def _index(first: Sequence[int], j: int, logits: torch.Tensor) -> torch.Tensor:
    """Row indices `first[i] + j` on `logits`' device."""
    return torch.tensor([f + j for f in first], device=logits.device)


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
