"""Packed documents attend within their spans (no [S, S] mask), exactly as under the dense
document mask: outputs and every parameter's gradient, GQA and MLA; right-padded packed
windows too (the padding tail one more span), and through the collate's cu_seqlens."""

from itertools import pairwise

import pytest
import torch
import torch.nn.attention.varlen as varlen_module
import torch.nn.functional as F

from astrai.data.datasets import IGNORE_INDEX, collate_lm
from astrai.model import Transformer, preset
from astrai.model import documents as documents_module
from astrai.model import transformer as transformer_module
from astrai.model.documents import DocumentSpans
from astrai.model.transformer import document_mask, padded_mask


def _packed(lengths, vocab, rows=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).repeat(rows, 1)
    return ids, pos


def _dense_layout(position_ids, attention_mask):
    """The masked path the spans replace: the same documents as a [B, 1, S, S] bool mask."""
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return padded_mask(starts, torch.ones_like(position_ids))


def _outputs_and_grads(model, ids, pos):
    model.zero_grad()
    out = model(ids, position_ids=pos)
    out.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def test_spans_follow_the_position_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    layout = document_mask(pos, None)
    assert isinstance(layout, DocumentSpans)
    assert layout.spans == [[(0, 3), (3, 5), (5, 6), (6, 8)], [(0, 8)]]
    assert document_mask(pos, torch.ones_like(pos)).spans == layout.spans  # nothing padded
    assert document_mask(pos[1:], None) is None  # one document: plain causal
    padded = torch.ones_like(pos)
    padded[:, -2:] = 0
    right = document_mask(pos, padded)  # right-padded packed rows: the tail one more span
    assert isinstance(right, DocumentSpans)
    assert right.spans == [[(0, 3), (3, 5), (5, 6), (6, 8)], [(0, 6), (6, 8)]]
    left = document_mask(pos, padded.flip(-1))  # left padding keeps the dense mask
    assert isinstance(left, torch.Tensor) and left.shape == (2, 1, 8, 8)
    plain = torch.arange(8).repeat(2, 1)  # padding without packed documents: the dense mask
    assert isinstance(document_mask(plain, padded), torch.Tensor)


@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_spans_equal_the_dense_document_mask(name, monkeypatch):
    torch.manual_seed(0)
    overrides = {"q_lora_rank": None} if name == "tiny-mla" else {}
    model = Transformer(preset(name, **overrides)).float().train()
    ids, pos = _packed([7, 1, 12, 5, 9], model.config.vocab_size, rows=2)
    assert isinstance(document_mask(pos, None), DocumentSpans)
    spans_out, spans_grads = _outputs_and_grads(model, ids, pos)
    monkeypatch.setattr(transformer_module, "document_mask", _dense_layout)
    dense_out, dense_grads = _outputs_and_grads(model, ids, pos)
    torch.testing.assert_close(spans_out, dense_out, atol=1e-6, rtol=0)
    assert spans_grads.keys() == dense_grads.keys() and spans_grads
    for n, g in dense_grads.items():
        torch.testing.assert_close(spans_grads[n], g, atol=1e-6, rtol=0, msg=n)


def test_gqa_spans_equal_separate_documents(tiny_model):
    lengths = [5, 9, 3]
    ids, pos = _packed(lengths, 97)
    with torch.no_grad():
        out = tiny_model(ids, position_ids=pos)[0]
        separate = torch.cat([tiny_model(d[None])[0] for d in ids[0].split(lengths)])
    torch.testing.assert_close(out, separate, atol=1e-6, rtol=0)


def test_cu_seqlens_are_the_spans_flattened():
    spans = DocumentSpans([[(0, 3), (3, 5), (5, 8)], [(0, 6), (6, 8)]])
    cu = spans.cu_seqlens
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 8, 14, 16]
    assert DocumentSpans.from_cu_seqlens(cu, 2, 8).spans == spans.spans
    for bad in ([0, 3, 9, 16], [0, 3, 3, 8, 16], [1, 8, 16], [0, 8, 15]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            DocumentSpans.from_cu_seqlens(torch.tensor(bad, dtype=torch.int32), 2, 8)


def _packed_windows(vocab, seed=0):
    """A collated batch of three right-padded packed windows (documents of several lengths,
    a loss mask on part of each), as SFTDataset + collate_lm give them."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for lengths in ([6, 3, 9], [4, 4], [11, 2, 1, 5]):
        n = sum(lengths) + 1  # one more token: the shift
        ids = torch.randint(0, vocab, (n,), generator=g)
        pos = torch.cat([torch.arange(k) for k in lengths] + [torch.tensor([lengths[-1]])])
        keep = torch.rand(n, generator=g) < 0.6
        items.append(
            {
                "input_ids": ids[:-1],
                "labels": ids[1:].masked_fill(~keep[1:], IGNORE_INDEX),
                "loss_mask": keep[1:],
                "position_ids": pos[:-1],
            }
        )
    return collate_lm(items, pad_id=0)


def _loss_and_grads(model, batch, **forward):
    model.zero_grad()
    logits = model(batch["input_ids"], **forward)
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_padded_packed_windows_equal_the_dense_mask(name, monkeypatch):
    torch.manual_seed(0)
    overrides = {"q_lora_rank": None} if name == "tiny-mla" else {}
    model = Transformer(preset(name, **overrides)).float().train()
    batch = _packed_windows(model.config.vocab_size)
    assert not bool(batch["attention_mask"].all())  # padded rows
    pos, attn = batch["position_ids"], batch["attention_mask"]
    assert isinstance(document_mask(pos, attn), DocumentSpans)
    assert batch["cu_seqlens"].tolist() == [0, 6, 9, 18, 19, 23, 27, 38, 49, 51, 52, 57]
    runs = {
        "cu_seqlens": _loss_and_grads(
            model, batch, position_ids=pos, cu_seqlens=batch["cu_seqlens"]
        ),
        "positions": _loss_and_grads(model, batch, position_ids=pos, attention_mask=attn),
    }
    # the dense path these replace: a [B, 1, S, S] mask of documents and padding
    monkeypatch.setattr(
        transformer_module, "document_mask", lambda p, a: padded_mask(_starts(p), a)
    )
    dense_loss, dense_grads = _loss_and_grads(model, batch, position_ids=pos, attention_mask=attn)
    for loss, grads in runs.values():
        torch.testing.assert_close(loss, dense_loss, atol=1e-6, rtol=0)
        assert grads.keys() == dense_grads.keys() and grads
        for n, g in dense_grads.items():
            torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=0, msg=n)


def _starts(position_ids):
    starts = torch.zeros_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """flash varlen's contract ([T, heads, dim], causal within each cu_seqlens segment), by
    plain SDPA per segment: the CPU stand-in that checks the varlen route's layout."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    cuts = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in pairwise(cuts))
    parts = [
        F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        ).transpose(0, 1)
        for a, b in pairwise(cuts)
    ]
    return torch.cat(parts)


def test_varlen_route_takes_the_flattened_layout(tiny_model, monkeypatch):
    batch = _packed_windows(tiny_model.config.vocab_size, seed=1)
    pos, cu = batch["position_ids"], batch["cu_seqlens"]
    with torch.no_grad():
        loop = tiny_model(batch["input_ids"], position_ids=pos, cu_seqlens=cu)
        monkeypatch.setattr(documents_module, "_varlen_fits", lambda q, v: True)
        monkeypatch.setattr(varlen_module, "varlen_attn", _reference_varlen)
        varlen = tiny_model(batch["input_ids"], position_ids=pos, cu_seqlens=cu)
    torch.testing.assert_close(varlen, loop, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.backends.cuda.is_flash_attention_available()),
    reason="needs a CUDA device with flash attention (the varlen route)",
)
def test_flash_varlen_route_equals_the_span_loop_on_cuda():
    """On a GPU in bf16 the spans go through flash varlen in one call: outputs and input
    gradients within bf16's rounding of the per-span SDPA loop (run by `make gpu-check`)."""
    spans = DocumentSpans([[(0, 5), (5, 12), (12, 16)], [(0, 9), (9, 16)]])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 16, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    fast = spans.attend(q, k, v, scale=0.125)
    (fast.float() ** 2).sum().backward()
    fast_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    loop = spans.attend(q.float(), k.float(), v.float(), scale=0.125)  # fp32: the span loop
    (loop**2).sum().backward()
    torch.testing.assert_close(fast.float(), loop, atol=3e-2, rtol=3e-2)
    for got, t in zip(fast_grads, (q, k, v)):
        torch.testing.assert_close(got.float(), t.grad.float(), atol=1e-1, rtol=5e-2)
