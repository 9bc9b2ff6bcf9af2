"""`astrai.extension.invariance`: inside `batch_invariant()`, a row's product (and its LoRA
delta) has the same bits whatever the other rows of the call; outside, nothing changes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from astrai.extension import batch_invariant, batch_invariant_enabled, invariant_rows, linear
from astrai.extension.invariance import INVARIANT_ROWS, in_row_blocks
from astrai.extension.linear import prepack_weight
from astrai.extension.lora import LoRABatch, lora_delta

ROW_COUNTS = (1, 2, 3, 5, 8, 15, 16, 17, 31, 40, 100)


def _routes(weight: torch.Tensor) -> dict:
    """Every way `linear` may compute a product on this CPU."""
    routes = {
        "aten": lambda x: linear(x, weight, small_on_aten=True),  # tiny products: F.linear
        "default": lambda x: linear(x, weight),  # oneDNN for fp32 CPU inference
    }
    packed = prepack_weight(weight, 32)
    if packed is not None:
        routes["prepacked"] = lambda x: linear(x, None, prepacked=packed)
    return routes


@pytest.mark.parametrize(("k", "n"), [(64, 128), (64, 384), (256, 704), (512, 1536)])
def test_a_rows_product_does_not_depend_on_the_other_rows(k, n):
    gen = torch.Generator().manual_seed(k + n)
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(max(ROW_COUNTS), k, generator=gen)
    with torch.inference_mode(), batch_invariant():
        for name, product in _routes(weight).items():
            full = product(x)
            torch.testing.assert_close(full, F.linear(x, weight), atol=1e-4, rtol=1e-4)
            for m in ROW_COUNTS:
                # the last row of m rows, and the same row alone at the front of a call
                assert torch.equal(product(x[:m]), full[:m]), f"{name}: first {m} rows"
                assert torch.equal(product(x[m - 1 : m])[0], full[m - 1]), f"{name}: row {m - 1}"


def test_outside_the_scope_linear_is_unchanged():
    weight = torch.randn(384, 64)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(linear(x, weight, small_on_aten=True), F.linear(x, weight))


def test_in_row_blocks_calls_the_product_on_blocks_of_the_fixed_size():
    seen = []

    def product(z: torch.Tensor) -> torch.Tensor:
        seen.append(z.shape[0])
        return z * 2

    x = torch.arange(2 * 19 * 3, dtype=torch.float32).view(2, 19, 3)
    out = in_row_blocks(x, product)
    assert torch.equal(out, x * 2) and out.shape == x.shape
    assert seen == [INVARIANT_ROWS] * 3  # 38 rows: two full blocks and a padded one
    seen.clear()
    assert in_row_blocks(torch.zeros(0, 3), product).shape == (0, 3)


def test_the_scope_is_per_thread_and_nests():
    """The engine's runner enters it on its own thread: a training forward on another
    thread is unaffected."""
    other: list[bool] = []
    with batch_invariant():
        assert batch_invariant_enabled()
        t = threading.Thread(target=lambda: other.append(batch_invariant_enabled()))
        t.start()
        t.join()
        with batch_invariant(False):
            assert not batch_invariant_enabled()
        assert batch_invariant_enabled()
    assert not batch_invariant_enabled() and other == [False]


def test_a_tokens_lora_delta_does_not_depend_on_the_other_tokens():
    """Per slot, its tokens' two products in fixed blocks: the same bits alone (every token
    on one adapter) as beside tokens of another adapter and of the base model."""
    gen = torch.Generator().manual_seed(3)
    rank, slots, d_in, d_out = 4, 3, 64, 96
    a = torch.randn(slots * rank, d_in, generator=gen)
    bt = torch.randn(slots * rank, d_out, generator=gen)
    scalings = torch.tensor([2.0, 0.5, 1.0])
    x = torch.randn(23, d_in, generator=gen)
    token_slots = [1, -1, 0, 1, 1, 2, -1, 0] + [1] * 15

    def delta(rows: list[int]) -> torch.Tensor:
        out = torch.zeros(len(rows), d_out)
        batch = LoRABatch.build([token_slots[r] for r in rows], scalings, rank, x.device)
        lora_delta(x[rows], out, a, bt, rank, batch)
        return out

    with torch.inference_mode(), batch_invariant():
        together = delta(list(range(len(token_slots))))
        ones = [r for r, s in enumerate(token_slots) if s == 1]
        assert torch.equal(delta(ones), together[ones])  # all on slot 1: the `single` case
        assert torch.equal(delta([3]), together[[3]])
    expected = torch.stack(
        [
            (x[t] @ a[s * rank : (s + 1) * rank].T @ bt[s * rank : (s + 1) * rank]) * scalings[s]
            if s >= 0
            else torch.zeros(d_out)
            for t, s in enumerate(token_slots)
        ]
    )
    torch.testing.assert_close(together, expected, atol=1e-4, rtol=1e-4)


def test_invariant_rows_blocks_the_first_axis_only_inside_the_scope():
    seen = []

    def product(z: torch.Tensor) -> torch.Tensor:
        seen.append(z.shape[0])
        return torch.einsum("thn,hnr->thr", z, w)

    w = torch.randn(2, 8, 4)
    x = torch.randn(21, 2, 8)
    plain = invariant_rows(x, product)
    assert seen == [21]
    seen.clear()
    with batch_invariant():
        blocked = invariant_rows(x, product)
        assert invariant_rows(x[:0], product).shape == (0, 2, 4)
    assert seen[:2] == [INVARIANT_ROWS, INVARIANT_ROWS] and blocked.shape == (21, 2, 4)
    torch.testing.assert_close(blocked, plain)
