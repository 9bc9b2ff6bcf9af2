"""Speculative decoding (``ngram``) keeps sampling exact: a seeded request writes the same
tokens with speculation on and off (penalties, top-p, top-k, processors, top log-probs,
`n > 1` groups, preemption), and unseeded samples follow the target distribution.

The distribution check uses `Markov`, a model whose next-token distribution is a fixed
function of the fed token (a 6-state Markov chain, all other tokens impossible): the exact
law of the generated tokens is known, the n-gram proposals from a periodic prompt are
accepted about half of the time, and a verification that sampled a position from the
wrong row of logits (or drew twice) would change the joint law of consecutive tokens.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare
from test_speculative import (
    RADIX,
    SPEC,
    assert_same,
    blocks,
    copy_model,
    periodic,
    run,
    successors,
)

from astrai.inference import InferenceEngine
from astrai.inference.ngram import NgramIndex
from astrai.model import ModelConfig, Transformer

# A copy bias that keeps most sampled runs on the period, with rejections here and there.
BIAS = 9.0
SAMPLED = dict(temperature=1.0, top_p=0.9, presence_penalty=0.5, ignore_eos=True)


# ---------------------------------------------------------------------- (a) same seeds
@pytest.mark.parametrize("seed", [0, 1, 7, 123, 2**40 + 5])
@pytest.mark.parametrize("pool", ["contiguous", "radix"])
def test_seeded_sampling_same_on_and_off(model, tokenizer, seed, pool):
    bs = blocks(6, seed=20)
    m = copy_model(model, BIAS, successors(bs))
    prompts = periodic(bs, seed=seed)
    cfg = dict(cache_mode="contiguous") if pool == "contiguous" else RADIX
    kw = dict(max_tokens=32, seed=seed, **SAMPLED)
    on, stats = run(m, tokenizer, prompts, SPEC, cfg, **kw)
    off, _ = run(m, tokenizer, prompts, None, cfg, **kw)
    assert_same(on, off)
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # both kinds


@pytest.mark.parametrize(
    "extra",
    [
        dict(frequency_penalty=0.7, top_k=20),
        dict(presence_penalty=-0.5, min_p=0.05, temperature=1.2),
        dict(logit_bias={10: 2.0, 11: -3.0}, top_p=1.0),
        dict(logprobs_mode="processed"),
    ],
    ids=["frequency-topk", "negpresence-minp", "logit-bias", "processed-logprobs"],
)
def test_seeded_sampling_with_more_settings(model, tokenizer, extra):
    bs = blocks(6, seed=21)
    m = copy_model(model, BIAS, successors(bs))
    prompts = periodic(bs, seed=3)
    kw = dict(SAMPLED, max_tokens=32, seed=11)
    kw.update(extra)
    on, stats = run(m, tokenizer, prompts, SPEC, RADIX, **kw)
    off, _ = run(m, tokenizer, prompts, None, RADIX, **kw)
    assert_same(on, off)
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # both kinds


def test_seeded_processors_and_top_logprobs_same_on_and_off(model, tokenizer):
    """A logits processor that reads the generated tokens (it forbids repeating the last
    one) and top-3 alternatives: the processor sees, at each verified position, the tokens
    emitted before it, so the stream and the alternatives are the same as without."""
    bs = blocks(4, seed=22)
    m = copy_model(model, BIAS, successors(bs))
    prompts = periodic(bs)
    seen_lengths: list[int] = []

    def no_repeat(ids, row):
        seen_lengths.append(len(ids))
        if ids:
            row[ids[-1]] = -math.inf
        return row

    got = []
    for spec in (SPEC, None):
        with InferenceEngine(
            m, tokenizer, max_batch_size=8, max_seq_len=256, speculative=spec, **RADIX
        ) as eng:
            results = [
                eng.submit(
                    p,
                    max_tokens=30,
                    seed=40 + i,
                    logprobs=3,
                    logits_processors=[no_repeat],
                    **SAMPLED,
                )
                for i, p in enumerate(prompts)
            ]
            for r in results:
                r.wait_completion(timeout=120)
            stats = eng.get_stats()
            if spec is not None:
                assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # both kinds
        got.append(results)
    on, off = got
    for a, b in zip(on, off):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
        assert all(x != y for x, y in itertools.pairwise(a.token_ids))  # the processor held
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        assert len(a.top_logprobs) == len(a.token_ids)
        for ta, tb in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in ta] == [t for t, _ in tb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb)) <= 1e-5


def test_seeded_groups_and_preemption_same_on_and_off(model, tokenizer):
    """`n = 3` seeded groups (seeds seed + j) in a pool small enough to preempt."""
    bs = blocks(6, seed=23)
    m = copy_model(model, BIAS, successors(bs))
    prompts = [b * 2 + b[:5] for b in bs]
    kw = dict(SAMPLED, max_tokens=40, seed=5, n=3)
    small = dict(cache_mode="paged", page_size=4, kv_tokens=280)
    on, stats = run(m, tokenizer, prompts, SPEC, small, **kw)
    off, off_stats = run(m, tokenizer, prompts, None, RADIX, **kw)
    assert stats["preemptions"] > 0 and off_stats["preemptions"] == 0
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # both kinds
    assert len(on) == 18
    assert_same(on, off)


# ---------------------------------------------------------------------- (b) distribution
STATES = [40, 41, 42, 43, 44, 45]


def chain() -> torch.Tensor:
    """Row i: the next-token law after STATES[i]; the periodic successor has 0.45."""
    t = torch.full((6, 6), 0.11, dtype=torch.float64)
    for i in range(6):
        t[i, (i + 1) % 6] = 0.45
    return t


class Markov(Transformer):
    """Logits log T[fed token] over STATES, -1e4 elsewhere; no forward is run."""

    def forward_packed(self, input_ids, positions, kv_cache, logits_indices=None, **kwargs):
        fed = input_ids if logits_indices is None else input_ids[logits_indices]
        table = torch.full((6, self.config.vocab_size), -1e4)
        table[:, STATES] = chain().log().float()
        index = {s: i for i, s in enumerate(STATES)}
        return table[[index[t] for t in fed.tolist()]]


@pytest.fixture(scope="module")
def markov(tokenizer) -> Markov:
    cfg = ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return Markov(cfg).eval()


N = 3000
MAX_TOKENS = 4


def samples(markov, tokenizer, spec, prompt) -> tuple[list[list[int]], dict]:
    with InferenceEngine(
        markov,
        tokenizer,
        max_batch_size=256,
        max_seq_len=64,
        start=False,
        speculative=spec,
    ) as eng:
        out = eng.run_batch([prompt] * N, max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
        return out, eng.get_stats()


def pair_counts(outs, i: int) -> list[int]:
    """Counts of (token i, token i + 1) over the 36 cells."""
    idx = {s: k for k, s in enumerate(STATES)}
    counts = [0] * 36
    for ids in outs:
        counts[idx[ids[i]] * 6 + idx[ids[i + 1]]] += 1
    return counts


def pair_law(last: int, i: int) -> list[float]:
    """Exact law of (token i, token i + 1) after a prompt ending in STATES[last]."""
    t = chain()
    start = torch.zeros(6, dtype=torch.float64)
    start[last] = 1.0
    marginal = start @ torch.linalg.matrix_power(t, i + 1)  # token i (0-based)
    return (marginal[:, None] * t).flatten().tolist()


def test_unseeded_samples_follow_the_target_distribution(markov, tokenizer):
    """Thousands of unseeded 4-token generations, on and off: the joint law of tokens
    (2, 3) and (3, 4) - produced by verification when proposals are accepted - equals the
    chain's exact law (chi-square goodness of fit) and on/off are alike (contingency)."""
    torch.manual_seed(1234)
    prompt = STATES * 4 + STATES[:3]  # ends in STATES[2]
    on, stats = samples(markov, tokenizer, SPEC, prompt)
    off, _ = samples(markov, tokenizer, None, prompt)
    assert all(len(ids) == MAX_TOKENS and set(ids) <= set(STATES) for ids in on + off)
    # proposals were made, and both accepted and rejected
    assert stats["spec_draft_tokens"] > N // 2
    assert 0.2 < stats["spec_accepted_tokens"] / stats["spec_draft_tokens"] < 0.8
    for i in (0, 1, 2):  # (1, 2), (2, 3), (3, 4)
        law = pair_law(2, i)
        for outs in (on, off):
            counts = pair_counts(outs, i)
            p = chisquare(counts, [q * N for q in law]).pvalue
            assert p > 0.001, (i, p, counts)
        table = [pair_counts(on, i), pair_counts(off, i)]
        assert chi2_contingency(table).pvalue > 0.001


def test_accepted_share_matches_the_target_probability(markov, tokenizer):
    """One proposal per step (K = 1): after the prefill's token x, the proposal d(x) is
    accepted with probability T[x, d(x)] (the rejection sampler's acceptance rate for a
    one-hot proposal), so over N requests the accepted share is Binomial."""
    torch.manual_seed(99)
    prompt = STATES * 4 + STATES[:3]
    spec = dict(SPEC, num_speculative_tokens=1)
    with InferenceEngine(
        markov, tokenizer, max_batch_size=256, max_seq_len=64, start=False, speculative=spec
    ) as eng:
        seen: list[tuple[int, int, int]] = []
        verified = eng.runner.proposer.verified

        def spy(task, n, k):
            seen.append((task.output_ids[0], n, k))
            return verified(task, n, k)

        eng.runner.proposer.verified = spy
        # max_tokens 3: after the first token, exactly one verification of one proposal
        out = eng.run_batch([prompt] * N, max_tokens=3, temperature=1.0, ignore_eos=True)
    assert len(seen) == N and {n for _, n, _ in seen} == {1}
    t, idx = chain(), {s: i for i, s in enumerate(STATES)}
    proposal = {x: NgramIndex(1, 4).lookup([*prompt, x], 1)[0] for x in STATES}
    expected = sum(t[2, idx[x]] * t[idx[x], idx[proposal[x]]] for x in STATES).item()
    share = sum(k for _, _, k in seen) / N
    assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / N), share
    # and per first token: accepted exactly as often as T[x, d(x)]
    for x in STATES:
        ks = [k for first, _, k in seen if first == x]
        q = t[idx[x], idx[proposal[x]]].item()
        assert abs(sum(ks) / len(ks) - q) < 5 * math.sqrt(q * (1 - q) / len(ks)), x
    firsts = [ids[0] for ids in out]
    law = chain()[2].tolist()
    assert chisquare([firsts.count(s) for s in STATES], [q * N for q in law]).pvalue > 0.001


def test_chain_helpers_are_distributions():
    assert torch.allclose(chain().sum(1), torch.ones(6, dtype=torch.float64))
    assert sum(pair_law(0, 1)) == pytest.approx(1.0)
