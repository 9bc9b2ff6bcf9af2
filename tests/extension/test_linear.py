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
