"""LMModule, the pretrain and SFT strategies, and the model factories (in-process, fast)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from astrai.data.datasets import IGNORE_INDEX
from astrai.model import (
    AutoModel,
    Transformer,
    VocabMismatchError,
    check_vocab,
    preset,
    preset_model,
    pretrained_model,
    save_pretrained,
)
from astrai.train.module import (
    NonFiniteLossError,
    ReferencePolicy,
    init_from_export,
    token_logprobs,
)
from astrai.train.optim import adamw, constant
from astrai.train.strategies.pretrain import PretrainModule
from astrai.train.strategies.sft import SFTModule

TINY = functools.partial(preset_model, name="tiny")
OPTIM = {"optimizer": functools.partial(adamw, lr=1e-3), "scheduler": constant}


def test_token_logprobs_match_log_softmax() -> None:
    torch.manual_seed(0)
    m = PretrainModule(model=TINY, **OPTIM)
    ids = torch.randint(0, 512, (3, 12))
    logits = m.model(ids)
    lp = token_logprobs(logits[:, :-1], ids[:, 1:])
    ref = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert lp.shape == (3, 11)
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    # and position by position, against a loop
    for b in range(3):
        for t in range(11):
            expected = torch.log_softmax(logits[b, t].float(), -1)[ids[b, t + 1]]
            assert lp[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_token_logprobs_ignore_masked_positions() -> None:
    logits = torch.randn(1, 3, 5)
    labels = torch.tensor([[2, IGNORE_INDEX, 4]])
    out = token_logprobs(logits, labels)
    assert out[0, 1] == 0.0
    assert out[0, 0].item() == pytest.approx(torch.log_softmax(logits[0, 0], -1)[2].item())


def test_pretrain_loss_is_cross_entropy_with_label_smoothing() -> None:
    torch.manual_seed(0)
    m = PretrainModule(model=TINY, **OPTIM, label_smoothing=0.1)
    ids = torch.randint(0, 512, (2, 10))
    labels = torch.randint(0, 512, (2, 10))
    labels[0, :3] = IGNORE_INDEX
    loss, metrics = m.compute_loss({"input_ids": ids, "labels": labels})
    logits = m.model(ids)
    keep = labels != IGNORE_INDEX
    ref = F.cross_entropy(logits[keep], labels[keep], label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)
    assert metrics["tokens"].item() == keep.sum().item()
    for strategy in (PretrainModule, SFTModule):
        with pytest.raises(ValueError, match="label_smoothing"):
            strategy(model=TINY, label_smoothing=1.0)


def test_sft_loss_ignores_non_assistant_tokens() -> None:
    torch.manual_seed(0)
    m = SFTModule(model=TINY, **OPTIM)
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
    m = SFTModule(model=TINY, **OPTIM)
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
        model=TINY,
        **OPTIM,
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


class _Tok:
    def __len__(self) -> int:
        return 600


def test_vocab_mismatch_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(
        VocabMismatchError,
        match="tokenizer has 600 tokens but model preset 'tiny' has vocab_size=512",
    ):
        preset_model("tiny", tokenizer=_Tok())  # type: ignore[arg-type]
    check_vocab(600, _Tok())  # type: ignore[arg-type]
    assert preset_model("tiny", vocab_size=600, tokenizer=_Tok()).config.vocab_size == 600
    save_pretrained(Transformer(preset("tiny")), tmp_path / "m")
    with pytest.raises(VocabMismatchError, match=r"but model directory .* has vocab_size=512"):
        pretrained_model(tmp_path / "m", tokenizer=_Tok())  # type: ignore[arg-type]


def test_model_factory_errors() -> None:
    with pytest.raises(KeyError, match="unknown model preset"):
        preset_model("nope")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        pretrained_model("/nonexistent/model")


def test_model_factories_on_meta_device(tmp_path) -> None:
    m = preset_model("astrai-1b", device="meta")
    assert m.embed_tokens.weight.device.type == "meta"
    assert m.num_parameters() == m.config.num_parameters()
    preset("astrai-1b").save(tmp_path / "config.json")  # the shape only: no weights needed
    m = pretrained_model(tmp_path, device="meta")
    assert m.embed_tokens.weight.device.type == "meta"
    assert m.num_parameters() == m.config.num_parameters()


def test_pretrained_model_loads_fp32_in_train_mode(tmp_path) -> None:
    torch.manual_seed(0)
    src = Transformer(preset("tiny"))
    save_pretrained(src, tmp_path / "m", dtype=torch.bfloat16)
    m = pretrained_model(tmp_path / "m")
    assert m.training and m.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(
        m.embed_tokens.weight, src.embed_tokens.weight.to(torch.bfloat16).float()
    )


def test_module_takes_a_ready_model_or_a_factory() -> None:
    model = Transformer(preset("tiny"))
    m = PretrainModule(model=model)
    assert m.model is model
    assert isinstance(m.configure_optimizers()["optimizer"], torch.optim.AdamW)  # the default


def test_hparams_hold_configs_not_objects() -> None:
    m = PretrainModule(model=TINY, **OPTIM, label_smoothing=0.1)
    hp = dict(m.hparams)
    assert hp["model"] == {"_target_": "astrai.model.factory.preset_model", "name": "tiny"}
    assert hp["optimizer"] == {"_target_": "astrai.train.optim.adamw", "lr": 1e-3}
    assert hp["scheduler"] == "astrai.train.optim.constant"
    assert hp["label_smoothing"] == 0.1 and hp["lora"] is None
    assert PretrainModule(model=Transformer(preset("tiny"))).hparams["model"] == "Transformer"
    with pytest.raises(TypeError, match="unexpected keyword"):
        PretrainModule(model=TINY, label_smothing=0.1)  # a typo in the config is an error


def test_reference_policy_is_a_frozen_copy_outside_the_module() -> None:
    m = PretrainModule(model=TINY)
    m.reference = ReferencePolicy(m.model, "bfloat16")
    ref = m.reference.on(m.device)
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())
    assert {id(p) for p in ref.parameters()}.isdisjoint({id(p) for p in m.parameters()})
    assert set(m.state_dict()) == {f"model.{k}" for k in m.model.state_dict()}
    with torch.no_grad():
        m.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(ref.embed_tokens.weight.float(), m.model.embed_tokens.weight)


def test_init_from_export(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    src = Transformer(preset("tiny"))
    save_pretrained(src, tmp_path / "export")
    dst = Transformer(preset("tiny"))
    assert init_from_export(dst, str(tmp_path / "export"))
    assert all(
        torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values())
    )
    assert not init_from_export(dst, str(tmp_path / "missing"))
    assert "does not exist" in caplog.text
    with pytest.raises(FileNotFoundError):
        init_from_export(dst, str(tmp_path / "missing"), required=True)
    with pytest.raises(ValueError, match="does not match"):
        init_from_export(Transformer(preset("tiny", num_hidden_layers=1)), str(tmp_path / "export"))
    # through the module (any strategy): the export's weights, LoRA adapters on top
    m = SFTModule(
        model=TINY,
        init_from=str(tmp_path / "export"),
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
    )
    ids = torch.randint(0, 512, (1, 8))
    torch.testing.assert_close(m.model(ids), src(ids))  # LoRA's B starts at zero


def test_non_finite_loss_raises_before_the_step() -> None:
    m = PretrainModule(model=TINY, **OPTIM)
    with pytest.raises(NonFiniteLossError, match="the training loss is nan"):
        m._check_finite(torch.tensor(float("nan")), "the training loss")
