"""`astrai.extension.linear`: oneDNN for fp32 CPU inference, `F.linear` everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from astrai.extension import linear, onednn_linear_enabled
from astrai.extension.linear import ONEDNN_MIN_MACS, last_level_cache_bytes
from astrai.model import layers, preset_model
from astrai.model.layers import Linear, mark_cache_resident


def _ops(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48), (1, 48), (0, 48), (200, 48), (3, 100, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear_in_inference(shape, bias):
    """Small products (F.linear) and large ones (oneDNN: 200 x 48 x 192 > 2**20) alike."""
    gen = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(shape, generator=gen), torch.randn(192, 48, generator=gen)
    b = torch.randn(192, generator=gen) if bias else None
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.shape == (*shape[:-1], 192)
    torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_large_inference_products_take_onednn_and_training_keeps_aten():
    x, w = torch.randn(64, 256), torch.randn(128, 256, requires_grad=True)
    assert ONEDNN_MIN_MACS < 64 * 256 * 128
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" in _ops(lambda: linear(x, w))
    ops = _ops(lambda: linear(x, w))
    assert "mkldnn::_linear_pointwise" not in ops and "aten::linear" in ops


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_tiny_products_of_cache_resident_weights_stay_on_aten():
    """oneDNN's fixed per-call cost loses to F.linear on one decoding row of a small cached
    layer; streamed from memory it does not, so only `small_on_aten` routes them."""
    x, w = torch.randn(1, 256), torch.randn(704, 256)
    assert ONEDNN_MIN_MACS >= 256 * 704
    with torch.no_grad():
        cached = _ops(lambda: linear(x, w, small_on_aten=True))
        streamed = _ops(lambda: linear(x, w))
        big = _ops(lambda: linear(torch.randn(64, 256), w, small_on_aten=True))
    assert "mkldnn::_linear_pointwise" not in cached and "aten::linear" in cached
    assert "mkldnn::_linear_pointwise" in streamed
    assert "mkldnn::_linear_pointwise" in big  # 64 x 256 x 704 > ONEDNN_MIN_MACS


def test_last_level_cache_size_from_sysfs(tmp_path):
    for name, size in (("index0", "48K"), ("index2", "1024K"), ("index3", "32768K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    assert last_level_cache_bytes(tmp_path / "missing") == 8 << 20  # unknown: a default


def test_models_are_marked_cache_resident_by_size(monkeypatch):
    model = preset_model("tiny", device="cpu")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    monkeypatch.setattr(layers, "last_level_cache_bytes", lambda: 2 * nbytes)
    assert mark_cache_resident(model) and all(m.cache_resident for m in linears)
    monkeypatch.setattr(layers, "last_level_cache_bytes", lambda: 2 * nbytes - 2)
    assert not mark_cache_resident(model) and not any(m.cache_resident for m in linears)


def test_gradients_flow_as_with_f_linear():
    layer = Linear(8, 3)
    x = torch.randn(5, 8, requires_grad=True)
    layer(x).square().sum().backward()
    ref = torch.nn.Linear(8, 3)
    ref.load_state_dict(layer.state_dict())
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).square().sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(x.grad, x_ref.grad)


def test_half_precision_is_plain_f_linear():
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows", [1, 16, 48, 300])
def test_a_prepacked_weight_gives_the_plain_weights_product(rows):
    """oneDNN's blocked layout made once: the same product at every size (bit for bit from
    16 rows up on this machine; 1 row may take another kernel), with or without a bias."""
    from astrai.extension.linear import prepack_weight

    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 256, generator=gen), torch.randn(768, 256, generator=gen)
    b = torch.randn(768, generator=gen)
    packed = prepack_weight(w, 16)
    assert packed is not None and tuple(packed.shape) == (768, 256)
    with torch.inference_mode():
        for bias in (None, b):
            got = linear(x, None, bias, prepacked=packed)
            torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(got, linear(x, w, bias), atol=1e-4, rtol=1e-5)


def test_nothing_is_prepacked_where_onednn_does_not_serve():
    from astrai.extension.linear import prepack_weight

    assert prepack_weight(torch.randn(8, 4, dtype=torch.bfloat16), 16) is None
    assert prepack_weight(torch.randn(8, 4, dtype=torch.float64), 16) is None


def _onednn_rows(fn) -> set[int]:
    """The row counts of the oneDNN products that `fn` ran."""
    with profile(record_shapes=True) as prof:
        fn()
    return {e.input_shapes[0][0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"}


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_onednn_products_run_at_a_bounded_set_of_row_counts():
    """oneDNN compiles and caches a primitive per product shape (#44: a server's RSS grew
    with every new row count); counts from 1 to 700 run at one of `ROW_BUCKETS` (padded)
    or a multiple of `ROW_CHUNK`, the plain weight and the prepacked one alike, with
    F.linear's result."""
    from astrai.extension.linear import ROW_BUCKETS, ROW_CHUNK, prepack_weight, row_bucket

    assert len(ROW_BUCKETS) == 48 and all(row_bucket(n) in ROW_BUCKETS for n in range(1, 257))
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    packed = prepack_weight(w, 16)
    rows = [1, 7, 16, 17, 21, 33, 57, 100, 129, 255, 256, 257, 300, 513, 700]
    xs = [torch.randn(n, 64, generator=gen) for n in rows]

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [linear(x, w, b) for x in xs] + [
                linear(x, None, b, prepacked=packed) for x in xs
            ]

    seen = _onednn_rows(run)
    allowed = set(ROW_BUCKETS) | {ROW_CHUNK * k for k in range(1, 4)}
    assert seen <= allowed, sorted(seen - allowed)[:10]
    outs = run()
    for x, plain, pre in zip(xs, outs[: len(xs)], outs[len(xs) :]):
        ref = F.linear(x, w, b)
        assert plain.shape == pre.shape == ref.shape
        torch.testing.assert_close(plain, ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(pre, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_padding_and_chunks_keep_batched_shapes():
    """[B, S, H] inputs of padded (17 rows) and split (3 x 100 > ROW_CHUNK) sizes."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(80, 32, generator=gen)
    for shape in [(1, 17, 32), (3, 100, 32), (2, 1, 32)]:
        x = torch.randn(shape, generator=gen)
        with torch.inference_mode():
            out = linear(x, w)
        assert out.shape == (*shape[:-1], 80) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


RSS_CHILD = """
import torch
from astrai.extension.linear import linear, prepack_weight

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

torch.set_num_threads(1)
weights = [torch.randn(o, i) for o, i in [(256, 128), (128, 256), (512, 128)]]
packs = [prepack_weight(w, 32) for w in weights]
with torch.inference_mode():
    linear(torch.randn(300, 128), None, prepacked=packs[0])  # oneDNN's own start-up
    before = rss()
    for rows in range(1, 513):
        for w, p in zip(weights, packs):
            linear(torch.randn(rows, w.shape[1]), None, prepacked=p)
print(rss() - before)
"""


@pytest.mark.slow  # a fresh process: ~1500 products, a few seconds
@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_memory_stays_bounded_over_many_row_counts():
    """The owner of #44's growth, measured: 512 row counts through 3 weights grew a process
    by ~700 MB (0.6 MB per cached primitive) before the buckets, ~85 MB with them."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", RSS_CHILD], capture_output=True, text=True, timeout=300, check=True
    )
    grown_mib = float(out.stdout.split()[-1])
    assert grown_mib < 200, f"RSS grew {grown_mib:.0f} MiB over 512 row counts"
