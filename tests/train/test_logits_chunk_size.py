"""`strategy.logits_chunk_size`: every strategy's loss and every parameter's gradient on the
chunked LM head (`astrai.model.head`, 5 tokens per chunk: uneven blocks) equal the dense path's
(`logits_chunk_size=None`, the full logits) to 1e-6 in fp32: pretrain (with label smoothing),
SFT (packed documents), DPO (reference copy, LD-weighted), a reference-free one (CPO, SimPO),
ORPO, KTO, and GRPO with temperature != 1, an entropy mask and the KL term; and a chunk size
< 1 is refused, by name, before the model is built."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from grpo_helpers import FakeResult, make_grpo, prompt_data

from astrai.data import collate_unpaired
from astrai.data.datasets import IGNORE_INDEX, collate_preference
from astrai.likelihood import ChunkedHead, DenseHead
from astrai.model import ModelConfig, Transformer
from astrai.train.strategies.cpo import CPOModule
from astrai.train.strategies.dpo import DPOModule
from astrai.train.strategies.kto import KTOModule
from astrai.train.strategies.orpo import ORPOModule
from astrai.train.strategies.pretrain import PretrainModule
from astrai.train.strategies.sft import SFTModule
from tests.chunk_parts import assert_close_1e6
from tests.tiny_parts import TINY_SHAPE

VOCAB = 97
CHUNK = 5


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=VOCAB, **TINY_SHAPE))


def _perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Move the policy off its reference copy (taken when the module was built)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _loss_and_grads(module: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict, dict]:
    loss, metrics = module.compute_loss(batch)
    loss.backward()
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    return loss.detach(), metrics, grads


def _compare(make: Callable[..., Any], batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Build the module twice (chunked, dense) on equal weights; equal loss, metrics and
    gradients of every parameter; the chunked run's metrics."""
    chunked, dense = make(logits_chunk_size=CHUNK), make(logits_chunk_size=None)
    assert isinstance(chunked.head, ChunkedHead) and isinstance(dense.head, DenseHead)
    for module in (chunked, dense):
        _perturb(module.model)
    loss_c, metrics_c, grads_c = _loss_and_grads(chunked, batch)
    loss_d, metrics_d, grads_d = _loss_and_grads(dense, batch)
    assert_close_1e6(loss_c, loss_d, "loss")
    assert metrics_c.keys() == metrics_d.keys()
    for key in metrics_c:
        assert_close_1e6(metrics_c[key].float(), metrics_d[key].float(), key)
    assert grads_c.keys() == grads_d.keys() and grads_c
    for name, g in grads_d.items():
        assert g is not None and grads_c[name] is not None, name
        assert float(g.abs().max()) > 0, name  # every parameter takes part
        assert_close_1e6(grads_c[name], g, name)
    return metrics_c


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- pretrain, SFT
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_pretrain(smoothing):
    ids = _ids(26, 0).view(2, 13)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    base = _model()

    def make(**kw):
        return PretrainModule(model=copy.deepcopy(base), label_smoothing=smoothing, **kw)

    _compare(make, {"input_ids": ids, "labels": labels})


def test_sft_packed_documents():
    ids = _ids(24, 1).view(2, 12)
    labels = torch.roll(ids, -1, 1)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 3:7] = loss_mask[:, 9:11] = True
    labels = labels.masked_fill(~loss_mask, IGNORE_INDEX)
    positions = torch.cat([torch.arange(8), torch.arange(4)]).expand(2, 12)
    batch = {"input_ids": ids, "labels": labels, "loss_mask": loss_mask, "position_ids": positions}
    base = _model()
    _compare(lambda **kw: SFTModule(model=copy.deepcopy(base), **kw), batch)


# ---------------------------------------------------------------------- preference
def _preference_batch() -> dict[str, torch.Tensor]:
    items = []
    for i, (p, c, r) in enumerate([(4, 5, 3), (3, 2, 6), (5, 4, 4)]):
        prompt = _ids(p, 10 + i).tolist()
        item = {}
        for side, n, seed in (("chosen", c, 20 + i), ("rejected", r, 30 + i)):
            ids = torch.tensor(prompt + _ids(n, seed).tolist())
            response = torch.tensor([False] * p + [True] * n)
            item[f"{side}_input_ids"] = ids[:-1]
            item[f"{side}_labels"] = ids[1:].masked_fill(~response[1:], IGNORE_INDEX)
            item[f"{side}_loss_mask"] = response[1:]
            item[f"{side}_position_ids"] = torch.arange(len(ids) - 1)
        items.append(item)
    return collate_preference(items, pad_id=0)


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "sigmoid", "ld_alpha": 0.5, "rpo_alpha": 1.0},
        {"loss_type": "sigmoid", "padding_free": True},
    ],
    ids=["sigmoid", "ld_rpo", "padding_free"],
)
def test_dpo(options):
    base = _model()
    make = functools.partial(DPOModule, beta=0.1, **options)
    _compare(lambda **kw: make(model=copy.deepcopy(base), **kw), _preference_batch())


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_reference_free_cpo_and_simpo(loss_type):
    base = _model()
    make = functools.partial(CPOModule, loss_type=loss_type, beta=0.5, cpo_alpha=1.0)
    _compare(lambda **kw: make(model=copy.deepcopy(base), **kw), _preference_batch())


def test_orpo():
    base = _model()
    make = functools.partial(ORPOModule, beta=0.2)
    _compare(lambda **kw: make(model=copy.deepcopy(base), **kw), _preference_batch())


def test_kto():
    items = [
        {
            "prompt_ids": _ids(3 + i, 40 + i),
            "completion_ids": _ids(2 + 2 * i, 50 + i),
            "completion_mask": torch.ones(2 + 2 * i, dtype=torch.bool),
            "label": torch.tensor(i % 2 == 0),
        }
        for i in range(4)
    ]
    base = _model()
    _compare(
        lambda **kw: KTOModule(model=copy.deepcopy(base), beta=0.1, **kw), collate_unpaired(items)
    )


# ---------------------------------------------------------------------- GRPO
@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-chunk"))


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_grpo_temperature_entropy_mask_and_kl(prompt_setup, monkeypatch, entropy_coef):
    """Fixed off-policy completions; temperature 0.7, the top half of tokens by entropy,
    kl_coef 0.1, with and without TRL's entropy bonus (its gradient goes through each head's
    own entropy backward): loss, kl, entropy, clip ratios and every gradient of the two paths
    agree."""
    root, tok = prompt_setup
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    texts = ["The answer is 5.", "The answer is 6.", "5", "x", "12", "The answer is 12.", "1", "2"]
    completions = [tok.encode(t) for t in texts]
    gen = torch.Generator().manual_seed(1)
    old = [(-3 * torch.rand(len(c), generator=gen)).tolist() for c in completions]
    options = dict(
        temperature=0.7,
        top_entropy_quantile=0.5,
        kl_coef=0.1,
        loss_type="grpo",
        entropy_coef=entropy_coef,
    )

    def make(**kw):
        module = make_grpo(root, tok, **options, **kw)
        monkeypatch.setattr(
            module.live_source,
            "generate",
            lambda prompt_list, *, seed, params: [
                FakeResult(c, lp) for c, lp in zip(completions, old)
            ],
        )
        return module

    batch = {"prompt_ids": prompts, "records": [{"answer": "5"}, {"answer": "12"}]}
    metrics = _compare(make, batch)
    assert float(metrics["kl"]) > 0 and float(metrics["entropy"]) > 0


# ---------------------------------------------------------------------- refused settings
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_chunk_size_below_one_is_refused_before_the_model_is_built(value):
    def never(**_):
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match=r"strategy\.logits_chunk_size"):
        SFTModule(model=never, logits_chunk_size=value)


def test_liger_kernel_is_refused_here_naming_the_key():
    def never(**_):
        raise AssertionError("the model was built")

    with pytest.raises(ValueError, match=r"strategy\.use_liger_kernel"):
        SFTModule(model=never, use_liger_kernel=True)


@pytest.mark.parametrize(
    "override,key",
    [
        ("strategy.logits_chunk_size=0", "strategy.logits_chunk_size"),
        ("strategy.use_liger_kernel=true", "strategy.use_liger_kernel"),
    ],
)
def test_the_training_command_refuses_them_before_anything_loads(override, key):
    """The preflight check (`python -m astrai.train`'s, before the tokenizer, data or model)."""
    from astrai.train import preflight
    from astrai.train.runner import compose

    (found,) = preflight.problems(compose(["experiment=tiny_sft", override]))
    assert found.startswith(key)
    assert preflight.problems(compose(["experiment=tiny_sft"])) == []
