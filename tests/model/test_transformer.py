import pytest
import torch

from astrai.model import Transformer
from astrai.model.rope import apply_rotary


def test_packed_documents_do_not_attend_across_boundaries(tiny_model):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in (5, 9, 3)]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        out = tiny_model(packed, position_ids=positions)
        separate = torch.cat([tiny_model(d[None])[0] for d in docs])
        leaky = tiny_model(packed)  # plain causal attention crosses boundaries
    torch.testing.assert_close(out[0], separate, atol=1e-5, rtol=0)
    assert not torch.allclose(leaky[0, 5:], separate[5:], atol=1e-3)


def test_right_padding_does_not_change_real_tokens(tiny_model):
    x = torch.randint(0, 97, (1, 7))
    padded = torch.cat([x, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    mask = torch.tensor([[1] * 7 + [0] * 4])
    with torch.no_grad():
        ref = tiny_model(x)
        out = tiny_model(padded, attention_mask=mask)
    torch.testing.assert_close(out[:, :7], ref, atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()


def test_left_padding_with_shifted_positions(tiny_model):
    x = torch.randint(0, 97, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 6])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = tiny_model(x)
        out = tiny_model(padded, position_ids=positions, attention_mask=mask)
    torch.testing.assert_close(out[:, 3:], ref, atol=1e-5, rtol=0)


def test_gradient_checkpointing_gives_same_gradients(tiny_config):
    torch.manual_seed(0)
    a = Transformer(tiny_config).train()
    b = Transformer(tiny_config).train()
    b.load_state_dict(a.state_dict())
    b.gradient_checkpointing = True
    x = torch.randint(0, 97, (2, 16))
    for m in (a, b):
        m(x).logsumexp(-1).mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=name)


def test_tied_head_shares_storage_and_counts_once():
    from astrai.model import preset

    cfg = preset("tiny")
    model = Transformer(cfg)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_parameters() == cfg.num_parameters()


def test_rotary_matches_rotate_half_reference():
    x = torch.randn(3, 5, 2, 8)
    cos, sin = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    c, s = torch.cat([cos, cos], -1)[:, :, None], torch.cat([sin, sin], -1)[:, :, None]
    rotate_half = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x * c + rotate_half * s)


def test_positions_past_the_table_grow_it(tiny_model):
    pos = torch.tensor([[0, 1, 5000]])
    with torch.no_grad():
        out = tiny_model(torch.tensor([[1, 2, 3]]), position_ids=pos)
    assert torch.isfinite(out).all()


def test_bad_shapes_are_named(tiny_model):
    with pytest.raises(ValueError, match="input_ids"):
        tiny_model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        tiny_model(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.zeros(1, 3))
