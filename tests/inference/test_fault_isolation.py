"""One request's fault fails that request only: the loop and every other request go on.

References are independent: a clean run of the same requests on a fresh engine, and greedy
decoding by full recomputation of the dense forward (`greedy_reference`).
"""

import asyncio
import random

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference import isolation as isolation_module

ENGINES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged-radix": dict(cache_mode="paged", page_size=4, kv_tokens=4096),
}


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def _settings(i: int) -> dict:
    """Greedy, seeded sampling and top-k/top-p rows mixed in one batch."""
    if i % 3 == 0:
        return dict(temperature=0.0)
    if i % 3 == 1:
        return dict(temperature=0.9, seed=1000 + i)
    return dict(temperature=1.1, top_k=40, top_p=0.9, seed=2000 + i)


def _engine(model, tokenizer, kind: str, **kw) -> InferenceEngine:
    return InferenceEngine(
        model, tokenizer, max_batch_size=32, max_seq_len=128, **ENGINES[kind], **kw
    )


async def _collect(eng: InferenceEngine, prompt: list[int], **kw) -> str:
    return "".join([piece async for piece in eng.generate_async(prompt, **kw)])


def _clean_run(model, tokenizer, kind: str, prompts: list[list[int]]) -> list[list[int]]:
    with _engine(model, tokenizer, kind) as eng:
        results = [
            eng.submit(p, max_tokens=16, ignore_eos=True, **_settings(i))
            for i, p in enumerate(prompts)
        ]
        for r in results:
            r.wait_completion(timeout=120)
        return [r.token_ids for r in results]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_raising_logits_processor_fails_alone(model, tokenizer, kind, greedy_reference):
    prompts = _prompts(20, seed=11)
    calls = {"n": 0}

    def exploding_processor(generated_ids, logits_row):
        calls["n"] += 1
        if calls["n"] == 3:  # after two tokens: mid-decode, in a full batch
            raise RuntimeError("kaboom")
        return logits_row

    async def main(eng):
        good = [
            asyncio.ensure_future(_collect(eng, p, max_tokens=16, ignore_eos=True, **_settings(i)))
            for i, p in enumerate(prompts[:10])
        ]
        bad = asyncio.ensure_future(
            _collect(eng, prompts[0], max_tokens=16, logits_processors=[exploding_processor])
        )
        good += [
            asyncio.ensure_future(
                _collect(eng, p, max_tokens=16, ignore_eos=True, **_settings(i + 10))
            )
            for i, p in enumerate(prompts[10:])
        ]
        return await asyncio.gather(*good), await asyncio.gather(bad, return_exceptions=True)

    with _engine(model, tokenizer, kind) as eng:
        texts, (bad,) = asyncio.run(main(eng))
        assert isinstance(bad, ValueError)
        assert "aborted" in str(bad) and "exploding_processor" in str(bad)
        assert "kaboom" in str(bad) and "RuntimeError" in str(bad)
        assert eng.ready
        after = eng.submit(prompts[3], max_tokens=8, temperature=0.0, ignore_eos=True)
        after.wait_completion(timeout=60)
        assert after.token_ids == greedy_reference(model, prompts[3], 8)
        eng.stop()
        assert eng.pool.all_free() and not eng.scheduler.has_work()
    clean = _clean_run(model, tokenizer, kind, prompts)
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in clean]
    for i in range(0, 20, 3):  # the greedy rows also match the dense forward
        assert clean[i] == greedy_reference(model, prompts[i], 16)


def test_processor_fault_during_graph_replayed_decode(model, tokenizer, greedy_reference):
    """Decode steps replayed on the (stand-in) graph workspace: the faulted row leaves, the
    others' next inputs come from their own samples."""
    prompts = _prompts(4, seed=15)

    def fails_at_third_token(generated_ids, logits_row):
        if len(generated_ids) == 2:
            raise KeyError("third")
        return logits_row

    eng = InferenceEngine(
        model,
        tokenizer,
        start=False,
        max_batch_size=4,
        cache_mode="paged",
        page_size=4,
        decode_graphs="stand-in",
    )
    with eng:
        results = [eng.submit(p, max_tokens=5, temperature=0.0, ignore_eos=True) for p in prompts]
        bad = eng.submit(prompts[0], max_tokens=5, logits_processors=[fails_at_third_token])
        while eng.scheduler.has_work():
            eng.step()
        assert sum(eng.graph_runner.replays.values()) > 0
        assert eng.pool.all_free()
    assert bad.finish_reason == "aborted" and len(bad.token_ids) == 2
    assert "fails_at_third_token" in bad.task.error and "KeyError" in bad.task.error
    assert [r.token_ids for r in results] == [greedy_reference(model, p, 5) for p in prompts]


def test_batched_sampling_fault_falls_back_row_by_row(model, tokenizer, monkeypatch):
    """A fault only the batched draw sees (after it consumed the seeded generators): the
    step is re-sampled row by row, the culprit fails, seeded rows keep their streams."""
    prompts = _prompts(12, seed=12)
    real = isolation_module.sample_batch

    def poisoned(logits, params, **kw):
        out = real(logits, params, **kw)  # advances every seeded generator first
        rows = params.params if hasattr(params, "params") else params
        if any(p.top_k == 377 for p in rows):
            raise RuntimeError("poisoned row")
        return out

    monkeypatch.setattr(isolation_module, "sample_batch", poisoned)
    with _engine(model, tokenizer, "contiguous", start=False) as eng:
        results = [
            eng.submit(p, max_tokens=16, ignore_eos=True, **_settings(i))
            for i, p in enumerate(prompts)
        ]
        bad = eng.submit(prompts[1], max_tokens=16, top_k=377, seed=5)
        eng.start()
        for r in results:
            r.wait_completion(timeout=120)
        with pytest.raises(ValueError, match="sampling failed: RuntimeError: poisoned row"):
            bad.wait_completion(timeout=60)
        assert bad.finish_reason == "aborted" and eng.ready
    monkeypatch.setattr(isolation_module, "sample_batch", real)
    assert [r.token_ids for r in results] == _clean_run(model, tokenizer, "contiguous", prompts)


def test_model_forward_fault_fails_its_step_and_the_loop_survives(
    model, tokenizer, greedy_reference
):
    eng = InferenceEngine(model, tokenizer, cache_mode="paged", page_size=4, start=False)
    original = eng.model.forward_packed
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("forward boom")
        return original(*args, **kwargs)

    eng.model.forward_packed = flaky
    try:
        prompts = _prompts(4, seed=13)
        results = [eng.submit(p, max_tokens=20, ignore_eos=True) for p in prompts]
        eng.start()
        for r in results:
            with pytest.raises(
                ValueError, match="model forward failed: RuntimeError: forward boom"
            ):
                r.wait_completion(timeout=60)
        assert {r.finish_reason for r in results} == {"aborted"}
        assert eng.ready
        later = eng.submit(prompts[0], max_tokens=6, temperature=0.0, ignore_eos=True)
        later.wait_completion(timeout=60)
        assert later.token_ids == greedy_reference(model, prompts[0], 6)
        eng.stop()
        assert eng.pool.all_free()
    finally:
        del eng.model.forward_packed
        eng.shutdown()


def test_raising_stream_subscriber_fails_its_request_only(model, tokenizer, greedy_reference):
    prompts = _prompts(5, seed=14)
    with InferenceEngine(model, tokenizer, max_batch_size=8, start=False) as eng:
        results = [eng.submit(p, max_tokens=10, temperature=0.0, ignore_eos=True) for p in prompts]

        def broken(text):
            raise OSError("client socket gone")

        results[2].subscribe(broken, lambda _: None)
        eng.start()
        with pytest.raises(ValueError, match="on_token callback failed: OSError"):
            results[2].wait_completion(timeout=60)
        for i in (0, 1, 3, 4):
            results[i].wait_completion(timeout=60)
            assert results[i].token_ids == greedy_reference(model, prompts[i], 10)
        assert eng.ready


# ---------------------------------------------------------------------- seeds
HUGE_SEEDS = [2**70, 1180591620717411303424, 2**64 - 1, 2**64, -1, -(2**70), 0]


def test_any_integer_seed_is_used_mod_2_64(model, tokenizer):
    prompt = [5, 17, 99, 3]
    with InferenceEngine(model, tokenizer, max_batch_size=16) as eng:
        first = [eng.submit(prompt, max_tokens=12, ignore_eos=True, seed=s) for s in HUGE_SEEDS]
        again = [eng.submit(prompt, max_tokens=12, ignore_eos=True, seed=s) for s in HUGE_SEEDS]
        for r in first + again:
            r.wait_completion(timeout=60)
        out = {s: r.token_ids for s, r in zip(HUGE_SEEDS, first)}
        assert out == {s: r.token_ids for s, r in zip(HUGE_SEEDS, again)}  # same seed, same draw
        assert out[2**70] == out[2**64] == out[0]  # the documented mapping: seed mod 2**64
        assert out[-1] == out[2**64 - 1]
        assert out[2**64 - 1] != out[2**64]  # consecutive seeds (n=2 from 2**64 - 1) differ
        # run_batch gives prompt i the seed `seed + i`: 2**64 - 1, then 2**64
        pair = eng.run_batch([prompt, prompt], max_tokens=12, ignore_eos=True, seed=2**64 - 1)
        assert pair == [out[2**64 - 1], out[2**64]]
        assert eng.ready and eng.get_stats()["active_tasks"] == 0


def test_seeded_draws_match_a_torch_generator_seeded_mod_2_64():
    """The generator a huge seed gives is torch's for `seed mod 2**64`."""
    for s in HUGE_SEEDS:
        gen = SamplingParams(seed=s).make_generator()
        ref = torch.Generator().manual_seed(s % 2**64)
        assert torch.equal(torch.rand(8, generator=gen), torch.rand(8, generator=ref))


@pytest.mark.parametrize("seed", [1.5, "7", True, float("nan")])
def test_non_integer_seed_is_a_value_error_naming_seed(model, tokenizer, seed):
    with InferenceEngine(model, tokenizer, start=False) as eng:
        with pytest.raises(ValueError, match="seed"):
            eng.submit([1, 2, 3], max_tokens=4, seed=seed)
        assert not eng.scheduler.has_work()


# ---------------------------------------------------------------------- the processors
def test_logits_processors_steer_sampling_and_see_the_generated_ids(model, tokenizer):
    seen: list[list[int]] = []

    def force_seven(generated_ids, logits_row):
        seen.append(list(generated_ids))
        out = torch.full_like(logits_row, float("-inf"))
        out[7] = 0.0
        return out

    with InferenceEngine(model, tokenizer) as eng:
        r = eng.submit([1, 2, 3], max_tokens=5, ignore_eos=True, logits_processors=[force_seven])
        r.wait_completion(timeout=60)
    assert r.token_ids == [7] * 5
    assert seen == [[7] * i for i in range(5)]


@pytest.mark.parametrize("bad", ["abc", 3, [1], [None]])
def test_bad_logits_processors_are_named(model, tokenizer, bad):
    with (
        InferenceEngine(model, tokenizer, start=False) as eng,
        pytest.raises(ValueError, match="logits_processors"),
    ):
        eng.submit([1, 2, 3], max_tokens=4, logits_processors=bad)


def test_processor_returning_garbage_fails_its_request(model, tokenizer):
    with InferenceEngine(model, tokenizer) as eng:
        wrong_shape = eng.submit([1, 2], max_tokens=4, logits_processors=[lambda ids, x: x[:3]])
        all_banned = eng.submit(
            [1, 2], max_tokens=4, logits_processors=[lambda ids, x: x.fill_(float("-inf"))]
        )
        fine = eng.submit([1, 2], max_tokens=4, temperature=0.0, ignore_eos=True)
        with pytest.raises(ValueError, match=r"expected a \[\d+\] tensor"):
            wrong_shape.wait_completion(timeout=60)
        with pytest.raises(ValueError, match="no finite logit"):
            all_banned.wait_completion(timeout=60)
        fine.wait_completion(timeout=60)
        assert len(fine.token_ids) == 4 and eng.ready
