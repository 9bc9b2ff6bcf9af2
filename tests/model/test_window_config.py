"""Sliding-window attention: config checks, and the training paths (dense, padded, packed
documents) against plain masked softmax attention."""

import math

import pytest
import torch

from astrai.model import ModelConfig
from astrai.model.config import ConfigError
from astrai.model.documents import DocumentSpans, training_attention

BASE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)


def reference(q, k, v, allowed):
    """Softmax attention written out, `allowed` a boolean `[S, S]` (or `[B, 1, S, S]`)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def window_allowed(spans, seq, window):
    allowed = torch.zeros(seq, seq, dtype=torch.bool)
    for start, end in spans:
        for i in range(start, end):
            allowed[i, max(start, i - window + 1) : i + 1] = True
    return allowed


def qkv(batch=1, seq=20):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 2, seq, 8, generator=g) for _ in range(3)]


def test_layer_types_choose_the_windowed_layers():
    config = ModelConfig(
        **BASE, sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    )
    assert [config.layer_window(i) for i in range(2)] == [None, 4]
    assert ModelConfig(**BASE, sliding_window=4).layer_window(0) == 4
    assert ModelConfig(**BASE).layer_window(1) is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (dict(sliding_window=0), "sliding_window"),
        (dict(sliding_window=4, layer_types=["sliding_attention"]), "layer_types"),
        (dict(sliding_window=4, layer_types=["local", "global"]), "layer_types"),
        (dict(layer_types=["sliding_attention"] * 2), "layer_types"),
    ],
)
def test_bad_window_fields_name_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**BASE, **extra)


def test_dense_window_equals_the_written_out_mask():
    q, k, v = qkv()
    got = training_attention(q, k, v, None, scale=8**-0.5, window=5)
    torch.testing.assert_close(got, reference(q, k, v, window_allowed([(0, 20)], 20, 5)))
    full = training_attention(q, k, v, None, scale=8**-0.5)
    assert not torch.allclose(got, full)  # the window changes the result


def test_padding_mask_combines_with_the_window():
    q, k, v = qkv()
    pad = torch.ones(1, 1, 20, 20, dtype=torch.bool).tril()
    pad[..., :3] = False  # left padding: nobody sees the first three keys
    pad[..., torch.arange(3), torch.arange(3)] = True
    got = training_attention(q, k, v, pad, scale=8**-0.5, window=6)
    allowed = pad & window_allowed([(0, 20)], 20, 6)
    torch.testing.assert_close(got, reference(q, k, v, allowed))


def test_packed_documents_combine_spans_with_the_window():
    spans = [(0, 9), (9, 12), (12, 20)]
    q, k, v = qkv()
    got = DocumentSpans([spans]).attend(q, k, v, scale=8**-0.5, window=4)
    torch.testing.assert_close(got, reference(q, k, v, window_allowed(spans, 20, 4)))
