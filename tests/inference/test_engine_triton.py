"""The engine's Triton path (interpreter on CPU) gives the same greedy tokens as torch_native."""

import pytest
import torch

from astrai.extension import attn_backend
from astrai.inference import InferenceEngine


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["contiguous", "paged"])
def test_triton_backend_matches_torch_native(model, tokenizer, monkeypatch, mode):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompts = [[5, 9, 2, 7, 1, 30, 8], [3] * 19, [11, 12]]
    kw = dict(max_tokens=5, temperature=0.0, ignore_eos=True, return_details=True)
    outs = {}
    for backend in ("torch_native", "triton"):
        engine = InferenceEngine(model, tokenizer, start=False, cache_mode=mode, page_size=4)
        with engine as eng, attn_backend(backend):
            results = eng.run_batch(prompts, **kw)
        assert all(r.finish_reason == "length" for r in results), results
        outs[backend] = [r.token_ids for r in results]
    assert outs["triton"] == outs["torch_native"]
