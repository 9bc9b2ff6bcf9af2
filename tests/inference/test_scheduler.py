"""`astrai.inference.scheduler`: plans and post-processing, without a model.

`postprocess(plan, out)` reads a `StepOutput` by name: each sampling row's emitted tokens
(one for plain decode, 1..k+1 after verifying k proposals) under the stop rules.
"""

from __future__ import annotations

from astrai.inference import InferenceScheduler, SamplingParams, Task
from astrai.inference.cache import PagePool
from astrai.inference.step_output import StepOutput


def small_pool() -> PagePool:
    return PagePool(num_layers=1, num_kv_heads=1, head_dim=4, max_batch_size=4, max_seq_len=32)


""" + open('/tmp/h45/moved.py').read().rstrip() + """


def decoding(sched: InferenceScheduler, task: Task) -> None:
    """Run `task` through its prefill (one sampled token, 50) so that it decodes next."""
    (plan,) = sched.schedule()
    sched.postprocess(plan, StepOutput([[50]], [[-0.5]]))


def test_a_speculating_row_keeps_the_kv_of_its_accepted_proposals():
    sched = InferenceScheduler(small_pool(), vocab_size=100, stop_ids=[99], speculative_tokens=3)
    t = sched.submit(Task([1, 2, 3], SamplingParams(max_tokens=10)))
    decoding(sched, t)
    (plan,) = sched.schedule()
    assert plan.draft_budgets == [3] and t.spec.budget == 3 and t.computed == 3
    out = StepOutput([[51, 52, 53]], [[-1.0, -2.0, -3.0]], proposed=[3])
    sched.postprocess(plan, out)
    # the newest token plus the 2 accepted proposals' KV; the sample after them is not fed
    assert t.computed == 3 + 1 + 2 and t.output_ids == [50, 51, 52, 53]
    assert t.logprobs == [-0.5, -1.0, -2.0, -3.0]
    assert (t.spec.proposed, t.spec.accepted, t.spec.misses) == (3, 2, 0)
    stats = sched.stats()
    assert (stats["spec_num_drafts"], stats["spec_draft_tokens"]) == (1, 3)
    assert stats["spec_accepted_tokens"] == 2 and stats["total_tokens"] == 4


def test_a_stop_token_inside_an_emitted_run_drops_the_rest():
    sched = InferenceScheduler(small_pool(), vocab_size=100, stop_ids=[99], speculative_tokens=3)
    t = sched.submit(Task([1, 2, 3], SamplingParams(max_tokens=10)))
    decoding(sched, t)
    (plan,) = sched.schedule()
    sched.postprocess(plan, StepOutput([[51, 99, 52]], [[0.0, 0.0, 0.0]], proposed=[3]))
    assert t.output_ids == [50, 51, 99] and t.finish_reason == "stop"


def test_a_miss_backs_off_and_a_fault_aborts_alone():
    sched = InferenceScheduler(small_pool(), vocab_size=100, speculative_tokens=2)
    a = sched.submit(Task([1, 2], SamplingParams(max_tokens=10)))
    b = sched.submit(Task([3, 4], SamplingParams(max_tokens=10)))
    (plan,) = sched.schedule()
    sched.postprocess(plan, StepOutput([[5], [6]], [[0.0], [0.0]]))
    (plan,) = sched.schedule()
    out = StepOutput([[7], []], [[0.0], []], proposed=[2, 2], faults={1: "boom"})
    sched.postprocess(plan, out)
    assert a.output_ids == [5, 7] and (a.spec.misses, a.spec.skip) == (1, 1)
    assert b.finish_reason == "aborted" and b.error == "boom"
    (plan,) = sched.schedule()  # a skips one step of speculation
    assert plan.tasks == [a] and plan.draft_budgets == [0]


def test_structured_stop_ends_after_the_last_emitted_token():
    sched = InferenceScheduler(small_pool(), vocab_size=100)
    t = sched.submit(Task([1, 2], SamplingParams(max_tokens=10)))
    (plan,) = sched.schedule()
    sched.postprocess(plan, StepOutput([[5]], [[0.0]], stopped={0}))
    assert t.output_ids == [5] and t.finish_reason == "stop"


def test_batch_invariant_prefill_chunks_are_fixed_by_the_prompt_alone():
    """Off, a prompt takes what the step's budget leaves (3 tokens beside a 5-token one);
    with `batch_invariant`, its chunks are max_prefill_tokens from its start, as alone."""

    def chunks(invariant: bool) -> list[list[int]]:
        sched = InferenceScheduler(
            small_pool(), vocab_size=100, max_prefill_tokens=8, batch_invariant=invariant
        )
        sched.submit(Task(list(range(1, 6)), SamplingParams(max_tokens=4)))
        b = sched.submit(Task(list(range(10, 22)), SamplingParams(max_tokens=4)))
        fed = []
        while not b.prefilled:
            (plan,) = sched.schedule()
            fed.append([n for t, n in zip(plan.tasks, plan.q_lens) if t is b])
            tokens = [[50] for _ in plan.samplers]
            sched.postprocess(plan, StepOutput(tokens, [[0.0] for _ in tokens]))
        return fed

    assert chunks(False) == [[3], [8], [1]]
    assert chunks(True) == [[], [8], [4]]
