"""Padding-free pretrain / SFT batches (data.padding_free): one row of real tokens, positions
restarting per sample and packed document; the SFT and pretrain losses and every gradient
equal the padded batch's (fp32, 1e-6); bad settings are refused naming the key."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import Dataset

from astrai.data.datamodule import AstraiDataModule
from astrai.data.datasets import IGNORE_INDEX, collate_lm
from astrai.data.flatten import PaddingFree, flatten_lm
from astrai.model import preset_model
from astrai.model.documents import DocumentSpans
from astrai.model.transformer import document_mask
from astrai.train.optim import adamw, constant
from astrai.train.strategies.pretrain import PretrainModule
from astrai.train.strategies.sft import SFTModule


def _sample(docs: list[int], seed: int) -> dict[str, torch.Tensor]:
    """An SFT sample of packed documents of these lengths (positions restart per document),
    the loss on the second half of each."""
    g = torch.Generator().manual_seed(seed)
    n = sum(docs)
    ids = torch.randint(0, 512, (n,), generator=g)
    pos = torch.cat([torch.arange(d) for d in docs])
    mask = torch.cat([torch.arange(d) >= d // 2 for d in docs])
    labels = torch.randint(0, 512, (n,), generator=g).masked_fill(~mask, IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, "loss_mask": mask, "position_ids": pos}


SAMPLES = [_sample([9, 4], 0), _sample([3], 1), _sample([5, 6, 7], 2), _sample([2, 11], 3)]


def test_flatten_keeps_real_tokens_and_restarts_positions():
    padded = collate_lm(SAMPLES, pad_id=0)
    flat = PaddingFree(functools.partial(collate_lm, pad_id=0))(SAMPLES)
    assert padded["input_ids"].shape == (4, 18)
    assert flat.keys() == padded.keys() and flat["input_ids"].shape == (1, 13 + 3 + 18 + 13)
    torch.testing.assert_close(flat["input_ids"][0], torch.cat([s["input_ids"] for s in SAMPLES]))
    torch.testing.assert_close(flat["labels"][0], torch.cat([s["labels"] for s in SAMPLES]))
    assert bool(flat["attention_mask"].all())
    layout = document_mask(flat["position_ids"], flat["attention_mask"])
    assert isinstance(layout, DocumentSpans)  # no [S, S] mask
    assert [end - start for start, end in layout.spans[0]] == [9, 4, 3, 5, 6, 7, 2, 11]


@pytest.mark.parametrize("strategy", [SFTModule, PretrainModule])
def test_padding_free_loss_and_gradients_equal_padded(strategy):
    def loss_and_grads(batch):
        torch.manual_seed(0)
        module = strategy(
            model=functools.partial(preset_model, name="tiny"),
            optimizer=functools.partial(adamw, lr=1e-3),
            scheduler=constant,
        )
        loss, metrics = module.compute_loss(batch)
        loss.backward()
        grads = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
        return loss.detach(), metrics, grads

    padded = loss_and_grads(collate_lm(SAMPLES, pad_id=0))
    flat = loss_and_grads(flatten_lm(collate_lm(SAMPLES, pad_id=0)))
    torch.testing.assert_close(flat[0], padded[0], atol=1e-6, rtol=0)
    assert flat[1].keys() == padded[1].keys()
    for key, value in padded[1].items():
        torch.testing.assert_close(flat[1][key], value)
    assert padded[2].keys() == flat[2].keys() and padded[2]
    for name, grad in padded[2].items():
        torch.testing.assert_close(flat[2][name], grad, atol=1e-6, rtol=0, msg=name)


def test_a_sample_continuing_the_previous_positions_is_refused():
    a, b = _sample([5], 0), _sample([4], 1)
    b["position_ids"] = torch.arange(5, 9)  # a window starting mid-document
    with pytest.raises(ValueError, match=r"data\.padding_free: sample 1"):
        flatten_lm(collate_lm([a, b], pad_id=0))
    with pytest.raises(ValueError, match=r"data\.padding_free"):
        flatten_lm({**collate_lm([a], pad_id=0), "chosen_input_ids": a["input_ids"][None]})


class _Items(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(i)}


def test_the_data_module_refuses_bad_padding_free_settings():
    with pytest.raises(ValueError, match=r"data\.padding_free must be true or false"):
        AstraiDataModule(train=_Items(), padding_free="yes")
    dm = AstraiDataModule(train=_Items(), padding_free=True)
    with pytest.raises(ValueError, match=r"data\.padding_free flattens pretrain and SFT.*_Items"):
        dm.setup()
