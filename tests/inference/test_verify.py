"""`astrai.inference.verify`: a step's sampling, plain (k = 0) and verifying proposals.

A fake `sample` stands in for the runner's isolated sampling: it draws the argmax and
records what each call saw, so the tests pin down which positions are sampled, in which
order, and what the penalties / processors would see, without a model.
"""

from __future__ import annotations

import torch

from astrai.inference.constrain import GrammarRows
from astrai.inference.isolation import IsolatedSample
from astrai.inference.params import SamplingParams
from astrai.inference.task import Task
from astrai.inference.verify import sample_step, with_drafts

V = 10


class ArgmaxSample:
    """Greedy draws; row `fault_rows` of call `fault_call` faults; records each call."""

    def __init__(self, fault_call: int | None = None, fault_rows: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[list[int], list[list[int]]]] = []
        self.fault_call, self.fault_rows = fault_call, fault_rows

    def __call__(self, rows, tasks, generated):
        seen = [list(g) for g in (generated or [t.output_ids for t in tasks])]
        self.calls.append(([t.id for t in tasks], seen))
        tokens = rows.argmax(-1).tolist()
        faults = {}
        if len(self.calls) - 1 == self.fault_call:
            faults = {r: "boom" for r in self.fault_rows}
        return IsolatedSample(tokens, [-0.5] * len(tokens), None, faults)


def logits_for(argmaxes: list[int]) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), V)
    out[range(len(argmaxes)), argmaxes] = 1.0
    return out


def tasks(n: int) -> list[Task]:
    return [Task([1, 2], SamplingParams(max_tokens=20), output_ids=[3]) for _ in range(n)]


def test_plain_decode_emits_one_token_per_row_and_leaves_tasks_alone():
    ts = tasks(3)
    sample = ArgmaxSample()
    out, drawn = sample_step(logits_for([4, 5, 6]), ts, sample, GrammarRows(None))
    assert out.tokens == [[4], [5], [6]] and out.logprobs == [[-0.5]] * 3
    assert out.proposed is None and out.faults == {} and out.stopped == set()
    assert drawn.token_ids == [4, 5, 6] and len(sample.calls) == 1
    assert [t.output_ids for t in ts] == [[3]] * 3


def test_a_faulted_row_emits_nothing():
    sample = ArgmaxSample(fault_call=0, fault_rows=(1,))
    out, _ = sample_step(logits_for([4, 5]), tasks(2), sample, GrammarRows(None))
    assert out.tokens == [[4], []] and out.faults == {1: "boom"}


def test_proposals_are_accepted_while_the_samples_equal_them():
    """Row 0 proposes [7, 8, 9]: the samples are 7, 8, then 2 (differs: emitted, ends);
    row 1 proposes [5]: sample 6 differs at once; row 2 proposes nothing."""
    ts = tasks(3)
    # positions: row 0 at 0..3, row 1 at 4..5, row 2 at 6
    logits = logits_for([7, 8, 2, 0, 6, 0, 4])
    sample = ArgmaxSample()
    out, _ = sample_step(logits, ts, sample, GrammarRows(None), [[7, 8, 9], [5], []], [0, 4, 6])
    assert out.tokens == [[7, 8, 2], [6], [4]]
    assert out.proposed == [3, 1, 0]
    assert [out.accepted(s) for s in range(3)] == [2, 0, 0]
    # the later positions saw the output plus the tokens emitted before them this step
    assert [seen for _, seen in sample.calls] == [[[3], [3], [3]], [[3, 7]], [[3, 7, 8]]]
    assert [t.output_ids for t in ts] == [[3]] * 3  # untouched: postprocess appends


def test_all_accepted_gives_a_bonus_token():
    out, _ = sample_step(
        logits_for([7, 8, 1]), tasks(1), ArgmaxSample(), GrammarRows(None), [[7, 8]], [0]
    )
    assert out.tokens == [[7, 8, 1]] and out.accepted(0) == 2


def test_a_later_fault_keeps_the_tokens_before_it():
    sample = ArgmaxSample(fault_call=1, fault_rows=(0,))
    out, _ = sample_step(logits_for([7, 8, 1]), tasks(1), sample, GrammarRows(None), [[7, 8]], [0])
    assert out.tokens == [[7]] and out.faults == {}  # met again next step


def test_with_drafts_feeds_proposals_after_the_newest_token():
    from astrai.inference.scheduler import StepPlan

    plan = StepPlan(
        q_lens=[1, 1], seq_lens=[5, 3], token_ids=[10, 11], positions=[4, 2], sample_rows=[0, 1]
    )
    spec = with_drafts(plan, {0: [20, 21]})
    assert spec.q_lens == [3, 1] and spec.seq_lens == [7, 3]
    assert spec.token_ids == [10, 20, 21, 11] and spec.positions == [4, 5, 6, 2]
    assert plan.q_lens == [1, 1]  # the plan itself is unchanged
