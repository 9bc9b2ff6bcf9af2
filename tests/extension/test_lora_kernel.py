"""The multi-LoRA delta kernel (`sgmv_lora`) against its plain-torch reference and a
per-token loop, directly and through the policy entry point `lora_delta`.

On the CPU the kernel runs in Triton's interpreter (fp32/fp16, tiny shapes); on a GPU the
`gpu` test runs it compiled in bf16.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from astrai.extension.lora import LoRABatch, lora_delta
from astrai.extension.ops import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GUARD = 7.0  # value of the columns of a wide output outside the slice under test


@pytest.fixture
def sgmv(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return importlib.import_module("astrai.extension.ops.lora").sgmv_lora


def lora_case(slots, n_slots, rank, d_in, d_out, dtype, seed=0, device=DEVICE):
    """Random x, stacks (each slot's rank below `rank` zero-padded), scalings, base out."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), d_in, generator=g)
    a3 = torch.randn(n_slots, rank, d_in, generator=g) * 0.3
    bt3 = torch.randn(n_slots, rank, d_out, generator=g) * 0.3
    for s in range(n_slots):  # slot s has rank `rank - s` (at least 1): padded rows are 0
        r = max(1, rank - s)
        a3[s, r:], bt3[s, r:] = 0, 0
    scalings = torch.rand(n_slots, generator=g) * 2 + 0.5
    out = torch.randn(len(slots), d_out, generator=g)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    to = dict(device=device)
    return (
        x.to(dtype).to(**to),
        a3.to(dtype).to(**to),
        bt3.to(dtype).to(**to),
        token_slots.to(**to),
        scalings.to(**to),
        out.to(dtype).to(**to),
    )


def plain(x, a3, bt3, token_slots, scalings, out):
    """The delta token by token, in float64, on the CPU: the independent check."""
    expected = out.detach().cpu().double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            h = x[t].cpu().double() @ a3[s].cpu().double().T
            expected[t] += float(scalings[s]) * (h @ bt3[s].cpu().double())
    return expected


def close(actual, expected, dtype):
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype]
    )


CASES = {
    "mixed": ([0, 2, -1, 1, 2, 0, -1], 3, 8, 40, 24),
    "all_base": ([-1, -1, -1], 2, 4, 24, 12),
    "one_token": ([1], 2, 4, 33, 20),
    "rank_1": ([0, -1, 0], 1, 1, 17, 9),
    "blocks": ([3, 0, 1, -1, 2], 4, 40, 150, 140),  # more than one rank / in / out block
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_sgmv_matches_reference(sgmv, dtype, case):
    slots, n_slots, rank, d_in, d_out = CASES[case]
    x, a3, bt3, token_slots, scalings, out = lora_case(slots, n_slots, rank, d_in, d_out, dtype)
    expected = plain(x, a3, bt3, token_slots, scalings, out)
    base = out.clone()
    ref_out = out.clone()
    ref.sgmv_lora_reference(x, a3, bt3, token_slots, scalings, ref_out)
    assert sgmv(x, a3, bt3, token_slots, scalings, out) is None
    close(out, ref_out, dtype)
    close(out, expected, dtype)
    close(ref_out, expected, dtype)
    base_rows = token_slots.cpu() < 0
    assert torch.equal(out[base_rows], base[base_rows])  # slot -1: untouched, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sgmv_into_a_column_slice(sgmv, dtype):
    """`out` a column slice of a wider packed output: only its columns change."""
    slots = [1, -1, 0, 1]
    x, a3, bt3, token_slots, scalings, _ = lora_case(slots, 2, 6, 20, 14, dtype, seed=1)
    wide = torch.full((len(slots), 5 + 14 + 9), GUARD, dtype=dtype, device=DEVICE)
    wide[:, 5:19] = torch.randn(len(slots), 14).to(dtype).to(DEVICE)
    out = wide[:, 5:19]
    assert out.stride(0) != out.shape[1] and out.stride(1) == 1
    expected = plain(x, a3, bt3, token_slots, scalings, out)
    ref_wide = wide.clone()
    ref.sgmv_lora_reference(x, a3, bt3, token_slots, scalings, ref_wide[:, 5:19])
    sgmv(x, a3, bt3, token_slots, scalings, out)
    close(out, expected, dtype)
    close(wide[:, 5:19], ref_wide[:, 5:19], dtype)
    assert torch.all(wide[:, :5] == GUARD) and torch.all(wide[:, 19:] == GUARD)
    assert torch.all(ref_wide[:, :5] == GUARD) and torch.all(ref_wide[:, 19:] == GUARD)
    assert torch.equal(wide[1], ref_wide[1])  # the base row


def test_sgmv_empty_batch(sgmv):
    x, a3, bt3, token_slots, scalings, out = lora_case([], 2, 4, 8, 8, torch.float32)
    sgmv(x, a3, bt3, token_slots, scalings, out)
    assert out.shape == (0, 8)


def test_sgmv_refuses_what_it_cannot_run(sgmv, monkeypatch):
    from astrai.extension.ops import KernelUnavailable

    if torch.cuda.is_available():
        pytest.skip("CPU-only refusal")
    case = lora_case([0, -1], 1, 2, 8, 8, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailable, match="CUDA"):
        sgmv(*case)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, a3, bt3, token_slots, scalings, out = case
    with pytest.raises(KernelUnavailable, match="bf16"):
        sgmv(x.bfloat16(), a3.bfloat16(), bt3.bfloat16(), token_slots, scalings, out.bfloat16())
    with pytest.raises(ValueError, match="shapes"):
        sgmv(x, a3, bt3, token_slots[:1], scalings, out)


def policy_case(slots, n_slots, rank, d_in, d_out, dtype, seed=2):
    x, a3, bt3, token_slots, scalings, out = lora_case(
        slots, n_slots, rank, d_in, d_out, dtype, seed=seed
    )
    # The engine's layout: `a` `[slots * rank, in]`, `bt` `[slots * rank, out]`.
    a, bt = a3.reshape(n_slots * rank, d_in), bt3.reshape(n_slots * rank, d_out)
    batch = LoRABatch.build(slots, scalings, rank, torch.device(DEVICE))
    return x, a, bt, a3, bt3, token_slots, scalings, out, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_delta_triton_backend(sgmv, monkeypatch, dtype):
    monkeypatch.setenv("ASTR_LORA_BACKEND", "triton")
    slots, rank = [2, -1, 0, 2, 1], 4
    x, a, bt, a3, bt3, token_slots, scalings, out, batch = policy_case(
        slots, 3, rank, 19, 26, dtype
    )
    expected = plain(x, a3, bt3, token_slots, scalings, out)
    ref_out = out.clone()
    ref.sgmv_lora_reference(x, a3, bt3, token_slots, scalings, ref_out)
    lora_delta(x, out, a, bt, rank, batch)
    close(out, ref_out, dtype)
    close(out, expected, dtype)


def test_lora_delta_triton_backend_refuses(monkeypatch):
    from astrai.extension.ops import KernelUnavailable

    if torch.cuda.is_available():
        pytest.skip("CPU-only refusal")
    monkeypatch.setenv("ASTR_LORA_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, a, bt, *_, out, batch = policy_case([0, -1], 1, 2, 8, 8, torch.float32)
    with pytest.raises(KernelUnavailable):
        lora_delta(x, out, a, bt, 2, batch)


@pytest.mark.parametrize("slots", [[1, -1, 0, 1, 2, -1], [-1, 0, -1], [2]])
def test_lora_delta_torch_backend(monkeypatch, slots):
    monkeypatch.setenv("ASTR_LORA_BACKEND", "torch")
    dtype, rank = torch.float32, 4
    x, a, bt, a3, bt3, token_slots, scalings, out, batch = policy_case(
        slots, 3, rank, 21, 30, dtype
    )
    wide = torch.full((len(slots), 3 + 30 + 4), GUARD, dtype=dtype, device=DEVICE)
    wide[:, 3:33] = out
    expected = plain(x, a3, bt3, token_slots, scalings, out)
    ref_out = out.clone()
    ref.sgmv_lora_reference(x, a3, bt3, token_slots, scalings, ref_out)
    lora_delta(x, wide[:, 3:33], a, bt, rank, batch)
    close(wide[:, 3:33], ref_out, dtype)
    close(wide[:, 3:33], expected, dtype)
    assert torch.all(wide[:, :3] == GUARD) and torch.all(wide[:, 33:] == GUARD)


@pytest.mark.gpu
def test_bf16_sgmv_on_gpu(sgmv):
    slots = [3, 0, -1, 1, 2, 3, -1, 0] * 5 + [1]
    n_slots, rank, d_in, d_out = 4, 16, 1000, 700
    x, a3, bt3, token_slots, scalings, _ = lora_case(
        slots, n_slots, rank, d_in, d_out, torch.bfloat16, seed=3
    )
    a3, bt3 = a3 * 0.2, bt3 * 0.2  # keep the deltas O(1) over in = 1000
    wide = torch.full((len(slots), d_out + 64), GUARD, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 32 : 32 + d_out] = torch.randn(len(slots), d_out, device=DEVICE).bfloat16()
    out = wide[:, 32 : 32 + d_out]
    ref_out = out.float().cpu()
    ref.sgmv_lora_reference(
        x.float().cpu(),
        a3.float().cpu(),
        bt3.float().cpu(),
        token_slots.cpu(),
        scalings.cpu(),
        ref_out,
    )
    sgmv(x, a3, bt3, token_slots, scalings, out)
    torch.testing.assert_close(out.float().cpu(), ref_out, atol=3e-2, rtol=3e-2)
    assert torch.all(wide[:, :32] == GUARD) and torch.all(wide[:, 32 + d_out :] == GUARD)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("poison", ["nan_a", "inf_b"])
@pytest.mark.parametrize("slots", [[1, 1, 1, -1, 0, 2, 2], [-1, 2, 2, 0, 1]])
def test_a_non_finite_slot_changes_only_its_own_rows(sgmv, monkeypatch, backend, poison, slots):
    """Slot 0 holds a diverged adapter (NaN in A, or inf in B): its tokens may be anything,
    but every other row is the reference's, bit for bit for the base (row 0 is another
    request's, and slot 0 has the fewest tokens: the torch path pads its group)."""
    monkeypatch.setenv("ASTR_LORA_BACKEND", backend)
    dtype, rank = torch.float32, 4
    x, a, bt, a3, bt3, token_slots, scalings, out, batch = policy_case(
        slots, 3, rank, 21, 30, dtype
    )
    expected = plain(x, a3, bt3, token_slots, scalings, out)  # before the poison
    if poison == "nan_a":
        a[:rank] = float("nan")  # `a3` is a view of the same storage
    else:
        bt[:rank] = float("inf")
    base = out.clone()
    lora_delta(x, out, a, bt, rank, batch)
    others = token_slots.cpu() != 0
    assert torch.isfinite(out[others]).all(), "a diverged slot reached other requests' rows"
    close(out[others], expected[others], dtype)
    base_rows = token_slots.cpu() < 0
    assert torch.equal(out[base_rows], base[base_rows])
