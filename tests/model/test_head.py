"""The chunked LM head (`astrai.model.head`) against the dense computation in plain torch:
full logits, `log_softmax`, `cross_entropy` (with label smoothing) and the entropy, values and
every gradient (the entropy's too: GRPO's entropy bonus) to 1e-6 in fp32, and `gradcheck` in
float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from astrai.data.datasets import IGNORE_INDEX
from astrai.model import LoRAConfig, ModelConfig, Transformer, inject_lora
from astrai.model.head import IGNORE_INDEX as HEAD_IGNORE
from astrai.model.head import HeadSettings, chunked_token_scores
from astrai.vocab import VocabShard
from tests.chunk_parts import assert_close_1e6, assert_grads_close
from tests.tiny_parts import TINY_SHAPE

TOL = dict(rtol=1e-6, atol=1e-6)


def test_the_head_skips_the_datasets_ignore_index():
    assert HEAD_IGNORE == IGNORE_INDEX


def _dense(x, w, targets, temperature):
    logits = (x @ w.T).float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logits, logp.gather(1, targets[:, None])[:, 0], logp


@pytest.mark.parametrize(
    "chunk,vchunk,temperature", [(1024, 8192, 1.0), (3, 7, 0.7), (5, 64, 1.3), (1, 1, 2.0)]
)
def test_chunked_scores_equal_the_dense_ones_with_gradients(chunk, vchunk, temperature):
    """Uneven blocks (13 tokens by 3 / 5, 50 rows by 7 / 64), temperature != 1: log-probs,
    entropy, label smoothing's term and the gradients of hidden and head weight through all
    but the entropy (its gradient: the next test)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 13, 8, 50
    x = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    coef_lp, coef_sm = torch.randn(n, generator=g), torch.randn(n, generator=g)
    settings = HeadSettings(chunk, vchunk, temperature, entropy=True, label_smoothing=True)
    got = chunked_token_scores([x], [w], t, settings)
    (got.logp * coef_lp + got.smooth * coef_sm).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None

    _, logp, full = _dense(x, w, t, temperature)
    smooth = -full.mean(-1)
    entropy = -(full.exp() * full).sum(-1)
    (logp * coef_lp + smooth * coef_sm).sum().backward()
    torch.testing.assert_close(got.logp, logp, **TOL)
    torch.testing.assert_close(got.smooth, smooth, **TOL)
    torch.testing.assert_close(got.entropy, entropy.detach(), **TOL)
    assert got.entropy.requires_grad  # GRPO's entropy bonus trains through it
    torch.testing.assert_close(gx, x.grad, **TOL)
    torch.testing.assert_close(gw, w.grad, **TOL)


@pytest.mark.parametrize(
    "chunk,vchunk,temperature", [(1024, 8192, 1.0), (3, 7, 0.7), (5, 64, 1.3), (1, 1, 2.0)]
)
def test_the_entropy_gradient_equals_autograd_in_float64(chunk, vchunk, temperature):
    """The entropy's gradient (``-p * (log p + H)`` per block in the backward) against
    autograd through ``-(p * log p).sum()`` in float64, to 1e-6 of the gradient's scale: fp32
    autograd itself is that far from float64 here (its largest entries are about 5)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 13, 8, 50
    x = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    settings = HeadSettings(chunk, vchunk, temperature, entropy=True)
    got = chunked_token_scores([x], [w], t, settings)
    grads = torch.autograd.grad((got.entropy * coef).sum() + got.logp.sum(), (x, w))
    xd, wd = (p.detach().double().requires_grad_(True) for p in (x, w))
    full = torch.log_softmax((xd @ wd.T) / temperature, -1)
    entropy = -(full.exp() * full).sum(-1)
    picked = full.gather(1, t[:, None])[:, 0]
    refs = torch.autograd.grad((entropy * coef.double()).sum() + picked.sum(), (xd, wd))
    for mine, ref in zip(grads, refs):
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(mine.double(), ref, rtol=0.0, atol=1e-6 * scale)


def test_label_smoothed_cross_entropy_from_the_scores():
    """`(1 - eps) * nll + eps * smooth` is torch's `cross_entropy(label_smoothing=eps)`."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 6, generator=g), torch.randn(31, 6, generator=g)
    t = torch.randint(0, 31, (9,), generator=g)
    got = chunked_token_scores([x], [w], t, HeadSettings(4, 10, label_smoothing=True))
    eps = 0.1
    mine = ((1 - eps) * -got.logp + eps * got.smooth).mean()
    torch.testing.assert_close(mine, F.cross_entropy(x @ w.T, t, label_smoothing=eps), **TOL)


def test_two_product_terms_are_the_sum_of_their_logits():
    """A LoRA-wrapped head's two pairs: logits `x @ w.T + a @ b.T`, gradients of all four."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 5, generator=g), torch.randn(23, 5, generator=g)
    a, b = torch.randn(7, 2, generator=g), torch.randn(23, 2, generator=g)
    for p in (x, w, a, b):
        p.requires_grad_(True)
    t = torch.randint(0, 23, (7,), generator=g)
    got = chunked_token_scores([x, a], [w, b], t, HeadSettings(3, 6, 0.9)).logp
    grads = torch.autograd.grad(got.sum(), (x, w, a, b))
    want = torch.log_softmax((x @ w.T + a @ b.T) / 0.9, -1).gather(1, t[:, None])[:, 0]
    torch.testing.assert_close(got, want, **TOL)
    for mine, ref in zip(grads, torch.autograd.grad(want.sum(), (x, w, a, b))):
        torch.testing.assert_close(mine, ref, **TOL)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (5,), generator=g)
    settings = HeadSettings(2, 4, 1.7, entropy=True, label_smoothing=True, dtype=torch.float64)

    def f(x, w):
        out = chunked_token_scores([x], [w], t, settings)
        return out.logp, out.smooth, out.entropy

    assert torch.autograd.gradcheck(f, (x, w))


def _tiny(tie: bool = False, vocab: int = 97) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab, tie_word_embeddings=tie, **TINY_SHAPE)
    torch.manual_seed(0)
    return Transformer(cfg)


def _targets(ids: torch.Tensor) -> torch.Tensor:
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = IGNORE_INDEX
    targets[0, :3] = IGNORE_INDEX  # a prompt
    return targets


def _dense_model_scores(model, ids, targets, temperature):
    logits = model(ids).float() / temperature
    keep = targets != IGNORE_INDEX
    nll = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return -nll.view_as(targets), keep


@pytest.mark.parametrize("tie", [False, True])
def test_forward_with_targets_equals_the_dense_logits_for_every_parameter(tie):
    """`Transformer.forward(ids, targets=, head=)`: log-probs at the targeted positions (0 at
    ignored ones) and the gradient of every parameter (a tied head included)."""
    model = _tiny(tie)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    targets = _targets(ids)
    weights = torch.randn(2, 11, generator=torch.Generator().manual_seed(5))
    got = model(ids, targets=targets, head=HeadSettings(4, 10, temperature=0.8))
    (got.logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want, keep = _dense_model_scores(model, ids, targets, 0.8)
    (want * weights).sum().backward()
    assert_close_1e6(got.logp, want, "logp")
    assert bool((got.logp[~keep] == 0).all())
    assert got.entropy is None and got.smooth is None
    assert_grads_close(grads, model)


def test_forward_with_targets_through_a_lora_head():
    model = _tiny()
    inject_lora(model, LoRAConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():  # B starts at zero: make the low-rank term count
        model.lm_head.lora_B.weight.normal_(0, 0.3)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    targets = _targets(ids)
    got = model(ids, targets=targets, head=HeadSettings(5, 16)).logp
    got.sum().backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert any("lm_head.lora_A" in n for n, _ in trained)
    grads = {n: p.grad.clone() for n, p in trained}
    model.zero_grad()
    want, _ = _dense_model_scores(model, ids, targets, 1.0)
    want.sum().backward()
    assert_close_1e6(got, want, "logp")
    assert_grads_close(grads, model)


def test_targets_of_another_shape_are_refused():
    model = _tiny()
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 3, dtype=torch.long))


def test_chunk_sizes_below_one_are_refused():
    with pytest.raises(ValueError, match="chunk sizes"):
        HeadSettings(chunk_size=0)


# ---------------------------------------------------------------------- a vocabulary split
class _Split(VocabShard):
    """Half the head rows per process, reduced over gloo (what a vocabulary-parallel head
    does over its tensor-parallel group)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t


def _split_case():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(11, 6, generator=g), torch.randn(40, 6, generator=g)
    return x, w, torch.randint(0, 40, (11,), generator=g), torch.randn(3, 11, generator=g)


def _split_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    x, w, t, coef = _split_case()
    x.requires_grad_(True)
    local = w[rank * 20 : (rank + 1) * 20].clone().requires_grad_(True)
    settings = HeadSettings(4, 6, 0.8, entropy=True, label_smoothing=True)
    got = chunked_token_scores([x], [local], t, settings, _Split(rank * 20))
    (got.logp * coef[0] + got.smooth * coef[1] + got.entropy * coef[2]).sum().backward()
    torch.save(
        {"scores": [s.detach() for s in got], "gx": x.grad, "gw": local.grad}, f"{out}/{rank}.pt"
    )
    dist.destroy_process_group()


def test_a_vocabulary_split_over_two_processes_equals_the_whole(tmp_path):
    """Every reduction goes through the VocabShard: two processes holding 20 head rows each
    give the whole vocabulary's scores, the hidden's whole gradient and each its rows'."""
    torch.multiprocessing.spawn(
        _split_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    x, w, t, coef = _split_case()
    x.requires_grad_(True)
    w.requires_grad_(True)
    logp, full = _dense(x, w, t, 0.8)[1:]
    smooth, entropy = -full.mean(-1), -(full.exp() * full).sum(-1)
    (logp * coef[0] + smooth * coef[1] + entropy * coef[2]).sum().backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        for mine, ref in zip(got["scores"], (logp, entropy, smooth)):
            assert_close_1e6(mine, ref.detach(), "scores")
        assert_close_1e6(got["gx"], x.grad, "hidden gradient")
        assert_close_1e6(got["gw"], w.grad[rank * 20 : (rank + 1) * 20], "head rows' gradient")
