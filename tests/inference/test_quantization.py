"""`engine.quantization=int8_weight_only`: int8 weight-only projections held by the engine
(`astrai.extension.quantized`), checked against plain torch on the same int8 weights."""

import copy

import pytest
import torch

from astrai.extension.quantized import check_quantization, quantize_int8
from astrai.inference import InferenceEngine
from astrai.inference.engine_options import check_engine_blocks
from astrai.model import Transformer
from astrai.model.layers import Linear

pytest.importorskip("torchao")

PROMPTS = [[5, 17, 42, 9, 33, 8], [100, 3, 77, 12], [7, 7, 21, 64, 90, 11, 2, 50], [300, 4]]


def dequantized(model: Transformer) -> Transformer:
    """A copy of `model` whose projections (not the LM head) hold the int8 weights the
    engine quantizes to, dequantized in plain torch (per-channel scales)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for module in ref.modules():
            if type(module) is Linear and module is not ref.lm_head:
                q, scales = quantize_int8(module.weight)
                module.weight.copy_(q.float() * scales[:, None])
    return ref


def dense_logprobs(model: Transformer, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)


def engine_logprobs(engine: InferenceEngine, prompt: list[int]) -> torch.Tensor:
    """Log-probs of tokens 1.. of `prompt` (its own continuation) from the engine."""
    (result,) = engine.score([(prompt[:1], prompt[1:])])
    return torch.tensor([t.logprob for t in result.tokens])


@pytest.mark.parametrize("packed", [True, False])
def test_int8_engine_matches_plain_torch_on_the_same_int8_weights(model, tokenizer, packed):
    ref = dequantized(model)
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=4,
        start=False,
        packed_projections=packed,
        quantization="int8_weight_only",
    ) as engine:
        for prompt in PROMPTS:
            got = engine_logprobs(engine, prompt)
            want = dense_logprobs(ref, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
            torch.testing.assert_close(got, want[:, 0], atol=1e-4, rtol=1e-4)


def test_torchao_scales_are_symmetric_per_channel():
    w = torch.randn(24, 40)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (24,)
    torch.testing.assert_close(scales, w.abs().amax(1) / 127.5)
    # round(w / scale), up to ties (torchao multiplies by the reciprocal)
    assert (q.float() - torch.round(w / scales[:, None])).abs().max() <= 1
    assert (q.float() * scales[:, None] - w).abs().max() <= scales.max() * 0.5001


def test_greedy_int8_agrees_with_fp32_on_most_tokens(model, tokenizer):
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, tokenizer, max_batch_size=4, start=False) as fp32:
        base = [r.token_ids for r in fp32.run_batch(PROMPTS, return_details=True, **kw)]
    with InferenceEngine(
        model, tokenizer, max_batch_size=4, start=False, quantization="int8wo"
    ) as int8:
        quant = [r.token_ids for r in int8.run_batch(PROMPTS, return_details=True, **kw)]
    same = sum(a == b for x, y in zip(base, quant) for a, b in zip(x, y))
    total = sum(len(x) for x in base)
    # a random tiny model's logits are close to uniform, so one flip diverges the rest of a
    # sequence; measured 63 of 96 tokens on this model
    assert same / total >= 0.5, f"greedy agreement {same}/{total}"


def test_the_trainers_module_is_not_changed(model, tokenizer):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: p.data_ptr() for k, p in model.named_parameters()}
    with InferenceEngine(
        model, tokenizer, max_batch_size=2, start=False, quantization="int8_weight_only"
    ) as engine:
        engine.run_batch(PROMPTS[:2], max_tokens=4, temperature=0.0)
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), name
            assert value.dtype == before[name].dtype, name
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == params
    # the model's own forward (a trainer's) is the fp32 one
    torch.testing.assert_close(
        dense_logprobs(model, PROMPTS[0]), dense_logprobs(copy.deepcopy(model), PROMPTS[0])
    )


def test_quantized_packs_follow_a_weight_update(model, tokenizer):
    trained = copy.deepcopy(model)
    with InferenceEngine(
        trained, tokenizer, max_batch_size=2, start=False, quantization="int8_weight_only"
    ) as engine:
        engine_logprobs(engine, PROMPTS[0])
        with torch.no_grad():  # an optimizer step on the shared module
            for p in trained.parameters():
                p.mul_(0.9)
        got = engine_logprobs(engine, PROMPTS[0])
    want = dense_logprobs(dequantized(trained), PROMPTS[0])[:-1]
    want = want.gather(1, torch.tensor(PROMPTS[0][1:])[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad", ["int4", "fp8", 8, True, "INT8_WEIGHT_ONLY"])
def test_a_bad_value_names_the_key(model, tokenizer, bad):
    with pytest.raises(ValueError, match=r"engine\.quantization"):
        check_quantization(bad)
    with pytest.raises(SystemExit, match=r"engine\.quantization"):
        check_engine_blocks({"quantization": bad})
    with pytest.raises(ValueError, match=r"engine\.quantization"):
        InferenceEngine(model, tokenizer, start=False, quantization=bad)


def test_null_is_the_engine_without_the_option(model, tokenizer):
    assert check_quantization(None) is None
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True, return_logprobs=True)
    with InferenceEngine(model, tokenizer, max_batch_size=4, start=False) as plain:
        want = [
            (r.token_ids, r.logprobs) for r in plain.run_batch(PROMPTS, return_details=True, **kw)
        ]
    with InferenceEngine(model, tokenizer, max_batch_size=4, start=False, quantization=None) as off:
        got = [(r.token_ids, r.logprobs) for r in off.run_batch(PROMPTS, return_details=True, **kw)]
    assert got == want  # exactly: the same products
