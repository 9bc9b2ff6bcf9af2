"""Sampling: each stage against a plain reference, statistics on fixed-seed draws, seeds."""

from __future__ import annotations

import pytest
import torch

from astrai.inference.params import MAX_LOGPROBS, SamplingParams
from astrai.inference.sampling import (
    MinPStrategy,
    SamplingBatch,
    SamplingBatchCache,
    SamplingPipeline,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    apply_logit_bias,
    apply_penalties,
    sample,
    sample_batch,
)

NEG_INF = float("-inf")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def frequencies(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).double() / ids.numel()


def nucleus_reference(probs: list[float], p: float) -> set[int]:
    """The minimal set of most likely tokens whose total probability reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


# ---------------------------------------------------------------------- greedy and log-probs
def test_greedy_equals_argmax():
    logits = torch.randn(64, 300, generator=gen())
    out = sample(logits, SamplingParams(temperature=0.0), generator=gen(1))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    # vLLM's convention: a greedy row's processed log-prob is at temperature 1, not 0 (point mass)
    torch.testing.assert_close(out.processed_logprobs, out.logprobs, atol=1e-6, rtol=0)


def test_greedy_rows_ignore_their_batch_companions():
    logits = torch.randn(6, 50, generator=gen())
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(6)]
    for seed in range(5):
        ids = sample(logits, params, generator=gen(seed)).token_ids
        assert torch.equal(ids[1::2], logits[1::2].argmax(-1))


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(8, 40, generator=gen(), dtype=torch.float32) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5, presence_penalty=1.0, logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(seed=3),
    ] * 2
    generated = [[3, 3, 1], [0], [], [5]] * 2
    out = sample(logits, params, generated=generated, generator=gen(2))
    expected = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-6, rtol=0)
    ids, logprobs = sample_batch(logits, params, generated=generated, generator=gen(2))
    assert torch.equal(ids, out.token_ids) and torch.equal(logprobs, out.logprobs)


def _at(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(1, ids[:, None]).squeeze(1).float()


def test_logprobs_modes_per_row():
    """raw = the model's distribution; scaled = after penalties, bias and temperature, not
    truncated; processed = the distribution sampled from (top-k too). Each row its own."""
    logits = torch.randn(6, 40, generator=gen(5), dtype=torch.float32) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs_mode="raw"),
        SamplingParams(temperature=0.7, top_k=5, logprobs_mode="scaled"),
        SamplingParams(temperature=0.7, top_k=5, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logprobs_mode="scaled"),
        SamplingParams(temperature=1.3, frequency_penalty=0.5, logprobs_mode="scaled"),
        SamplingParams(temperature=0.0, logit_bias={3: 1.5}, logprobs_mode="processed"),
    ]
    generated = [[], [], [], [], [1, 1, 2], []]
    out = sample(logits, params, generated=generated, generator=gen(6))
    ids, chosen = sample_batch(logits, params, generated=generated, generator=gen(6))
    assert torch.equal(ids, out.token_ids)
    adjusted = logits.clone()
    adjusted[4, 1] -= 1.0  # frequency penalty 0.5 x 2 occurrences
    adjusted[4, 2] -= 0.5
    adjusted[5, 3] += 1.5
    top5 = logits.masked_fill(logits < logits.topk(5, -1).values[:, -1:], float("-inf"))
    expected = torch.stack(
        [
            _at(logits, ids)[0],
            _at(logits / 0.7, ids)[1],
            _at(top5 / 0.7, ids)[2],
            _at(logits, ids)[3],  # greedy: temperature 1
            _at(adjusted / 1.3, ids)[4],
            _at(adjusted, ids)[5],
        ]
    )
    torch.testing.assert_close(chosen, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logprobs, _at(logits, ids), atol=1e-5, rtol=0)


def test_logprobs_modes_agree_at_temperature_one_without_truncation():
    logits = torch.randn(16, 50, generator=gen(8)) * 3
    outs = [
        sample_batch(logits, SamplingParams(seed=4, logprobs_mode=m), generator=gen(9))
        for m in ("raw", "scaled", "processed")
    ]
    assert all(torch.equal(ids, outs[0][0]) for ids, _ in outs)
    for _, lps in outs[1:]:
        torch.testing.assert_close(lps, outs[0][1], atol=1e-5, rtol=0)


def test_bad_logprobs_mode_is_named():
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="raw_logits").validate()


def test_engine_scaled_logprobs_equal_the_tempered_training_forward(model, tokenizer):
    """What GRPO relies on: at temperature 0.7 the engine's `scaled` (and, without top-k/p,
    `processed`) log-probs are log_softmax(logits / 0.7) of a plain dense forward."""
    from astrai.inference import InferenceEngine

    prompts = [[5, 17, 33, 2], [9, 8, 7, 6, 5, 4]]
    for mode in ("scaled", "processed"):
        with InferenceEngine(model, tokenizer, start=False, max_seq_len=64) as eng:
            out = eng.run_batch(
                prompts,
                max_tokens=6,
                temperature=0.7,
                seed=3,
                ignore_eos=True,
                return_details=True,
                logprobs_mode=mode,
            )
        for p, r in zip(prompts, out):
            with torch.no_grad():
                logits = model(torch.tensor([p + r.token_ids]))[0].float()
            ref = torch.log_softmax(logits / 0.7, -1)[len(p) - 1 : -1]
            ref = ref.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)
            raw = torch.log_softmax(logits, -1)[len(p) - 1 : -1]
            raw = raw.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            assert not torch.allclose(ref, raw, atol=1e-3)  # the temperature is visible


def test_bf16_logits_give_fp32_logprobs():
    logits = torch.randn(4, 30, generator=gen()).to(torch.bfloat16)
    out = sample(logits, SamplingParams(), generator=gen(1))
    expected = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------- distributions
def test_temperature_matches_softmax_frequencies():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 20_000
    for temperature in (0.5, 1.0, 2.0):
        out = sample(
            base.expand(draws, -1), SamplingParams(temperature=temperature), generator=gen(7)
        )
        expected = torch.softmax(base.double() / temperature, -1)
        torch.testing.assert_close(frequencies(out.token_ids, 6), expected, atol=0.012, rtol=0)
        torch.testing.assert_close(
            out.processed_logprobs, expected.log().float()[out.token_ids], atol=1e-5, rtol=0
        )


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(50, generator=gen(3))
    order = logits.argsort(descending=True)
    ks = [1, 3, 10, 0, -1]
    params = [SamplingParams(top_k=k, temperature=3.0) for k in ks] * 1000
    ids = sample(logits.expand(len(params), -1), params, generator=gen(4)).token_ids.view(-1, 5)
    for col, k in enumerate(ks):
        seen = set(ids[:, col].tolist())
        if k > 0:
            assert seen <= set(order[:k].tolist())
            assert len(seen) == k  # with temperature 3 every one of the k shows up
        else:
            assert len(seen) > 10  # off means off


def test_top_k_larger_than_vocab_keeps_all():
    logits = torch.randn(3, 5, generator=gen())
    assert torch.equal(
        TopKStrategy([100, 7, 2], max_k=100)(logits).isinf().sum(-1), torch.tensor([0, 0, 3])
    )


@pytest.mark.parametrize("seed", range(4))
def test_top_p_keeps_the_minimal_nucleus(seed):
    logits = torch.randn(1, 40, generator=gen(seed)) * 2
    probs = torch.softmax(logits[0].double(), -1).tolist()
    for p in (0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 1.0):
        kept = TopPStrategy([p])(logits)[0].isfinite().nonzero().flatten().tolist()
        assert set(kept) == nucleus_reference(probs, p), p


def test_top_p_on_a_fixed_distribution_and_its_draws():
    probs = torch.tensor([0.06, 0.4, 0.1, 0.25, 0.04, 0.15])
    logits = probs.log()
    kept = TopPStrategy([0.7])(logits[None])[0].isfinite()
    assert kept.tolist() == [False, True, False, True, False, True]  # 0.4 + 0.25 + 0.15
    ids = sample(logits.expand(20_000, -1), SamplingParams(top_p=0.7), generator=gen(5)).token_ids
    expected = torch.where(kept, probs, 0).double()
    torch.testing.assert_close(frequencies(ids, 6), expected / expected.sum(), atol=0.012, rtol=0)


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs = torch.tensor([[0.5, 0.2, 0.14, 0.1, 0.06], [0.5, 0.2, 0.14, 0.1, 0.06]])
    kept = MinPStrategy([0.3, 0.0])(probs.log()).isfinite()
    assert kept.tolist() == [[True, True, False, False, False], [True] * 5]  # floor 0.15
    ids = sample(
        probs.log()[:1].expand(5000, -1), SamplingParams(min_p=0.3), generator=gen(1)
    ).token_ids
    assert set(ids.tolist()) == {0, 1}


def test_pipeline_order_renormalises_between_stages():
    """Top-p sees the distribution left by top-k: p=0.75 over the top 3 of
    [0.4, 0.3, 0.2, 0.1] keeps 2 tokens (0.4/0.9 + 0.3/0.9 >= 0.75), not 3."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    pipeline = SamplingPipeline(
        [TemperatureStrategy([1.0]), TopKStrategy([3]), TopPStrategy([0.75])]
    )
    assert pipeline(logits).isfinite().tolist() == [[True, True, False, False]]
    batch = SamplingBatch.from_params([SamplingParams(top_k=3, top_p=0.75)])
    assert torch.equal(batch.pipeline(logits), pipeline(logits))


def test_per_row_parameters_in_one_batch():
    logits = torch.randn(1, 30, generator=gen(9)).expand(4, -1)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.01),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=1.0),
    ]
    out = sample(logits, params, generator=gen(1))
    assert torch.equal(out.token_ids, logits.argmax(-1))


# ---------------------------------------------------------------------- penalties and bias
def test_penalties_follow_the_openai_formula():
    logits = torch.randn(3, 8, generator=gen())
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0),
        SamplingParams(),
    ]
    generated = [[1, 1, 3, 1], [2], [4, 4]]
    batch = SamplingBatch.from_params(params)
    out = apply_penalties(logits.clone(), batch, generated=generated)
    expected = logits.clone()
    expected[0, 1] -= 0.5 + 3 * 0.25
    expected[0, 3] -= 0.5 + 1 * 0.25
    expected[1, 2] -= -1.0
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    counts = torch.zeros(3, 8)
    counts[0, 1], counts[0, 3], counts[1, 2], counts[2, 4] = 3, 1, 1, 2
    torch.testing.assert_close(
        apply_penalties(logits.clone(), batch, token_counts=counts), expected
    )


def test_logit_bias_adds_exactly():
    logits = torch.randn(2, 6, generator=gen())
    batch = SamplingBatch.from_params(
        [SamplingParams(logit_bias={0: -100.0, 5: 2.5}), SamplingParams()]
    )
    expected = logits.clone()
    expected[0, 0] -= 100.0
    expected[0, 5] += 2.5
    torch.testing.assert_close(apply_logit_bias(logits.clone(), batch), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"logit_bias token id 5 .*size 4"):
        apply_logit_bias(torch.zeros(2, 4), batch)


def test_penalties_and_bias_come_before_temperature():
    """logits [0, 0], bias +1 on token 1, T = 0.5: sampled from softmax([0, 2]), not [0, 1]."""
    params = SamplingParams(temperature=0.5, logit_bias={1: 1.0})
    out = sample(torch.zeros(1, 2), params, generator=gen())
    expected = torch.log_softmax(torch.tensor([0.0, 2.0]), -1)[out.token_ids]
    torch.testing.assert_close(out.processed_logprobs, expected, atol=1e-6, rtol=0)
    # Greedy sees the penalised logits: token 2 was generated and is penalised below token 1.
    logits = torch.tensor([[0.0, 1.0, 1.5]])
    greedy = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(logits, greedy, generated=[[2]]).token_ids.tolist() == [1]
    with pytest.raises(ValueError, match="generated or token_counts"):
        sample(logits, greedy)


# ---------------------------------------------------------------------- seeds
def _seeded_run(seed: int, logits_steps: torch.Tensor, companions: int) -> list[int]:
    """Decode len(logits_steps) steps of one seeded request among random companions."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    row_gen = params.make_generator()
    noise = gen(1000 + companions)
    tokens = []
    for step_logits in logits_steps:
        others = torch.randn(companions, step_logits.shape[0], generator=noise)
        batch = torch.cat([others[: companions // 2], step_logits[None], others[companions // 2 :]])
        rows = [SamplingParams(temperature=0.8)] * companions
        rows.insert(companions // 2, params)
        gens = [None] * companions
        gens.insert(companions // 2, row_gen)
        out = sample(batch, rows, generators=gens, generator=noise)
        tokens.append(int(out.token_ids[companions // 2]))
    return tokens


def test_seeded_rows_reproduce_across_runs_and_batch_companions():
    logits_steps = torch.randn(12, 500, generator=gen(11)) * 0.3  # flat: many plausible tokens
    alone = _seeded_run(42, logits_steps, companions=0)
    assert _seeded_run(42, logits_steps, companions=0) == alone
    assert _seeded_run(42, logits_steps, companions=3) == alone
    assert _seeded_run(42, logits_steps, companions=8) == alone
    assert _seeded_run(43, logits_steps, companions=3) != alone


def test_seeded_noise_is_each_rows_own_exponential_draw():
    """The seeded rows' noise, drawn as uniforms per row and one logarithm for the block
    (the fast path), is bit for bit each row's own ``exponential_`` (the draws, and where
    each generator's stream ends), beside a row of the shared generator."""
    from astrai.inference.sampling import _exponential_noise

    for width in (1, 2048, 5003):
        ours = [torch.Generator().manual_seed(s) for s in (3, 4, 5)]
        theirs = [torch.Generator().manual_seed(s) for s in (3, 4, 5)]
        probs = torch.rand(4, width)
        noise = _exponential_noise(
            probs, torch.Generator().manual_seed(9), [*ours[:2], None, ours[2]]
        )
        expected = [torch.empty(width).exponential_(generator=g) for g in theirs]
        shared = torch.empty(width).exponential_(generator=torch.Generator().manual_seed(9))
        tiny = torch.finfo(torch.float32).tiny
        for row, e in zip((0, 1, 3), expected):
            assert torch.equal(noise[row], e.clamp_min(tiny))
        assert torch.equal(noise[2], shared.clamp_min(tiny))
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs))


def test_seeded_one_shot_without_generators_is_reproducible():
    logits = torch.randn(2, 1000, generator=gen()) * 0.1
    params = [SamplingParams(seed=7), SamplingParams(seed=8)]
    first = sample(logits, params).token_ids
    assert torch.equal(sample(logits, params).token_ids, first)
    assert torch.equal(sample(logits.flip(0), params[::-1]).token_ids, first.flip(0))


def test_seeded_draws_follow_the_distribution():
    base = torch.tensor([1.0, 0.0, -0.5, -2.0])
    ids = torch.cat([sample(base[None], SamplingParams(seed=s)).token_ids for s in range(3000)])
    torch.testing.assert_close(
        frequencies(ids, 4), torch.softmax(base.double(), -1), atol=0.03, rtol=0
    )


# ---------------------------------------------------------------------- params and layout
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 1000.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logit_bias", {"12": 1.0}),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", [1, 2]),
        ("seed", 1.5),
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("ignore_eos", 1),
        ("stop_ids", 5),
        ("stop_ids", [1.5]),
        ("logprobs", 21),  # above MAX_LOGPROBS
        ("logprobs", -1),
        ("logprobs", True),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", 1.0),
        ("prompt_logprobs_start", 0),
        ("prompt_logprobs_start", "1"),
    ],
)
def test_invalid_params_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value}).validate()


def test_valid_params_pass_and_vocab_is_checked():
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        logit_bias={3: -100},
        seed=-5,
        max_tokens=0,  # positivity is a property of the request: see check_request
        ignore_eos=True,
        stop_ids=[7, 9],
    )
    assert params.validate() is params
    assert SamplingParams(logprobs=MAX_LOGPROBS, prompt_logprobs=0).validate()
    assert params.stop_ids == frozenset({7, 9})  # any iterable of ids, kept as a frozenset
    assert SamplingParams().stop_ids is None  # None: the tokenizer's stop tokens
    with pytest.raises(ValueError, match="logit_bias token id 3 is outside"):
        params.validate(vocab_size=3)


def test_batch_layout_and_cache():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, top_p=0.9, frequency_penalty=1.0),
    ]
    batch = SamplingBatch.from_params(params)
    assert batch.temperature.tolist() == [0.0, 1.0] and batch.top_k.tolist() == [0, 5]
    assert batch.penalized_rows == (1,) and batch.max_top_k == 5
    assert batch.any_greedy and not batch.all_greedy and batch.any_top_p and not batch.any_min_p
    cache = SamplingBatchCache()
    first = cache.get(params)
    assert cache.get(list(params)) is first  # same objects: reused
    assert cache.get([params[1], params[0]]) is not first  # different layout: rebuilt
    assert cache.get([params[1], SamplingParams(top_k=5)]).top_p.tolist() == pytest.approx(
        [0.9, 1.0]
    )


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="3 sampling params for 2 logits rows"):
        sample(torch.zeros(2, 5), [SamplingParams()] * 3)
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        sample(torch.zeros(5), SamplingParams())


def test_seeded_rows_leave_the_default_generator_alone(model, tokenizer):
    """A seeded request draws from its own stream only: torch's default generator (a
    trainer's dropout, the next training step) is where it was, for a batch of seeded rows
    and for an engine run of seeded requests; unseeded rows still draw from it."""
    from astrai.inference import InferenceEngine

    logits = torch.randn(3, 200, generator=gen(5))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    sample(logits, [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)])
    assert torch.equal(torch.get_rng_state(), before)
    mixed = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0)]
    sample(logits[:2], mixed)
    assert not torch.equal(torch.get_rng_state(), before)

    torch.manual_seed(123)
    with InferenceEngine(model, tokenizer, start=False, max_seq_len=64) as eng:
        before = torch.get_rng_state()
        eng.run_batch([[5, 17, 33], [9, 8]], max_tokens=6, temperature=1.0, seed=4)
        assert torch.equal(torch.get_rng_state(), before)
