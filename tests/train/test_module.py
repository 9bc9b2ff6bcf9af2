"""LMModule, the pretrain and SFT strategies, and model building (in-process, fast)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.data.datasets import IGNORE_INDEX
from astrai.model import AutoModel
from astrai.train.module import (
    LMModule,
    NonFiniteLossError,
    VocabMismatchError,
    build_model,
    check_vocab,
)
from astrai.train.strategies.pretrain import PretrainModule
from astrai.train.strategies.sft import SFTModule

OPTIM = {"name": "adamw", "lr": 1e-3, "schedule": {"name": "constant"}}


def test_token_logprobs_match_log_softmax() -> None:
    torch.manual_seed(0)
    m = PretrainModule(model={"preset": "tiny"}, optim=OPTIM)
    ids = torch.randint(0, 512, (3, 12))
    lp = LMModule.token_logprobs(m.model, ids)
    ref = torch.log_softmax(m.model(ids).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert lp.shape == (3, 11)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)


def test_pretrain_loss_is_cross_entropy_with_label_smoothing() -> None:
    torch.manual_seed(0)
    m = PretrainModule(model={"preset": "tiny"}, optim=OPTIM, label_smoothing=0.1)
    ids = torch.randint(0, 512, (2, 10))
    labels = torch.randint(0, 512, (2, 10))
    labels[0, :3] = IGNORE_INDEX
    loss, metrics = m.compute_loss({"input_ids": ids, "labels": labels})
    logits = m.model(ids)
    keep = labels != IGNORE_INDEX
    ref = F.cross_entropy(logits[keep], labels[keep], label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)
    assert metrics["tokens"].item() == keep.sum().item()


def test_sft_loss_ignores_non_assistant_tokens() -> None:
    torch.manual_seed(0)
    m = SFTModule(model={"preset": "tiny"}, optim=OPTIM)
    ids = torch.randint(0, 512, (2, 16))
    loss_mask = torch.zeros(2, 16, dtype=torch.bool)
    loss_mask[:, 9:] = True  # the assistant turn
    labels = torch.randint(0, 512, (2, 16))
    batch = {"input_ids": ids, "labels": labels, "loss_mask": loss_mask}
    loss, metrics = m.compute_loss(batch)
    # the loss is the cross entropy over the assistant positions only ...
    logits = m.model(ids)
    ref = F.cross_entropy(logits[:, 9:].flatten(0, 1), labels[:, 9:].flatten())
    torch.testing.assert_close(loss, ref)
    assert metrics["assistant_tokens"].item() == 14
    # ... so changing the targets of user/system positions does not change it
    other = labels.clone()
    other[:, :9] = (other[:, :9] + 7) % 512
    loss2, _ = m.compute_loss({**batch, "labels": other})
    torch.testing.assert_close(loss, loss2)
    # while changing an assistant target does
    other[:, 12] = (other[:, 12] + 7) % 512
    loss3, _ = m.compute_loss({**batch, "labels": other})
    assert not torch.allclose(loss, loss3)


def test_sft_packed_documents_do_not_attend_across() -> None:
    torch.manual_seed(0)
    m = SFTModule(model={"preset": "tiny"}, optim=OPTIM)
    a, b = torch.randint(0, 512, (1, 6)), torch.randint(0, 512, (1, 5))
    c = torch.randint(0, 512, (1, 6))  # a different first document
    pos = torch.cat([torch.arange(6), torch.arange(5)])[None]
    labels = torch.full((1, 11), IGNORE_INDEX)
    labels[0, 6:10] = b[0, 1:]  # the loss is on the second document only
    mask = labels != IGNORE_INDEX
    l1, _ = m.compute_loss(
        {
            "input_ids": torch.cat([a, b], 1),
            "labels": labels,
            "loss_mask": mask,
            "position_ids": pos,
        }
    )
    l2, _ = m.compute_loss(
        {
            "input_ids": torch.cat([c, b], 1),
            "labels": labels,
            "loss_mask": mask,
            "position_ids": pos,
        }
    )
    torch.testing.assert_close(l1, l2)  # the first document cannot influence the second


def test_lora_trains_adapters_only_and_exports_merged(tmp_path) -> None:
    torch.manual_seed(0)
    m = SFTModule(
        model={"preset": "tiny"},
        optim=OPTIM,
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    trainable = [n for n, p in m.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapters non-trivial
        for n, p in m.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids = torch.randint(0, 512, (2, 8))
    expected = m.model(ids)
    m.save_pretrained(tmp_path / "export")
    loaded = AutoModel.from_pretrained(tmp_path / "export")
    torch.testing.assert_close(loaded(ids), expected, rtol=1e-4, atol=1e-4)
    assert any("lora_" in n for n, _ in m.model.named_parameters())  # live model untouched


def test_vocab_mismatch_is_a_clear_error() -> None:
    class Tok:
        def __len__(self) -> int:
            return 600

    with pytest.raises(
        VocabMismatchError,
        match="tokenizer has 600 tokens but model preset 'tiny' has vocab_size=512",
    ):
        build_model({"preset": "tiny"}, tokenizer=Tok())  # type: ignore[arg-type]
    check_vocab(600, Tok())  # type: ignore[arg-type]


def test_model_spec_errors() -> None:
    with pytest.raises(ValueError, match="exactly one of `preset`"):
        build_model({})
    with pytest.raises(ValueError, match="exactly one of `preset`"):
        build_model({"preset": "tiny", "path": "x"})
    with pytest.raises(KeyError, match="unknown model preset"):
        build_model({"preset": "nope"})


def test_build_model_on_meta_device() -> None:
    m = build_model({"preset": "astrai-1b"}, device="meta")
    assert m.embed_tokens.weight.device.type == "meta"
    assert m.num_parameters() == m.config.num_parameters()


def test_non_finite_loss_raises_before_the_step() -> None:
    m = PretrainModule(model={"preset": "tiny"}, optim=OPTIM)
    with pytest.raises(NonFiniteLossError, match="the training loss is nan"):
        m._check_finite(torch.tensor(float("nan")), "the training loss")
