"""Packed documents attend within their spans (no [S, S] mask), exactly as under the dense
document mask: outputs and every parameter's gradient, GQA and MLA."""

import pytest
import torch

from astrai.model import Transformer, preset
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
    mask = document_mask(pos, padded)  # padding keeps the dense mask
    assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 8, 8)


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
