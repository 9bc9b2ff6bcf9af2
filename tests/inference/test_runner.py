"""`astrai.inference.runner.ModelRunner`: executes a scheduler's plans, without the engine.

The runner returns a `StepOutput` per plan: for plain decode one emitted token per
sampling row (speculation with k = 0); its optional parts default to `NoAdapterSlots` and
`NoProposer`, and a plan runs the same eagerly and on the CPU stand-in of decode graphs.
"""

from __future__ import annotations

import pytest

from astrai.inference import InferenceScheduler, SamplingParams, Task
from astrai.inference.adapters import NO_ADAPTER_SLOTS
from astrai.inference.cache import PagePool
from astrai.inference.runner import ModelRunner
from astrai.inference.speculative import NO_PROPOSER
from astrai.model.mla_config import kv_geometry

PROMPTS = [[5, 17, 42, 9], [100, 3], [7, 7, 8, 250, 11, 12]]


def parts(model, decode_graphs):
    cfg = model.config
    pool = PagePool(
        num_layers=cfg.num_hidden_layers,
        **kv_geometry(cfg),
        dtype=next(model.parameters()).dtype,
        device=next(model.parameters()).device,
        max_batch_size=4,
        max_seq_len=64,
    )
    sched = InferenceScheduler(pool, vocab_size=cfg.vocab_size, max_batch_size=4)
    return sched, ModelRunner(model, pool, max_batch_size=4, decode_graphs=decode_graphs)


@pytest.mark.parametrize("decode_graphs", [False, "stand-in"])
def test_plain_steps_emit_one_greedy_token_per_row(model, greedy_reference, decode_graphs):
    sched, runner = parts(model, decode_graphs)
    assert runner.adapters is NO_ADAPTER_SLOTS and runner.proposer is NO_PROPOSER
    tasks = [sched.submit(Task(p, SamplingParams(max_tokens=5, temperature=0))) for p in PROMPTS]
    while sched.has_work():
        for plan in sched.schedule():
            out = runner.run(plan)
            assert len(out.tokens) == len(plan.samplers)
            assert all(len(tokens) == 1 for tokens in out.tokens) and out.proposed is None
            assert [len(lps) for lps in out.logprobs] == [1] * len(plan.samplers)
            sched.postprocess(plan, out)
        sched.cleanup()
    for task, prompt in zip(tasks, PROMPTS):
        assert task.output_ids == greedy_reference(model, prompt, 5)
        assert task.finish_reason == "length"


def test_a_prefill_chunk_without_samplers_emits_nothing(model):
    sched, runner = parts(model, False)
    sched.max_prefill_tokens = 2
    sched.submit(Task(PROMPTS[2], SamplingParams(max_tokens=2)))
    (plan,) = sched.schedule()
    out = runner.run(plan)
    assert plan.samplers == [] and out.tokens == [] and out.faults == {}
