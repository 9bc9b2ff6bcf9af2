"""TorchNativeBackend against an independent dense reference over random page tables."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
from kv_cases import LAYER, make_case, reference

from astrai.extension import attention, attn_backend, batch_invariant
from astrai.extension.backend import TorchNativeBackend, torch_native
from astrai.extension.backend.torch_native import row_segments

MIXED = [(0, 7), (5, 3), (0, 1), (9, 1), (2, 6)]  # (cached prefix, new tokens)
PREFILL = [(0, 7), (0, 1), (0, 12)]
DECODE = [(6, 1), (0, 1), (13, 1), (3, 1)]
# decode rows beside extend rows (a speculative step, chunked prefill): batched as a decode
SPECULATIVE = [(6, 1), (5, 4), (13, 1), (0, 1), (3, 1), (9, 3)]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def run(case, scale):
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    out = TorchNativeBackend().forward(case.q, case.k, case.v, case.cache, LAYER, scale)
    return out, reference(case, k_before, v_before, scale)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize(
    "reqs", [MIXED, PREFILL, DECODE, SPECULATIVE], ids=["mixed", "prefill", "decode", "spec"]
)
def test_matches_reference_fp32(group, head_dim, reqs):
    case = make_case(reqs, n_heads=2 * group, n_kv_heads=2, head_dim=head_dim, seed=group)
    assert case.cache.is_decode == (reqs is DECODE)
    out, ref = run(case, head_dim**-0.5)
    assert out.shape == case.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_matches_reference_half(dtype, reqs):
    case = make_case(reqs, n_heads=8, n_kv_heads=2, head_dim=32, dtype=dtype, seed=3)
    out, ref = run(case, 0.2)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("reqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_kv_write_lands_exactly_at_out_cache_loc(reqs):
    case = make_case(reqs, n_heads=4, n_kv_heads=2, head_dim=16, seed=5)
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    TorchNativeBackend().forward(case.q, case.k, case.v, case.cache, LAYER, 0.25)
    loc = case.cache.out_cache_loc
    expected_k, expected_v = k_before.clone(), v_before.clone()
    expected_k[LAYER, loc], expected_v[LAYER, loc] = case.k, case.v
    assert torch.equal(case.cache.k_buffer, expected_k)
    assert torch.equal(case.cache.v_buffer, expected_v)
    # The write really changed something (random k differs from the random buffer).
    assert not torch.equal(case.cache.k_buffer, k_before)


def test_public_entry_defaults_scale_and_uses_cache():
    case = make_case(MIXED, n_heads=4, n_kv_heads=1, head_dim=16, seed=7)
    k_before, v_before = case.cache.k_buffer.clone(), case.cache.v_buffer.clone()
    with attn_backend("torch_native"):
        out = attention(case.q, case.k, case.v, case.cache, LAYER)
    ref = reference(case, k_before, v_before, 16**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_steps_accumulate_in_cache():
    """Prefill a request, then decode two tokens: each step must see every earlier write."""
    torch.manual_seed(0)
    case = make_case([(0, 5)], n_heads=4, n_kv_heads=2, head_dim=16, seed=11)
    cache, backend = case.cache, TorchNativeBackend()
    full_slots = torch.randperm(cache.k_buffer.shape[1])[:7]
    cache.req_to_token[cache.req_pool_indices[0], :7] = full_slots.to(torch.int32)
    ks, vs = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    qs = torch.randn(7, 4, 16)
    outs = []
    for start, stop in [(0, 5), (5, 6), (6, 7)]:
        cache.out_cache_loc = full_slots[start:stop]
        cache.seq_lens = torch.tensor([stop], dtype=torch.int32)
        cache.max_len, cache.max_q_len = stop, stop - start
        cache.seq_lens_host, cache.q_lens_host = (stop,), (stop - start,)
        outs.append(backend.forward(qs[start:stop], ks[start:stop], vs[start:stop], cache, 0, 0.25))
    dense = torch.nn.functional.scaled_dot_product_attention(
        qs.transpose(0, 1),
        ks.repeat_interleave(2, 1).transpose(0, 1),
        vs.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
        scale=0.25,
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("reqs", [MIXED, DECODE, SPECULATIVE], ids=["mixed", "decode", "spec"])
def test_contiguous_rows_match_reference(group, reqs, head_major):
    """The strided (no-gather) decode path over contiguous rows, idle rows in between."""
    case = make_case(
        reqs,
        n_heads=2 * group,
        n_kv_heads=2,
        head_dim=32,
        seed=3,
        contiguous=True,
        head_major=head_major,
    )
    assert case.cache.row_stride is not None
    assert (case.cache.k_buffer.stride(2) > case.cache.k_buffer.stride(1)) == head_major
    out, ref = run(case, 32**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def _brute_force_cost(rows, lens, call_cost):
    """Cheapest cover of the active rows by contiguous ranges, by trying every cut set."""
    items = sorted(zip(rows, lens))
    n, best = len(items), None
    for mask in range(1 << (n - 1)):
        cost, start = 0, 0
        for j in range(n):
            if j == n - 1 or mask >> j & 1:
                seg = items[start : j + 1]
                cost += (seg[-1][0] - seg[0][0] + 1) * max(x for _, x in seg) + call_cost
                start = j + 1
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("call_cost", [0, 5, 40, 10_000])
def test_row_segments_are_an_optimal_cover(call_cost):
    gen = torch.Generator().manual_seed(call_cost)
    for _ in range(30):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        rows = torch.randperm(14, generator=gen)[:n].tolist()
        lens = torch.randint(1, 60, (n,), generator=gen).tolist()
        ranges = row_segments(rows, lens, call_cost=call_cost)
        # Disjoint, ordered ranges that cover every active row with its full length.
        assert all(hi0 <= lo1 for (_, hi0, _), (lo1, _, _) in itertools.pairwise(ranges))
        for row, length in zip(rows, lens):
            (hit,) = [r for r in ranges if r[0] <= row < r[1]]
            assert hit[2] >= length
        cost = sum((hi - lo) * length + call_cost for lo, hi, length in ranges)
        assert cost == _brute_force_cost(rows, lens, call_cost)


def test_row_segments_skip_idle_rows_and_keep_dense_ones_together():
    # Two dense clusters far apart: a cheap call splits them, an expensive call does not.
    rows, lens = [0, 1, 2, 40, 41], [30, 31, 29, 30, 30]
    assert row_segments(rows, lens, call_cost=10) == [(0, 3, 31), (40, 42, 30)]
    assert row_segments(rows, lens, call_cost=10**6) == [(0, 42, 31)]


@pytest.mark.parametrize("call_cost", [0, 3, 10**6])
def test_segmented_contiguous_decode_matches_reference(monkeypatch, call_cost):
    """Decode rows of very different lengths with idle rows between them, split into
    however many SDPA calls the plan chooses, against the dense reference."""
    monkeypatch.setattr(
        torch_native, "row_segments", functools.partial(row_segments, call_cost=call_cost)
    )
    reqs = [(40, 1), (2, 1), (0, 1), (17, 1), (33, 1), (5, 1), (1, 1)]
    case = make_case(
        reqs, n_heads=4, n_kv_heads=2, head_dim=16, seed=9, contiguous=True, head_major=True
    )
    out, ref = run(case, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    plan = case.cache.plan["segments"]
    assert (len(plan.ranges) > 1) == (call_cost < 10**6)


def _alone(case, i):
    """Request `i` of `case` as the only request of its step: its queries, K/V and cache."""
    c = case.cache
    q_lens, kv_lens = c.q_lens_host, c.seq_lens_host
    lo = sum(q_lens[:i])
    hi = lo + q_lens[i]
    host_rows = c.req_pool_indices_host
    cache = dataclasses.replace(
        c,
        req_pool_indices=c.req_pool_indices[i : i + 1],
        seq_lens=c.seq_lens[i : i + 1],
        out_cache_loc=c.out_cache_loc[lo:hi],
        kv_indptr=torch.tensor([0, kv_lens[i]], dtype=torch.int32),
        qo_indptr=torch.tensor([0, q_lens[i]], dtype=torch.int32),
        max_len=kv_lens[i],
        max_q_len=q_lens[i],
        seq_lens_host=(kv_lens[i],),
        q_lens_host=(q_lens[i],),
        req_pool_indices_host=(host_rows[i],) if host_rows else (),
        plan={},
    )
    return (lo, hi), case.q[lo:hi], case.k[lo:hi], case.v[lo:hi], cache


@pytest.mark.parametrize("contiguous", [False, True], ids=["paged", "contiguous"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize(
    "reqs", [MIXED, PREFILL, DECODE, SPECULATIVE], ids=["mixed", "prefill", "decode", "spec"]
)
def test_batch_invariant_mode_attends_each_request_as_alone(reqs, group, contiguous):
    """`batch_invariant()`: each request's output is the reference's, and the same bits as
    that request's alone in its step (nothing padded to, or batched with, a neighbour)."""
    case = make_case(
        reqs, n_heads=2 * group, n_kv_heads=2, head_dim=16, seed=4, contiguous=contiguous
    )
    with batch_invariant():
        out, ref = run(case, 0.25)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        for i in range(len(reqs)):
            (lo, hi), q, k, v, cache = _alone(case, i)
            alone = TorchNativeBackend().forward(q, k, v, cache, LAYER, 0.25)
            assert torch.equal(out[lo:hi], alone), f"request {i}"
