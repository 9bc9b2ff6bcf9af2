"""Decode through the fixed-address workspace and captured graphs.

On the CPU the stand-in runner replays on the same static buffers a CUDA graph would, with
the Triton kernels under the interpreter; the `gpu` test captures real CUDA graphs.
"""

from typing import ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from astrai.extension import attn_backend
from astrai.extension.ops._common import in_kernel_launch
from astrai.inference import InferenceEngine
from astrai.inference.graph import capture_sizes


@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]


@pytest.mark.slow
def test_stand_in_replay_equals_eager_including_padded_sizes(
    model, tokenizer, greedy_reference, interpret
):
    # 3 and 5 live requests run padded to the captured sizes 4 and 8; as requests finish at
    # different lengths the batch shrinks through the other sizes.
    prompts = [[5, 9, 2, 7, 1], [3] * 9, [11, 12], [40, 41, 42], [7] * 4]
    lengths = [6, 2, 4, 5, 3]
    eng = InferenceEngine(
        model,
        tokenizer,
        start=False,
        max_batch_size=8,
        cache_mode="paged",
        page_size=4,
        decode_graphs="stand-in",
    )
    with eng, attn_backend("triton"):
        tasks = [
            eng.submit(p, max_tokens=n, temperature=0.0, ignore_eos=True)
            for p, n in zip(prompts, lengths)
        ]
        while eng.scheduler.has_work():
            eng.step()
        replays = dict(eng.graph_runner.replays)
        assert eng.pool.all_free()
    for t, p, n in zip(tasks, prompts, lengths):
        assert t.token_ids == greedy_reference(model, p, n)
    assert replays[8] > 0 and replays[4] > 0 and replays[2] > 0


class HostSyncChecker(TorchDispatchMode):
    """Fails on anything that waits for the device, has a data-dependent shape, or makes a
    fresh tensor (factories, host data); kernel launches themselves are exempt (on a GPU
    they dispatch nothing; Triton's CPU interpreter copies tensors to numpy)."""

    FORBIDDEN: ClassVar[dict[str, str]] = {
        "aten::item": "host sync (.item())",
        "aten::_local_scalar_dense": "host sync (.item())",
        "aten::nonzero": "data-dependent shape",
        "aten::masked_select": "data-dependent shape",
        "aten::unique": "data-dependent shape",
        "aten::empty": "allocation",
        "aten::empty_like": "allocation",
        "aten::zeros": "allocation",
        "aten::ones": "allocation",
        "aten::full": "allocation",
        "aten::arange": "allocation",
        "aten::scalar_tensor": "allocation",
        "aten::lift_fresh": "tensor from host data",
    }

    def __init__(self):
        super().__init__()
        self.violations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if not in_kernel_launch():
            if name in self.FORBIDDEN:
                self.violations.append(f"{name}: {self.FORBIDDEN[name]}")
            if name == "aten::index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            ):
                self.violations.append(f"{name}: boolean mask (data-dependent shape)")
            if name in ("aten::to", "aten::_to_copy") and isinstance(args[0], torch.Tensor):
                dst = kwargs.get("device")
                if (
                    dst is not None
                    and torch.device(dst).type == "cpu"
                    and args[0].device.type != "cpu"
                ):
                    self.violations.append(f"{name}: device-to-host copy")
        return func(*args, **kwargs)


@pytest.mark.slow
def test_decode_step_has_no_host_sync_or_allocation(model, tokenizer, interpret):
    eng = InferenceEngine(
        model,
        tokenizer,
        start=False,
        max_batch_size=4,
        cache_mode="paged",
        page_size=4,
        decode_graphs="stand-in",
    )
    with eng, attn_backend("triton"):
        tasks = [
            eng.submit(p, max_tokens=4, temperature=0.0, ignore_eos=True).task
            for p in ([5, 9, 2], [3] * 6)
        ]
        ws, runner = eng.runner.workspace, eng.graph_runner
        eng.step()  # prefill (eager), samples the first tokens
        rows = [t.row for t in tasks]
        lens = [t.total_len for t in tasks]
        toks = [t.output_ids[-1] for t in tasks]
        checker = HostSyncChecker()
        with torch.inference_mode(), checker:
            ws.prepare(rows, lens, toks, 2)
            logits = runner.run(2, 2)
        assert checker.violations == []
        assert logits.shape == (2, model.config.vocab_size)

        # The checker does catch what it is meant to catch.
        with torch.inference_mode(), HostSyncChecker() as bad:
            ws.input_ids[:2].sum().item()
            torch.zeros(3)
            ws.input_ids[ws.input_ids > 0]
        assert [v.split(": ", 1)[1] for v in bad.violations] == [
            "host sync (.item())",
            "allocation",
            "boolean mask (data-dependent shape)",
        ]


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(model, tokenizer):
    gpu_model = type(model)(model.config).to("cuda")
    gpu_model.load_state_dict(model.state_dict())
    prompts = [[5, 9, 2, 7, 1], [3] * 9, [11, 12]]
    outs = {}
    for graphs in (True, False):
        with InferenceEngine(
            gpu_model,
            tokenizer,
            start=False,
            max_batch_size=8,
            cache_mode="paged",
            decode_graphs=graphs,
        ) as eng:
            assert eng.cuda_graph_enabled is graphs
            outs[graphs] = eng.run_batch(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert outs[True] == outs[False]
