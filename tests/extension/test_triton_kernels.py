"""Triton kernels against their plain-torch references.

On the CPU they run in Triton's interpreter (`TRITON_INTERPRET=1`, set before the kernel
modules are first imported), in fp32 and fp16 with tiny shapes; on a GPU the `gpu` tests
run them compiled, in bf16 too.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from astrai.extension.ops import reference as ref


@pytest.fixture
def ops(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    names = ("kv_store", "decode", "extend", "rotary")
    mods = {n: importlib.import_module(f"astrai.extension.ops.{n}") for n in names}
    return mods


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GUARD = 7.0  # value of the guard cells around every output


def guarded(shape, dtype, extra=3):
    """A buffer with guard rows before and after; returns (full, inner view)."""
    full = torch.full((shape[0] + 2 * extra, *shape[1:]), GUARD, dtype=dtype, device=DEVICE)
    return full, full[extra : extra + shape[0]]


def check_guards(full, extra=3):
    assert torch.all(full[:extra] == GUARD) and torch.all(full[-extra:] == GUARD)


def paged_case(seq_lens, q_lens, n_heads, n_kv_heads, head_dim, dtype, seed=0):
    """Random page table over a shuffled slot pool; K/V for every position pre-filled."""
    g = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    size = 2 * total + 5
    perm = torch.randperm(size, generator=g)
    rows = torch.randperm(len(seq_lens) + 2, generator=g)[: len(seq_lens)]
    width = max(seq_lens) + 3
    table = torch.full((len(seq_lens) + 2, width), size + 99, dtype=torch.int32)
    offset = 0
    for r, length in zip(rows.tolist(), seq_lens):
        table[r, :length] = perm[offset : offset + length].to(torch.int32)
        offset += length
    k_buf = torch.randn(size, n_kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(size, n_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = dict(device=DEVICE)
    return (
        q.to(**to),
        k_buf.to(**to),
        v_buf.to(**to),
        table.to(**to),
        rows.to(torch.int64).to(**to),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        indptr.to(**to),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(ops, dtype):
    k_full, k_buf = guarded((20, 2, 16), dtype)
    v_full, v_buf = guarded((20, 2, 16), dtype)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    k = torch.randn(5, 2, 16, device=DEVICE).to(dtype)
    v = torch.randn(5, 2, 16, device=DEVICE).to(dtype)
    loc = torch.tensor([3, 19, 0, 7, 11], device=DEVICE)
    ops["kv_store"].store_kv(k, v, k_buf, v_buf, loc)
    ref.store_kv_ref(k, v, k_ref, v_ref, loc)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    check_guards(k_full)
    check_guards(v_full)


def test_kernels_on_a_head_major_pool(ops):
    """The pool may store each head's slots together (KVStorage(head_major=True)): the
    kernels address heads by stride, so they read and write the same values."""

    def head_major(buf):  # same shape and values, heads outermost in memory
        return buf.transpose(0, 1).contiguous().transpose(0, 1)

    seq_lens, q_lens = [5, 40, 1, 33], [5, 9, 1, 1]
    q, k_buf, v_buf, table, rows, lens, indptr = paged_case(
        seq_lens, q_lens, 4, 2, 16, torch.float32, seed=4
    )
    k_hm, v_hm = head_major(k_buf), head_major(v_buf)
    assert k_hm.stride(1) > k_hm.stride(0)
    k = torch.randn(3, 2, 16, device=DEVICE)
    loc = torch.tensor([2, 50, 17], device=DEVICE)
    ops["kv_store"].store_kv(k, -k, k_hm, v_hm, loc)
    ref.store_kv_ref(k, -k, k_buf, v_buf, loc)
    assert torch.equal(k_hm, k_buf) and torch.equal(v_hm, v_buf)
    args = (table, rows, lens, indptr, max(q_lens), 0.25)
    torch.testing.assert_close(
        ops["extend"].extend_attention(q, k_hm, v_hm, *args),
        ops["extend"].extend_attention(q, k_buf, v_buf, *args),
    )
    dec_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q1 = q[: len(seq_lens)]
    torch.testing.assert_close(
        ops["decode"].decode_attention(q1, k_hm, v_hm, table, rows, dec_lens, 0.25),
        ops["decode"].decode_attention(q1, k_buf, v_buf, table, rows, dec_lens, 0.25),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 40, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention(ops, dtype, group, head_dim, splits):
    seq_lens = [1, 7, 32, 33]  # 1, odd, a block multiple, and one past it
    q, k_buf, v_buf, table, rows, lens, _ = paged_case(
        seq_lens, [1] * 4, 2 * group, 2, head_dim, dtype, seed=group + head_dim
    )
    out_full, out = guarded(q.shape, dtype)
    ops["decode"].decode_attention(
        q, k_buf, v_buf, table, rows, lens, head_dim**-0.5, num_splits=splits, out=out
    )
    expected = ref.decode_attention_ref(
        q.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), lens.cpu(), head_dim**-0.5
    )
    torch.testing.assert_close(
        out.cpu().double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype]
    )
    check_guards(out_full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_extend_attention(ops, dtype, group, head_dim):
    # (kv length, new tokens): plain prefill, extend after a cached prefix, decode rows,
    # lengths of 1, odd, and across block boundaries.
    reqs = [(5, 5), (40, 9), (1, 1), (33, 1), (20, 17)]
    seq_lens, q_lens = [s for s, _ in reqs], [n for _, n in reqs]
    q, k_buf, v_buf, table, rows, lens, indptr = paged_case(
        seq_lens, q_lens, 2 * group, 2, head_dim, dtype, seed=group
    )
    out_full, out = guarded(q.shape, dtype)
    ops["extend"].extend_attention(
        q, k_buf, v_buf, table, rows, lens, indptr, max(q_lens), head_dim**-0.5, out=out
    )
    expected = ref.extend_attention_ref(
        *(t.cpu() for t in (q, k_buf, v_buf, table, rows, lens, indptr)), head_dim**-0.5
    )
    torch.testing.assert_close(
        out.cpu().double(), expected.double(), atol=TOL[dtype], rtol=TOL[dtype]
    )
    check_guards(out_full)


@pytest.mark.parametrize("window", [1, 5, 32])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_sliding_window(ops, window, splits):
    """A windowed layer: the query sees the last `window` keys only (lengths below, at and
    past the window, across block boundaries), GQA groups of 2."""
    seq_lens = [1, 7, 32, 33, 70]
    q, k_buf, v_buf, table, rows, lens, _ = paged_case(
        seq_lens, [1] * 5, 4, 2, 16, torch.float32, seed=window + splits
    )
    out = ops["decode"].decode_attention(
        q, k_buf, v_buf, table, rows, lens, 0.25, num_splits=splits, window=window
    )
    cpu = [t.cpu() for t in (q, k_buf, v_buf, table, rows, lens)]
    expected = ref.decode_attention_ref(*cpu, 0.25, window=window)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected, ref.decode_attention_ref(*cpu, 0.25))  # it matters


@pytest.mark.parametrize("window", [1, 6, 40])
def test_extend_attention_sliding_window(ops, window):
    reqs = [(5, 5), (40, 9), (1, 1), (33, 1), (70, 40)]
    seq_lens, q_lens = [s for s, _ in reqs], [n for _, n in reqs]
    q, k_buf, v_buf, table, rows, lens, indptr = paged_case(
        seq_lens, q_lens, 4, 2, 16, torch.float32, seed=window
    )
    out = ops["extend"].extend_attention(
        q, k_buf, v_buf, table, rows, lens, indptr, max(q_lens), 0.25, window=window
    )
    cpu = [t.cpu() for t in (q, k_buf, v_buf, table, rows, lens, indptr)]
    expected = ref.extend_attention_ref(*cpu, 0.25, window=window)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected, ref.extend_attention_ref(*cpu, 0.25))


@pytest.mark.parametrize("window", [None, 5])
def test_attention_sinks(ops, window):
    """GPT-OSS's sinks (one logit per query head in each softmax's denominator): decode over
    three splits and extend, with and without a window."""
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 2
    reqs = [(5, 5), (40, 9), (1, 1), (33, 1), (70, 40)]
    seq_lens, q_lens = [s for s, _ in reqs], [n for _, n in reqs]
    q, k_buf, v_buf, table, rows, lens, indptr = paged_case(
        seq_lens, q_lens, 4, 2, 16, torch.float32, seed=9
    )
    out = ops["extend"].extend_attention(
        q, k_buf, v_buf, table, rows, lens, indptr, max(q_lens), 0.25, window=window, sinks=sinks
    )
    cpu = [t.cpu() for t in (q, k_buf, v_buf, table, rows, lens, indptr)]
    expected = ref.extend_attention_ref(*cpu, 0.25, window=window, sinks=sinks.cpu())
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(expected, ref.extend_attention_ref(*cpu, 0.25, window=window))
    q1 = q[: len(seq_lens)].contiguous()
    out = ops["decode"].decode_attention(
        q1, k_buf, v_buf, table, rows, lens, 0.25, num_splits=3, window=window, sinks=sinks
    )
    cpu = [t.cpu() for t in (q1, k_buf, v_buf, table, rows, lens)]
    expected = ref.decode_attention_ref(*cpu, 0.25, window=window, sinks=sinks.cpu())
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 48])
def test_rotary(ops, dtype, head_dim):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(6, 2, head_dim, generator=g).to(dtype).to(DEVICE)
    angles = torch.randn(6, head_dim // 2, generator=g).to(DEVICE) * 5
    q_out, k_out = ops["rotary"].rotary_qk(q, k, angles.cos(), angles.sin())
    q_ref, k_ref = ref.rotary_qk_ref(q.cpu(), k.cpu(), angles.cos().cpu(), angles.sin().cpu())
    torch.testing.assert_close(q_out.cpu(), q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k_out.cpu(), k_ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_wrappers_refuse_what_they_cannot_run(ops, monkeypatch):
    from astrai.extension.ops import KernelUnavailable

    if torch.cuda.is_available():
        pytest.skip("CPU-only refusal")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(2, 2, 16)
    with pytest.raises(KernelUnavailable, match="CUDA"):
        ops["rotary"].rotary_qk(q, q, torch.ones(2, 8), torch.zeros(2, 8))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(KernelUnavailable, match="bf16"):
        ops["kv_store"].store_kv(
            q.bfloat16(), q.bfloat16(), q.bfloat16(), q.bfloat16(), torch.tensor([0, 1])
        )
    assert os.environ["TRITON_INTERPRET"] == "1"


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4])
def test_bf16_kernels_on_gpu(ops, group):
    dtype = torch.bfloat16
    seq_lens, q_lens = [3, 70, 129, 1], [3, 1, 64, 1]
    q, k_buf, v_buf, table, rows, lens, indptr = paged_case(
        seq_lens, q_lens, 2 * group, 2, 128, dtype
    )
    out = ops["extend"].extend_attention(q, k_buf, v_buf, table, rows, lens, indptr, 64, 128**-0.5)
    expected = ref.extend_attention_ref(
        *(t.cpu() for t in (q, k_buf, v_buf, table, rows, lens, indptr)), 128**-0.5
    )
    torch.testing.assert_close(out.cpu().double(), expected.double(), atol=2e-2, rtol=2e-2)
    qd, k_buf, v_buf, table, rows, lens, _ = paged_case(seq_lens, [1] * 4, 2 * group, 2, 128, dtype)
    out = ops["decode"].decode_attention(
        qd, k_buf, v_buf, table, rows, lens, 128**-0.5, num_splits=4
    )
    expected = ref.decode_attention_ref(
        qd.cpu(), k_buf.cpu(), v_buf.cpu(), table.cpu(), rows.cpu(), lens.cpu(), 128**-0.5
    )
    torch.testing.assert_close(out.cpu().double(), expected.double(), atol=2e-2, rtol=2e-2)
