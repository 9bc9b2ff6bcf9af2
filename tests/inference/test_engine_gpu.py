"""On a CUDA device: the engine (Triton attention by default) matches the CPU reference."""

import pytest

from astrai.inference import InferenceEngine


@pytest.mark.gpu
def test_gpu_greedy_equals_cpu_reference(model, tokenizer, greedy_reference):
    prompts = [[5, 9, 2, 7, 1, 30, 8], [3] * 40, [11, 12]]
    gpu_model = type(model)(model.config).to("cuda")
    gpu_model.load_state_dict(model.state_dict())
    with InferenceEngine(
        gpu_model, tokenizer, start=False, cache_mode="paged", page_size=16
    ) as eng:
        out = eng.run_batch(prompts, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert out == [greedy_reference(model, p, 8) for p in prompts]
