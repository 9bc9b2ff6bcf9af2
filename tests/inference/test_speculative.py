"""Speculative decoding with the ``ngram`` proposer (issue #34, "must hold"): greedy output
is token-identical with speculation on and off in every serving path, a repetitive prompt
gains more than one token per step, KV and the prefix cache hold only verified tokens, the
figures add up, and bad settings are ValueErrors naming the field.

References are independent of the speculative path: the same engine settings without
`speculative`. To make proposals right, `CopyBias` adds `bias` to the logit of the token
that follows the fed token in a periodic block (`succ`) - on top of the real forward, so
the log-probs (and, for a moderate bias, the tokens) still depend on every KV entry.
Sampling (same seeds, chi-square) lives in test_speculative_sampling.py.
"""

from __future__ import annotations

import itertools
import random
from typing import ClassVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from astrai.inference import InferenceEngine
from astrai.inference.structured import StructuredOutput
from astrai.model import Transformer
from astrai.serve import ServerThread, ServeSettings, create_app

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}
BLOCK = 12
CONTIGUOUS = dict(cache_mode="contiguous")
RADIX = dict(cache_mode="paged", page_size=4, kv_tokens=8192)


class CopyBias(Transformer):
    """The real forward, plus `bias` on the logit of `succ[fed token]` at every scored
    position: with a large bias greedy continues each periodic block (the n-gram proposals
    are right), with a moderate one it copies only sometimes."""

    succ: ClassVar[dict[int, int]] = {}
    bias: float = 0.0

    def forward_packed(self, input_ids, positions, kv_cache, logits_indices=None, **kwargs):
        logits = super().forward_packed(input_ids, positions, kv_cache, logits_indices, **kwargs)
        if not self.bias or not self.succ:
            return logits
        fed = input_ids if logits_indices is None else input_ids[logits_indices]
        for k, tok in enumerate(fed.tolist()):
            nxt = self.succ.get(tok)
            if nxt is not None:
                logits[k, nxt] += self.bias
        return logits


def copy_model(model: Transformer, bias: float, succ: dict[int, int]) -> CopyBias:
    m = CopyBias(model.config)
    m.load_state_dict(model.state_dict())
    m.eval()
    m.bias, m.succ = bias, dict(succ)
    return m


def blocks(n: int, seed: int, size: int = BLOCK) -> list[list[int]]:
    """`n` disjoint blocks of distinct non-special tokens."""
    rng = random.Random(seed)
    pool = rng.sample(range(8, 384), n * size)
    return [pool[i * size : (i + 1) * size] for i in range(n)]


def successors(bs: list[list[int]]) -> dict[int, int]:
    return {b[i]: b[(i + 1) % len(b)] for b in bs for i in range(len(b))}


def periodic(bs: list[list[int]], reps: int = 4, seed: int = 0) -> list[list[int]]:
    """Each block repeated `reps` times, cut at a random point of its last period."""
    rng = random.Random(seed)
    return [b * (reps - 1) + b[: rng.randint(1, len(b))] for b in bs]


def run(model, tokenizer, prompts, spec, pool=CONTIGUOUS, engine_kw=None, **sampling):
    """run_batch on a fresh engine: ([(ids, logprobs)], stats)."""
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=16,
        max_seq_len=256,
        start=False,
        speculative=spec,
        **pool,
        **(engine_kw or {}),
    ) as eng:
        out = eng.run_batch(prompts, return_logprobs=True, **sampling)
        assert eng.pool.all_free()
        return out, eng.get_stats()


def assert_same(on, off, tol=1e-5):
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    for (_, a), (_, b) in zip(on, off):
        assert len(a) == len(b)
        assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= tol


def assert_speculated(stats, accepted=True):
    assert stats["spec_draft_tokens"] > 0
    if accepted:
        assert stats["spec_accepted_tokens"] > 0


# ---------------------------------------------------------------------- 1. greedy identity
POOLS = {
    "contiguous": CONTIGUOUS,
    "radix": RADIX,
    "paged-1": dict(cache_mode="paged", page_size=1, kv_tokens=8192),
}


@pytest.mark.parametrize("bias", [5.0, 40.0])
@pytest.mark.parametrize("pool", sorted(POOLS))
def test_greedy_same_on_and_off(model, tokenizer, pool, bias):
    """A periodic batch (and some random prompts) with a moderate copy bias (half of the
    proposals fail) and a large one (nearly all succeed)."""
    bs = blocks(6, seed=1)
    m = copy_model(model, bias, successors(bs))
    rng = random.Random(2)
    prompts = periodic(bs) + [[rng.randrange(8, 384) for _ in range(20)] for _ in range(2)]
    kw = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    on, stats = run(m, tokenizer, prompts, SPEC, POOLS[pool], **kw)
    off, _ = run(m, tokenizer, prompts, None, POOLS[pool], **kw)
    assert_same(on, off)
    assert_speculated(stats)
    assert all(len(ids) == 40 for ids, _ in on)


def test_greedy_same_with_decode_graphs(model, tokenizer):
    """The CPU stand-in of captured decode graphs (Triton interpreter: kept small): pure
    decode steps (every row backing off) replay it, speculative steps run eagerly, and the
    two alternate; tokens and log-probs as without speculation."""
    bs = blocks(2, seed=18)
    m = copy_model(model, 5.0, successors(bs))
    prompts = periodic(bs)
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs, replays = [], []
    for spec in (SPEC, None):
        with InferenceEngine(
            m,
            tokenizer,
            max_batch_size=2,
            max_seq_len=128,
            start=False,
            speculative=spec,
            decode_graphs="stand-in",
        ) as eng:
            outs.append(eng.run_batch(prompts, return_logprobs=True, **kw))
            replays.append(sum(eng.graph_runner.replays.values()))
            if spec is not None:
                assert_speculated(eng.get_stats())
    assert_same(*outs)
    assert replays[0] > 0 and replays[1] > replays[0]


def test_greedy_same_with_prefix_cache_hits(model, tokenizer):
    """A batch sharing a two-period prefix, then the same prompts again (every prompt page
    a hit, pages written by speculative steps included)."""
    bs = blocks(5, seed=3)
    shared = bs[0] * 2
    succ = successors(bs)
    m = copy_model(model, 6.0, succ)
    prompts = [shared + b * 2 + b[:5] for b in bs[1:]] + [shared + bs[0][:7]]
    kw = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        m, tokenizer, max_batch_size=8, max_seq_len=256, start=False, speculative=SPEC, **RADIX
    ) as eng:
        # the first prompt alone, then the others find the shared prefix cached
        first = eng.run_batch(prompts[:1], return_logprobs=True, **kw)
        first += eng.run_batch(prompts[1:], return_logprobs=True, **kw)
        cached_first = eng.get_stats()["cached_prompt_tokens"]
        second = eng.run_batch(prompts, return_logprobs=True, **kw)
        # continuing each answer: the hits now cover pages of verified output tokens
        more = [p + ids for p, (ids, _) in zip(prompts, first)]
        third = eng.run_batch(more, return_logprobs=True, **kw)
        stats = eng.get_stats()
        assert eng.pool.all_free()
    assert cached_first > 0  # the shared prefix was served from the cache in round one
    assert stats["cached_prompt_tokens"] - cached_first >= sum(len(p) - 4 for p in prompts)
    assert_speculated(stats)
    off, _ = run(m, tokenizer, prompts, None, CONTIGUOUS, **kw)
    assert_same(first, off)
    assert_same(second, off)
    off_more, _ = run(m, tokenizer, more, None, CONTIGUOUS, **kw)
    assert_same(third, off_more)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_same_under_preemption(model, tokenizer, page_size):
    """Twelve periodic requests in a pool for about three: preempted, re-admitted (prefix
    hits on their own verified pages), same tokens as a roomy engine without speculation."""
    bs = blocks(12, seed=4)
    m = copy_model(model, 6.0, successors(bs))
    prompts = [b * 2 + b[: random.Random(i).randint(0, 11)] for i, b in enumerate(bs)]
    kw = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    small = dict(cache_mode="paged", page_size=page_size, kv_tokens=240)
    with InferenceEngine(
        m, tokenizer, max_batch_size=12, max_seq_len=128, start=False, speculative=SPEC, **small
    ) as eng:
        results = [eng.submit(p, **kw) for p in prompts]
        eng.start()
        for r in results:
            r.wait_completion(timeout=300)
        eng.stop()
        stats = eng.get_stats()
        assert eng.pool.all_free()
    assert stats["preemptions"] > 0
    assert_speculated(stats)
    assert [r.finish_reason for r in results] == ["length"] * 12
    off, _ = run(m, tokenizer, prompts, None, RADIX, **kw)
    assert_same([(r.token_ids, r.logprobs) for r in results], off)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 6, 7, 9, 13])
def test_max_tokens_ends_mid_proposal(model, tokenizer, max_tokens):
    """Every proposal is right (large bias), so only `max_tokens` cuts a run short: exactly
    `max_tokens` tokens, finish `length`, the same as without speculation."""
    bs = blocks(3, seed=5)
    m = copy_model(model, 40.0, successors(bs))
    prompts = periodic(bs, seed=max_tokens)
    kw = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        m, tokenizer, max_batch_size=4, max_seq_len=256, start=False, speculative=SPEC
    ) as eng:
        on = eng.run_batch(prompts, return_details=True, **kw)
        stats = eng.get_stats()
    off, _ = run(m, tokenizer, prompts, None, **kw)
    assert [r.token_ids for r in on] == [ids for ids, _ in off]
    assert all(len(r.token_ids) == max_tokens and r.finish_reason == "length" for r in on)
    if max_tokens >= 3:
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("max_seq_len", [40, 41, 43, 46])
def test_context_end_inside_a_run(model, tokenizer, max_seq_len):
    """The context fills up (36-token prompts) while every proposal would be accepted: the
    output stops at the context's end (finish `length`), as without speculation."""
    bs = blocks(3, seed=16)
    m = copy_model(model, 40.0, successors(bs))
    prompts = [b * 3 for b in bs]
    outs = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=4, max_seq_len=max_seq_len, start=False, speculative=spec
        ) as eng:
            outs.append(
                eng.run_batch(
                    prompts, return_details=True, max_tokens=100, temperature=0.0, ignore_eos=True
                )
            )
            assert eng.pool.all_free()
    on, off = outs
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert all(len(r.token_ids) == max_seq_len - 36 for r in on)
    assert all(r.finish_reason == "length" for r in on)


def test_a_processor_fault_at_a_later_position(model, tokenizer):
    """A logits processor that raises once its request has 7 tokens: the fault is met at a
    verified position, the tokens before it are kept, and the request ends `aborted` with
    exactly the tokens and error it gets without speculation; the others go on."""

    def fails_at_seven(ids, row):
        if len(ids) == 7:
            raise RuntimeError("seven")
        return row

    bs = blocks(3, seed=17)
    m = copy_model(model, 40.0, successors(bs))
    prompts = periodic(bs)
    outs = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=4, max_seq_len=256, speculative=spec
        ) as eng:
            bad = eng.submit(
                prompts[0], max_tokens=20, temperature=0.0, logits_processors=[fails_at_seven]
            )
            good = [eng.submit(p, max_tokens=20, temperature=0.0) for p in prompts[1:]]
            for r in good:
                r.wait_completion(timeout=60)
            bad.wait(timeout=60)
            stats = eng.get_stats()
            if spec is not None:
                assert_speculated(stats)
        outs.append([(r.token_ids, r.finish_reason, r.task.error) for r in [bad, *good]])
    on, off = outs
    assert on == off
    assert on[0][1] == "aborted" and len(on[0][0]) == 7 and "seven" in on[0][2]
    assert [reason for _, reason, _ in on[1:]] == ["length", "length"]


@pytest.mark.parametrize("offset", [1, 2, 3, 5, 6, 7, 9, 10])
@pytest.mark.parametrize("pool", ["contiguous", "radix"])
def test_stop_token_inside_an_accepted_run(model, tokenizer, offset, pool):
    """The stop token is a proposal that the target accepts, followed by more accepted
    ones: the output ends at it (finish `stop`), as without speculation, and the KV freed."""
    bs = blocks(3, seed=6)
    m = copy_model(model, 40.0, successors(bs))
    prompts = [b * 3 + b[:4] for b in bs]  # the next token is b[4]
    cfg = CONTIGUOUS if pool == "contiguous" else RADIX
    outs = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=4, max_seq_len=256, start=False, speculative=spec, **cfg
        ) as eng:
            got = []
            for b, p in zip(bs, prompts):
                stop = b[(4 + offset - 1) % BLOCK]
                [r] = eng.run_batch([p], return_details=True, max_tokens=30, stop_ids=[stop])
                got.append((r.token_ids, r.logprobs, r.finish_reason))
            stats = eng.get_stats()
            if spec is not None and offset > 1:  # offset 1: the prefill's token stops
                assert_speculated(stats)
            assert eng.pool.all_free()
            if pool == "radix":
                check_radix(eng, [p + ids for p, (ids, _, _) in zip(prompts, got)])
        outs.append(got)
    on, off = outs
    assert [g[0] for g in on] == [g[0] for g in off]
    assert all(reason == "stop" and len(ids) == offset for ids, _, reason in on)
    for (_, a, _), (_, b, _) in zip(on, off):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


def test_structured_regex_with_accepted_proposals(model, tokenizer):
    """A regex grammar whose only text is the prompt's period: the grammar-masked samples
    equal the proposals (accepted), the grammar completes inside a run, and the output is
    the one without speculation."""
    ids = tokenizer.encode(("ab cd ef " * 5).rstrip())
    succ = dict(itertools.pairwise(ids))
    m = copy_model(model, 40.0, succ)
    spec_ = StructuredOutput.regex(r"( ab cd ef){2,5}")
    prompts = [ids, ids[:-1], ids[:-2]]
    results = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=4, max_seq_len=256, start=False, speculative=spec
        ) as eng:
            out = eng.run_batch(
                prompts, return_details=True, max_tokens=60, temperature=0.0, structured=spec_
            )
            results.append(out)
            stats = eng.get_stats()
            if spec is not None:
                assert_speculated(stats)
    on, off = results
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.finish_reason for r in on] == [r.finish_reason for r in off]
    assert tokenizer.decode(on[0].token_ids) == " ab cd ef" * 5
    for a, b in zip(on, off):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_structured_json_schema_mixed_with_free_rows(model, tokenizer):
    """JSON-schema rows next to unconstrained periodic rows: proposals are made for both
    (the grammar's are mostly rejected), the output is the one without speculation."""
    bs = blocks(4, seed=7)
    m = copy_model(model, 6.0, successors(bs))
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "size": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "size", "ok"],
        "additionalProperties": False,
    }
    text = tokenizer.encode('{"name": "ab", "size": 12, "ok": true} ' * 4)
    prompts = [text, text[:-3], *periodic(bs)]
    constraints = [StructuredOutput.json_schema(schema)] * 2 + [None] * 4
    results = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=8, max_seq_len=256, start=False, speculative=spec
        ) as eng:
            out = eng.run_batch(
                prompts, return_details=True, max_tokens=48, temperature=0.0, structured=constraints
            )
            results.append(out)
            if spec is not None:
                assert_speculated(eng.get_stats())
    on, off = results
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.finish_reason for r in on] == [r.finish_reason for r in off]
    for a, b in zip(on, off):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


@pytest.mark.parametrize("pool", ["contiguous", "radix"])
def test_n_samples_greedy_group(model, tokenizer, pool):
    """`n = 3` greedy groups (followers held for the leader's prefill with the cache):
    every sample is the single greedy answer, on and off."""
    bs = blocks(3, seed=8)
    m = copy_model(model, 6.0, successors(bs))
    prompts = periodic(bs)
    cfg = CONTIGUOUS if pool == "contiguous" else RADIX
    kw = dict(max_tokens=30, temperature=0.0, ignore_eos=True, n=3)
    on, stats = run(m, tokenizer, prompts, SPEC, cfg, **kw)
    off, _ = run(m, tokenizer, prompts, None, cfg, **kw)
    assert len(on) == 9
    assert_same(on, off)
    assert_speculated(stats)
    for i in range(3):
        assert on[3 * i][0] == on[3 * i + 1][0] == on[3 * i + 2][0]


def test_speculating_rows_batched_with_prefill_rows(model, tokenizer):
    """A small prefill budget: short prompts decode (with proposals) while long ones are
    still prefilled in chunks, in the same forward; outputs as without speculation."""
    bs = blocks(6, seed=9)
    m = copy_model(model, 6.0, successors(bs))
    prompts = [b * reps + b[:3] for b, reps in zip(bs, [1, 2, 6, 8, 3, 10])]
    kw = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
    mixed = []
    with InferenceEngine(
        m,
        tokenizer,
        max_batch_size=8,
        max_seq_len=256,
        max_prefill_tokens=16,
        start=False,
        speculative=SPEC,
    ) as eng:
        speculate = eng.runner._speculate

        def spy(plan, drafts):
            prefilling = [t for t in plan.tasks if not t.prefilled]
            if drafts and prefilling:
                mixed.append((len(drafts), len(prefilling)))
            return speculate(plan, drafts)

        eng.runner._speculate = spy
        on = eng.run_batch(prompts, return_logprobs=True, **kw)
        stats = eng.get_stats()
    off, _ = run(m, tokenizer, prompts, None, engine_kw=dict(max_prefill_tokens=16), **kw)
    assert mixed, "no step verified proposals next to a prefill chunk"
    assert_speculated(stats)
    assert_same(on, off)


# ---------------------------------------------------------------------- 2. acceptance
def test_a_repetitive_prompt_gains_more_than_one_token_per_step(model, tokenizer):
    bs = blocks(1, seed=10)
    m = copy_model(model, 40.0, successors(bs))
    with InferenceEngine(
        m, tokenizer, max_batch_size=2, max_seq_len=256, start=False, speculative=SPEC
    ) as eng:
        [r] = eng.run_batch(periodic(bs), return_details=True, max_tokens=60, ignore_eos=True)
        stats = eng.get_stats()
    assert len(r.token_ids) == 60
    assert r.token_ids[:BLOCK] != [] and set(r.token_ids) == set(bs[0])
    assert stats["spec_mean_accepted_length"] > 1.5
    assert stats["steps"] < len(r.token_ids)
    assert stats["total_tokens"] == 60


# ---------------------------------------------------------------------- 4. KV accounting
def walk(node, prefix=()):
    for key, child in node.children.items():
        path = prefix + key
        yield path
        yield from walk(child, path)


def check_radix(eng, sequences):
    """Every cached path of the radix is a prefix of some request's prompt + output."""
    prefix = eng.pool.prefix
    for root in prefix.roots.values():
        for path in walk(root):
            assert any(list(path) == seq[: len(path)] for seq in sequences), path


def test_rejections_leave_no_kv_and_only_verified_tokens_cached(model, tokenizer):
    """The random model (no copy bias) rejects most proposals of periodic prompts: after
    the run no page is held, the radix holds only pages of prompts + verified outputs, and
    once the prefix cache is dropped every page is free."""
    bs = blocks(8, seed=11)
    prompts = periodic(bs, reps=5)
    with InferenceEngine(
        model, tokenizer, max_batch_size=8, max_seq_len=256, start=False, speculative=SPEC, **RADIX
    ) as eng:
        out = eng.run_batch(prompts, max_tokens=48, temperature=0.0, ignore_eos=True)
        # sampled rows too: more rejections, different outputs
        sampled = eng.run_batch(prompts, max_tokens=48, temperature=1.0, seed=3, ignore_eos=True)
        stats = eng.get_stats()
        assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] >= 20
        assert stats["kv_usage"] == 0 and stats["kv_used_tokens"] == 0
        assert eng.pool.all_free()
        assert stats["prefix_cached_tokens"] > 0
        seqs = [p + ids for p, ids in zip(prompts, out)] + [
            p + ids for p, ids in zip(prompts, sampled)
        ]
        check_radix(eng, seqs)
        pages = eng.pool.allocator.page_allocator
        eng.pool.invalidate_prefix_cache()
        assert pages.num_free == pages.num_pages
        assert eng.get_stats()["prefix_cached_tokens"] == 0


def test_cached_kv_of_speculative_steps_is_right(model, tokenizer):
    """Prompts that extend earlier answers hit pages written by speculative steps (with
    rejected proposals written past them): the continuation, token and log-prob, is the
    one an engine without speculation or cache computes."""
    bs = blocks(6, seed=12)
    m = copy_model(model, 5.0, successors(bs))
    prompts = periodic(bs)
    kw = dict(max_tokens=36, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        m, tokenizer, max_batch_size=8, max_seq_len=256, start=False, speculative=SPEC, **RADIX
    ) as eng:
        first = eng.run_batch(prompts, **kw)
        before = eng.get_stats()["cached_prompt_tokens"]
        longer = [p + ids for p, ids in zip(prompts, first)]
        again = eng.run_batch(longer, return_logprobs=True, **kw)
        stats = eng.get_stats()
        check_radix(eng, [p + ids for p, (ids, _) in zip(longer, again)])
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
    # the whole answers (bar the last, unfed, token's page) were served from the cache
    assert stats["cached_prompt_tokens"] - before >= sum(len(p) - 8 for p in longer)
    off, _ = run(m, tokenizer, longer, None, CONTIGUOUS, **kw)
    assert_same(again, off)


# ---------------------------------------------------------------------- 5. metrics
def check_figures(stats):
    drafts, proposed = stats["spec_num_drafts"], stats["spec_draft_tokens"]
    accepted = stats["spec_accepted_tokens"]
    assert 0 < drafts <= proposed
    assert 0 <= accepted <= proposed <= drafts * SPEC["num_speculative_tokens"]
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_spec_figures_add_up(model, tokenizer):
    bs = blocks(6, seed=13)
    m = copy_model(model, 6.0, successors(bs))
    with InferenceEngine(
        m, tokenizer, max_batch_size=8, max_seq_len=256, speculative=SPEC, **RADIX
    ) as eng:
        results = [eng.submit(p, max_tokens=40, temperature=0.0) for p in periodic(bs)]
        for r in results:
            r.wait_completion(timeout=120)
        stats = eng.get_stats()
    check_figures(stats)
    assert sum(r.speculation["proposed"] for r in results) == stats["spec_draft_tokens"]
    assert sum(r.speculation["accepted"] for r in results) == stats["spec_accepted_tokens"]
    assert all(r.speculation["accepted"] <= r.speculation["proposed"] for r in results)
    assert stats["total_tokens"] == sum(len(r.token_ids) for r in results)


def test_spec_figures_absent_while_off(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_batch_size=2, max_seq_len=64, start=False) as eng:
        r = eng.submit([9, 10, 11, 9, 10, 11, 9, 10], max_tokens=4, temperature=0.0)
        while eng.scheduler.has_work():
            eng.step()
        stats = eng.get_stats()
    assert not any(k.startswith("spec_") for k in stats)
    assert r.speculation == {"proposed": 0, "accepted": 0}


def scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if not s.labels
    }


def test_metrics_endpoint_reports_spec_figures(model, tokenizer):
    """`/metrics` of a real server: vLLM-named spec counters, equal to `get_stats()`, after
    requests over HTTP (token-id prompts) and in-process ones."""
    bs = blocks(4, seed=14)
    m = copy_model(model, 6.0, successors(bs))
    prompts = periodic(bs)
    eng = InferenceEngine(m, tokenizer, max_batch_size=8, max_seq_len=256, speculative=SPEC)
    try:
        with ServerThread(create_app(eng, ServeSettings())) as srv:
            before = scrape(srv.url)
            assert before["astrai_spec_decode_num_drafts_total"] == 0
            for p in prompts[:2]:
                r = httpx.post(
                    f"{srv.url}/v1/completions",
                    json={"model": "astrai", "prompt": p, "max_tokens": 30, "temperature": 0},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
            for res in [eng.submit(p, max_tokens=30, temperature=0.0) for p in prompts[2:]]:
                res.wait_completion(timeout=60)
            after = scrape(srv.url)
            stats = eng.get_stats()
    finally:
        eng.shutdown()
    check_figures(stats)
    names = {
        "spec_num_drafts": "astrai_spec_decode_num_drafts_total",
        "spec_draft_tokens": "astrai_spec_decode_num_draft_tokens_total",
        "spec_accepted_tokens": "astrai_spec_decode_num_accepted_tokens_total",
        "spec_mean_accepted_length": "astrai_spec_decode_mean_accepted_length",
    }
    for key, name in names.items():
        assert after[name] == pytest.approx(stats[key]), name
    assert after["astrai_spec_decode_num_accepted_tokens_total"] > 0


# ---------------------------------------------------------------------- 6. config errors
@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 1.5}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 10_000}, "num_speculative_tokens"),
        ({"method": "ngram", "lookahead": 3}, "lookahead"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ("ngram", "speculative"),
    ],
)
def test_bad_speculative_settings_name_the_field(model, tokenizer, spec, field):
    with pytest.raises(ValueError, match=field):
        InferenceEngine(
            model, tokenizer, max_batch_size=2, max_seq_len=64, start=False, speculative=spec
        )


def test_speculation_is_deterministic_across_runs(model, tokenizer):
    """Same engine settings twice: the same tokens and the same spec figures (the proposer
    and the back-off depend on nothing but the request)."""
    bs = blocks(4, seed=15)
    m = copy_model(model, 5.0, successors(bs))
    prompts = periodic(bs)
    kw = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, sa = run(m, tokenizer, prompts, SPEC, RADIX, **kw)
    b, sb = run(m, tokenizer, prompts, SPEC, RADIX, **kw)
    assert a == b
    keys = ("spec_num_drafts", "spec_draft_tokens", "spec_accepted_tokens")
    assert [sa[k] for k in keys] == [sb[k] for k in keys]


# ---------------------------------------------------------------------- units
def test_no_proposer_is_speculation_off():
    from astrai.inference.speculative import NO_PROPOSER, NoProposer, Proposer

    assert isinstance(NO_PROPOSER, NoProposer) and isinstance(NO_PROPOSER, Proposer)
    assert NO_PROPOSER.num_speculative_tokens == 0
    assert NO_PROPOSER.propose([object(), object()], [0, 0]) == [[], []]
    NO_PROPOSER.verified(object(), 0, 0)
    NO_PROPOSER.close()


def test_spec_state_backs_off_after_misses_and_resets_on_a_hit():
    from astrai.inference.params import SamplingParams
    from astrai.inference.speculative import next_budget
    from astrai.inference.task import MAX_SKIP, SpecState, Task

    task = Task([1, 2, 3], SamplingParams(max_tokens=10))
    assert task.spec == SpecState()
    skips = []
    for _ in range(6):
        task.spec.record(4, 0)
        skips.append(task.spec.skip)
    assert skips == [1, 3, 7, 15, 31, MAX_SKIP] and task.spec.proposed == 24
    assert next_budget(task, 4, 64) == 0 and task.spec.skip == MAX_SKIP - 1
    task.spec.record(2, 1)
    assert (task.spec.misses, task.spec.accepted) == (0, 1)
    task.spec.skip = 0
    assert next_budget(task, 4, 64) == 4
    task.output_ids = [0] * 7  # 2 tokens left of max_tokens: the last is the bonus
    assert next_budget(task, 4, 64) == 2
