"""The engine serves a mixture-of-experts model unchanged: greedy output equals full
recomputation of the dense training forward (paged, radix prefix cache), and the engine's
log-probs equal the training forward's."""

import random

import pytest
import torch

from astrai.inference import InferenceEngine
from astrai.model import Transformer, preset


@pytest.fixture(scope="module")
def moe_model(tokenizer) -> Transformer:
    cfg = preset(
        "tiny-moe",
        vocab_size=len(tokenizer),
        num_hidden_layers=3,
        initializer_range=0.15,  # spread-out logits: greedy has no near-ties
    )
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # spread-out router logits: routing has no near-ties either
        for block in model.layers[1:]:
            block.mlp.gate.weight.normal_(0.0, 1.0)
    return model


def prompts(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        (prefix or []) + [rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(n)
    ]


def test_moe_greedy_equals_full_recomputation_with_radix_cache(
    moe_model, tokenizer, greedy_reference
):
    shared = [random.Random(9).randrange(384) for _ in range(40)]
    first, second = prompts(4, seed=1, prefix=shared), prompts(6, seed=2, prefix=shared)
    kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    with InferenceEngine(
        moe_model,
        tokenizer,
        cache_mode="paged",
        page_size=16,
        prefix_cache=True,
        max_batch_size=8,
        max_seq_len=128,
        start=False,
    ) as eng:
        out = eng.run_batch(first, **kw)
        out += eng.run_batch(second, **kw)
        assert eng.get_stats()["cached_prompt_tokens"] >= 32 * len(second)  # prefix reused
    for p, ids in zip(first + second, out):
        assert ids == greedy_reference(moe_model, p, 10)


def test_moe_engine_logprobs_equal_training_forward(moe_model, tokenizer):
    ps = prompts(5, seed=3)
    with InferenceEngine(moe_model, tokenizer, start=False, cache_mode="paged", page_size=4) as eng:
        out = eng.run_batch(
            ps, max_tokens=8, temperature=1.0, seed=7, return_logprobs=True, ignore_eos=True
        )
    for p, (ids, lps) in zip(ps, out):
        full = torch.tensor([p + ids])
        with torch.no_grad():
            logp = torch.log_softmax(moe_model(full)[0].float(), -1)
        ref = logp[len(p) - 1 : -1].gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)
