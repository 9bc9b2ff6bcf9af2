"""DPO: the loss against its formula, computed by hand on fixed numbers and a fixed batch."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from astrai.model import Transformer, preset, preset_model
from astrai.train.optim import adamw, constant
from astrai.train.preference import preference_logprobs, sequence_logprobs
from astrai.train.strategies.dpo import (
    batch_pair_keys,
    dpo_loss,
    precompute_reference,
    repeat_last,
)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_loss_matches_formula():
    pc, pr = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -4.5])
    rc, rr = torch.tensor([-3.5, -5.2]), torch.tensor([-3.9, -4.0])
    beta = 0.5
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta)
    z = [beta * ((a - c) - (b - d)) for a, b, c, d in zip(pc, pr, rc, rr)]
    expected = sum(-math.log(_sig(float(v))) for v in z) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert cr.tolist() == pytest.approx([0.25, 0.1])
    assert rj.tolist() == pytest.approx([-0.05, -0.25])
    ls = 0.1
    loss_s, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls)
    expected_s = (
        sum(-(1 - ls) * math.log(_sig(float(v))) - ls * math.log(_sig(-float(v))) for v in z) / 2
    )
    assert loss_s.item() == pytest.approx(expected_s, rel=1e-6)
    # Identical policy and reference: log 2 whatever beta.
    loss0, _, _ = dpo_loss(pc, pr, pc, pr, beta=3.0)
    assert loss0.item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def _fixed_batch() -> dict[str, torch.Tensor]:
    # Two pairs, right-padded to one length; loss on the response tokens only.
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (4, 7), generator=g)
    mask = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    attn = torch.tensor(
        [[1] * 6 + [0], [1] * 7, [1] * 5 + [0] * 2, [1] * 4 + [0] * 3], dtype=torch.long
    )
    labels = torch.roll(ids, -1, 1).masked_fill(~mask, -100)
    batch = {}
    for side, rows in (("chosen", [0, 1]), ("rejected", [2, 3])):
        batch[f"{side}_input_ids"] = ids[rows]
        batch[f"{side}_labels"] = labels[rows]
        batch[f"{side}_loss_mask"] = mask[rows]
        batch[f"{side}_attention_mask"] = attn[rows]
    return batch


def _hand_seq_logps(model, ids, labels):
    out = []
    for b in range(ids.shape[0]):
        n = int((ids[b] != -1).sum())
        logits = model(ids[b : b + 1, :n])[0]
        total = 0.0
        for t in range(n):
            if labels[b, t] != -100:
                total += torch.log_softmax(logits[t], -1)[labels[b, t]].item()
        out.append(total)
    return out


def test_preference_logprobs_and_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    policy = Transformer(preset("tiny"))
    ref = Transformer(preset("tiny"))
    batch = _fixed_batch()
    pc, pr = preference_logprobs(policy, batch)
    rc, rr = preference_logprobs(ref, batch)
    hc = _hand_seq_logps(policy, batch["chosen_input_ids"], batch["chosen_labels"])
    hr = _hand_seq_logps(policy, batch["rejected_input_ids"], batch["rejected_labels"])
    assert pc.tolist() == pytest.approx(hc, abs=1e-4)
    assert pr.tolist() == pytest.approx(hr, abs=1e-4)
    href_c = _hand_seq_logps(ref, batch["chosen_input_ids"], batch["chosen_labels"])
    href_r = _hand_seq_logps(ref, batch["rejected_input_ids"], batch["rejected_labels"])
    beta = 0.1
    expected = (
        sum(
            -math.log(_sig(beta * ((a - c) - (b - d))))
            for a, b, c, d in zip(hc, hr, href_c, href_r)
        )
        / 2
    )
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_preference_logprobs_reduction_against_plain_torch(reduction):
    """sum: the response tokens' log-probs added up; mean: divided by their number (per
    sequence), both from a plain log_softmax of a plain forward."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    batch = _fixed_batch()
    pc, pr = preference_logprobs(model, batch, reduction)
    for side, got in (("chosen", pc), ("rejected", pr)):
        ids, labels = batch[f"{side}_input_ids"], batch[f"{side}_labels"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).double(), -1)
        keep = labels != -100
        tok = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * keep
        expected = tok.sum(-1) / (keep.sum(-1) if reduction == "mean" else 1)
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=0)
    assert [int(batch["chosen_labels"][i].ne(-100).sum()) for i in (0, 1)] == [3, 5]
    with pytest.raises(ValueError, match="reduction"):
        sequence_logprobs(torch.zeros(1, 2), torch.ones(1, 2), "max")


def test_dpo_mean_reduction_differs_from_sum_by_lengths():
    """Averaging removes the length factor: equal per-token log-probs over 3 and 5 tokens give
    equal means but different sums."""
    lp = torch.full((2, 6), -0.5)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    assert sequence_logprobs(lp, mask).tolist() == [-1.5, -2.5]
    assert sequence_logprobs(lp, mask, "mean").tolist() == [-0.5, -0.5]
    assert sequence_logprobs(lp, torch.zeros(2, 6), "mean").tolist() == [0.0, 0.0]


def test_precomputed_reference_is_keyed_by_content():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    batch = _fixed_batch()
    table = precompute_reference(model, [batch], torch.device("cpu"))
    keys = batch_pair_keys(batch)
    assert len(table) == 2 and set(table) == set(keys)
    c, r = preference_logprobs(model, batch)
    assert table[keys[0]] == pytest.approx((c[0].item(), r[0].item()), abs=1e-6)
    # The same pair padded to another length has the same key.
    padded = {k: torch.nn.functional.pad(v, (0, 3), value=0) for k, v in batch.items()}
    assert batch_pair_keys(padded) == keys


# ------------------------------------------------------------------ DPOModule under Lightning


@pytest.fixture(scope="module")
def pref_setup(tmp_path_factory):
    """A tokenizer trained on the arithmetic chats and prepared preference data."""
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("dpo")
    texts = [m["content"] for r in sft_records(arithmetic_problems(300)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=320)
    tok.save_pretrained(root / "tok")
    for split, n in (("train", 48), ("val", 16)):
        prepare(
            "preference",
            f"builtin:arithmetic/preference/{split}",
            root,
            root / "tok",
            name=f"pref_{split}",
            builtin={"n": n, "seed": 0},
            progress=False,
        )
    return root, len(tok)


def _module(root, vocab, **kw):
    from astrai.train.strategies.dpo import DPOModule

    torch.manual_seed(0)
    return DPOModule(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        optimizer=functools.partial(adamw, lr=1e-2),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        beta=0.5,
        **kw,
    )


def _datamodule(root):
    from astrai.data import AstraiDataModule, PreferenceDataset

    return AstraiDataModule(
        train=PreferenceDataset(str(root / "pref_train.h5")),
        val=PreferenceDataset(str(root / "pref_val.h5")),
        batch_size=8,
        seed=0,
    )


def _trainer(tmp_path, steps, **kw):
    import lightning as L

    return L.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=steps,
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
        **kw,
    )


@pytest.mark.slow
def test_dpo_module_loss_reference_and_training(pref_setup, tmp_path):
    root, vocab = pref_setup
    module = _module(root, vocab)
    dm = _datamodule(root)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    # The reference is a frozen copy of the initial policy, outside the module tree.
    assert set(module.state_dict()) == {f"model.{k}" for k in module.model.state_dict()}
    ref = module.reference.on(module.device)
    assert all(not p.requires_grad for p in ref.parameters())
    assert {id(p) for p in ref.parameters()}.isdisjoint({id(p) for p in module.parameters()})
    loss, metrics = module.compute_loss(batch)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
    # Perturb the policy: the loss is the formula on hand-computed sequence log-probs.
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    loss, metrics = module.compute_loss(batch)
    hc = _hand_seq_logps(module.model, batch["chosen_input_ids"], batch["chosen_labels"])
    hr = _hand_seq_logps(module.model, batch["rejected_input_ids"], batch["rejected_labels"])
    rc = _hand_seq_logps(ref, batch["chosen_input_ids"], batch["chosen_labels"])
    rr = _hand_seq_logps(ref, batch["rejected_input_ids"], batch["rejected_labels"])
    z = [0.5 * ((a - c) - (b - d)) for a, b, c, d in zip(hc, hr, rc, rr)]
    assert loss.item() == pytest.approx(sum(-math.log(_sig(v)) for v in z) / len(z), abs=1e-4)
    acc = sum(a - c > b - d for a, b, c, d in zip(hc, hr, rc, rr)) / len(z)
    assert metrics["rewards/accuracy"].item() == pytest.approx(acc)

    # A few optimizer steps raise the reward accuracy on the training pairs; the reference
    # does not move.
    module = _module(root, vocab)
    before = {k: v.clone() for k, v in module.reference.model.state_dict().items()}
    trainer = _trainer(tmp_path, 12)
    trainer.fit(module, datamodule=_datamodule(root))
    after = module.reference.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    _, m = module.compute_loss(batch)
    assert m["rewards/margin"].item() > 0
    ckpt = torch.load(
        trainer.checkpoint_callback.best_model_path or _last(tmp_path), weights_only=False
    )
    assert set(ckpt["state_dict"]) == {f"model.{k}" for k in module.model.state_dict()}


def _last(path):
    import glob

    return sorted(glob.glob(f"{path}/**/*.ckpt", recursive=True))[-1]


@pytest.mark.slow
def test_dpo_precomputed_reference_matches_copy(pref_setup, tmp_path):
    root, vocab = pref_setup
    copy_mod = _module(root, vocab)
    pre_mod = _module(root, vocab, reference="precomputed")
    assert pre_mod.reference is None  # no second model
    trainer = _trainer(tmp_path, 1)
    trainer.fit(pre_mod, datamodule=_datamodule(root))
    assert pre_mod._ref_table is not None and len(pre_mod._ref_table) == 48 + 16
    dm = _datamodule(root)
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    c1, r1 = copy_mod.reference_logprobs(batch)
    c2, r2 = pre_mod.reference_logprobs(batch)
    torch.testing.assert_close(c1, c2, atol=1e-4, rtol=0)
    torch.testing.assert_close(r1, r2, atol=1e-4, rtol=0)
    # The table travels in the checkpoint; a resumed module takes it from there.
    ckpt = torch.load(_last(tmp_path), weights_only=False)
    assert len(ckpt["dpo_reference"]["keys"]) == 64
    fresh = _module(root, vocab, reference="precomputed")
    fresh.on_load_checkpoint(ckpt)
    assert fresh._ref_table == pre_mod._ref_table


def test_dpo_module_rejects_bad_options(pref_setup):
    root, vocab = pref_setup
    with pytest.raises(ValueError, match="reference"):
        _module(root, vocab, reference="nope")
    with pytest.raises(ValueError, match="reduction"):
        _module(root, vocab, reduction="avg")


def test_dpo_module_mean_reduction_matches_hand_computation(pref_setup):
    """reduction=mean: policy and reference log-probs are both per-token averages; the loss is
    the DPO formula on those (computed here from plain forwards)."""
    root, vocab = pref_setup
    from astrai.data import PreferenceDataset

    module = _module(root, vocab, reduction="mean")
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ds = PreferenceDataset(str(root / "pref_val.h5"))
    batch = ds.collate([ds[i] for i in range(4)])
    loss, _ = module.compute_loss(batch)
    z = []
    for i in range(4):
        parts = []
        for model in (module.model, module.reference.model):
            for side in ("chosen", "rejected"):
                ids, labels = batch[f"{side}_input_ids"][i : i + 1], batch[f"{side}_labels"][i]
                n = int(labels.ne(-100).sum())
                total = _hand_seq_logps(model, ids, labels[None])[0]
                parts.append(total / n)
        pc, pr, rc, rr = parts
        z.append(0.5 * ((pc - rc) - (pr - rr)))
    assert loss.item() == pytest.approx(sum(-math.log(_sig(v)) for v in z) / 4, abs=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_rpo_nll_is_the_chosen_tokens_cross_entropy(reduction):
    """`rpo_alpha`'s term is TRL's `nll_loss`: cross entropy over all chosen response tokens
    of the batch (token mean), whatever the DPO reduction."""
    from astrai.train.preference import chosen_nll

    torch.manual_seed(0)
    policy = Transformer(preset("tiny"))
    batch = _fixed_batch()
    pc, _ = preference_logprobs(policy, batch, reduction)
    logits = policy(batch["chosen_input_ids"])
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["chosen_labels"].flatten(), ignore_index=-100
    )
    assert chosen_nll(pc, batch, reduction).item() == pytest.approx(expected.item(), abs=1e-5)


def test_rpo_alpha_adds_the_nll_to_the_loss():
    from astrai.train.strategies.dpo import DPOModule

    batch = _fixed_batch()
    factory = functools.partial(preset_model, "tiny")
    torch.manual_seed(0)
    plain = DPOModule(model=factory, optimizer=functools.partial(adamw, lr=1e-2))
    torch.manual_seed(0)
    rpo = DPOModule(model=factory, optimizer=functools.partial(adamw, lr=1e-2), rpo_alpha=0.5)
    l0, m0 = plain.compute_loss(batch)
    l1, m1 = rpo.compute_loss(batch)
    assert "nll_loss" not in m0 and m1["nll_loss"] > 0
    assert l1.item() == pytest.approx(l0.item() + 0.5 * m1["nll_loss"].item(), abs=1e-5)
    with pytest.raises(ValueError, match="rpo_alpha"):
        DPOModule(model=factory, rpo_alpha=-1.0)


def test_repeat_last_gives_every_rank_as_many_batches():
    """The precomputation's forwards are collectives under FSDP2: a rank with fewer pairs
    repeats its last batch (the same values again), a rank with none runs none."""
    assert list(repeat_last(iter([1, 2]), 4)) == [1, 2, 2, 2]
    assert list(repeat_last([1, 2, 3], 2)) == [1, 2, 3]
    assert list(repeat_last([], 3)) == []
