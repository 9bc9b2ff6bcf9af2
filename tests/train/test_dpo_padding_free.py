"""DPO ``padding_free``: the chosen and rejected sequences packed into one unpadded row give
the padded batch's log-probs, loss and gradients (reference copy and precomputed, with and
without ``ld_alpha``); and every bad DPO option is refused, by name, before the model is
built."""

from __future__ import annotations

import functools

import pytest
import torch
from omegaconf import OmegaConf

from astrai.model import Transformer, preset, preset_model
from astrai.train.preference import ld_masks, preference_logprobs, preference_token_logprobs
from astrai.train.strategies.dpo import DPOModule, batch_pair_keys, precompute_reference


@pytest.fixture(scope="module")
def pref_data(tmp_path_factory):
    """A trained tokenizer and 16 prepared arithmetic preference pairs (lengths differ)."""
    from astrai.data import PreferenceDataset
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    root = tmp_path_factory.mktemp("dpo-pf")
    texts = [m["content"] for r in sft_records(arithmetic_problems(200)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=320)
    tok.save_pretrained(root / "tok")
    prepare(
        "preference",
        "builtin:arithmetic/preference/train",
        root,
        root / "tok",
        name="pref",
        builtin={"n": 16, "seed": 0},
        progress=False,
    )
    ds = PreferenceDataset(str(root / "pref.h5"))
    return ds, len(tok)


def _pair(ds, i: int) -> dict[str, torch.Tensor]:
    """Pair i's chosen answer with pair i+5's rejected one: the arithmetic pairs differ in
    one digit (mostly equal lengths); shifted, most responses differ in length (LD-DPO's
    tail), and so do the rows (padding)."""
    chosen, rejected = ds[i], ds[(i + 5) % len(ds)]
    return {
        **{k: v for k, v in chosen.items() if k.startswith("chosen_")},
        **{k: v for k, v in rejected.items() if k.startswith("rejected_")},
    }


def _batches(ds, size: int = 8):
    return [ds.collate([_pair(ds, i) for i in range(s, s + size)]) for s in range(0, len(ds), size)]


def _model(vocab: int, dtype: torch.dtype = torch.float32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", vocab_size=vocab)).to(dtype)


def _module(vocab: int, **kw) -> DPOModule:
    torch.manual_seed(0)
    module = DPOModule(model=functools.partial(preset_model, "tiny", vocab_size=vocab), **kw)
    with torch.no_grad():  # the policy moves away from its reference copy
        g = torch.Generator().manual_seed(1)
        for p in module.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return module


def test_the_batch_is_padded(pref_data):
    ds, _ = pref_data
    batch = _batches(ds)[0]
    lengths = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]).sum(-1)
    assert lengths.min() < batch["chosen_input_ids"].shape[1]  # padding to remove
    assert len(set(lengths.tolist())) > 2
    n_c = (batch["chosen_labels"] != -100).sum(-1)
    n_r = (batch["rejected_labels"] != -100).sum(-1)
    assert (n_c != n_r).sum() >= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_token_logprobs_equal_padded(pref_data, dtype):
    """Per-token log-probs of the packed row, scattered back, equal the padded forward's
    (float64: the backbone agrees to rounding; the log-softmax is float32 either way)."""
    ds, vocab = pref_data
    model = _model(vocab, dtype)
    batch = _batches(ds)[0]
    padded, mask = preference_token_logprobs(model, batch)
    packed, mask_pf = preference_token_logprobs(model, batch, padding_free=True)
    assert torch.equal(mask, mask_pf)
    atol = 1e-5 if dtype == torch.float32 else 1e-6
    torch.testing.assert_close(packed * mask, padded * mask, rtol=0, atol=atol)
    for reduction, ld_alpha in (("sum", None), ("mean", None), ("sum", 0.5)):
        a = preference_logprobs(model, batch, reduction, ld_alpha=ld_alpha)
        b = preference_logprobs(model, batch, reduction, ld_alpha=ld_alpha, padding_free=True)
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=atol * 10)


def test_packed_forward_keeps_the_sequences_apart(pref_data):
    """The packed logits of each sequence equal that sequence forwarded alone (float64)."""
    ds, vocab = pref_data
    model = _model(vocab, torch.float64)
    batch = _batches(ds)[0]
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    keep = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]]).bool()
    positions = (keep.long().cumsum(-1) - 1)[keep]
    with torch.no_grad():
        packed = model(ids[keep][None], position_ids=positions[None])[0]
        start = 0
        for row in range(ids.shape[0]):
            n = int(keep[row].sum())
            alone = model(ids[row : row + 1, :n])[0]
            torch.testing.assert_close(packed[start : start + n], alone, rtol=0, atol=1e-10)
            start += n


def test_ld_masks_split_at_the_shorter_response():
    mask = torch.tensor(
        [
            [0, 1, 1, 1, 0],  # chosen: 3 response tokens
            [0, 0, 1, 0, 0],  # chosen: 1
            [0, 1, 1, 0, 0],  # rejected: 2 -> shared 2
            [0, 1, 1, 1, 1],  # rejected: 4 -> shared 1
        ],
        dtype=torch.bool,
    )
    shared, tail = ld_masks(mask)
    assert shared.sum(-1).tolist() == [2, 1, 2, 1]
    assert tail.sum(-1).tolist() == [1, 0, 0, 3]
    assert tail[0].tolist() == [False, False, False, True, False]
    assert torch.equal(shared | tail, mask) and not (shared & tail).any()


def _loss_and_grads(module: DPOModule, batch):
    module.model.zero_grad(set_to_none=True)
    loss, metrics = module.compute_loss(batch)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in module.model.named_parameters()}


def _assert_same(a, b, atol: float = 1e-5) -> None:
    (la, ma, ga), (lb, mb, gb) = a, b
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=atol)
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        torch.testing.assert_close(mb[key], ma[key], rtol=1e-5, atol=atol, msg=key)
    for name in ga:
        scale = float(ga[name].abs().max())
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-4 * scale, msg=name)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"ld_alpha": 0.5},
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"loss_type": "ipo", "rpo_alpha": 0.3},
    ],
    ids=["sigmoid", "ld_alpha", "mpo", "ipo_rpo"],
)
def test_padding_free_module_equals_padded(pref_data, options):
    """Loss, rewards and every gradient of DPOModule with padding_free match the padded run
    (reference copy)."""
    ds, vocab = pref_data
    batch = _batches(ds)[0]
    padded = _loss_and_grads(_module(vocab, beta=0.5, **options), batch)
    packed = _loss_and_grads(_module(vocab, beta=0.5, padding_free=True, **options), batch)
    _assert_same(padded, packed)


def _precomputed(vocab: int, ds, **options) -> DPOModule:
    """A reference=precomputed module whose table is the initial policy's, loaded through
    the checkpoint hook (as a resumed run gets it)."""
    module = DPOModule(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        reference="precomputed",
        beta=0.5,
        **options,
    )
    torch.manual_seed(0)
    reference = preset_model("tiny", vocab_size=vocab)
    table = precompute_reference(
        reference,
        _batches(ds),
        torch.device("cpu"),
        ld_alpha=options.get("ld_alpha"),
        padding_free=options.get("padding_free", False),
    )
    keys = list(table)
    module.on_load_checkpoint(
        {
            "dpo_reference": {
                "keys": keys,
                "values": torch.tensor([table[k] for k in keys], dtype=torch.float64),
                "reduction": "sum",
                "ld_alpha": options.get("ld_alpha"),
            }
        }
    )
    torch.manual_seed(0)
    with torch.no_grad():
        module.model.load_state_dict(reference.state_dict())
        g = torch.Generator().manual_seed(1)
        for p in module.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("ld_alpha", [None, 0.5])
def test_padding_free_with_precomputed_reference(pref_data, ld_alpha):
    """The precomputed table (packed or padded, LD-weighted or not) gives what the reference
    copy gives, padded or packed."""
    ds, vocab = pref_data
    batch = _batches(ds)[1]
    opts = {"ld_alpha": ld_alpha}
    copy = _loss_and_grads(_module(vocab, beta=0.5, **opts), batch)
    pre = _loss_and_grads(_precomputed(vocab, ds, **opts), batch)
    pre_pf = _loss_and_grads(_precomputed(vocab, ds, padding_free=True, **opts), batch)
    _assert_same(copy, pre)
    _assert_same(copy, pre_pf)
    # the table holds the LD-weighted values: they differ from the plain sums
    if ld_alpha is not None:
        model = _model(vocab)
        plain = precompute_reference(model, [batch], torch.device("cpu"))
        weighted = precompute_reference(model, [batch], torch.device("cpu"), ld_alpha=ld_alpha)
        n_c = (batch["chosen_labels"] != -100).sum(-1).tolist()
        n_r = (batch["rejected_labels"] != -100).sum(-1).tolist()
        for key, c, r in zip(batch_pair_keys(batch), n_c, n_r):
            same = plain[key] == pytest.approx(weighted[key], abs=1e-4)
            assert same == (c == r), (c, r)


def test_precomputation_under_lightning_uses_the_options(pref_data, tmp_path):
    """on_fit_start's table (padding_free, ld_alpha) holds the initial policy's LD-weighted
    log-probs of every pair, as the padded computation gives them."""
    import copy

    import lightning as L

    from astrai.data import AstraiDataModule

    ds, vocab = pref_data
    module = DPOModule(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        reference="precomputed",
        padding_free=True,
        ld_alpha=0.5,
    )
    initial = copy.deepcopy(module.model)
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=AstraiDataModule(train=ds, batch_size=8, seed=0))
    batches = [ds.collate([ds[i] for i in range(s, s + 8)]) for s in (0, 8)]
    expected = precompute_reference(initial, batches, torch.device("cpu"), ld_alpha=0.5)
    saved: dict = {}
    module.on_save_checkpoint(saved)
    table = dict(zip(saved["dpo_reference"]["keys"], saved["dpo_reference"]["values"].tolist()))
    assert saved["dpo_reference"]["ld_alpha"] == 0.5
    assert set(table) == set(expected) and len(table) == len(ds)
    for key, (c, r) in expected.items():
        assert table[key] == pytest.approx([c, r], abs=1e-4)


def test_precomputed_table_refuses_another_ld_alpha(pref_data):
    _, vocab = pref_data
    module = DPOModule(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        reference="precomputed",
        ld_alpha=0.5,
    )
    saved = {"keys": [], "values": torch.zeros(0, 2), "reduction": "sum", "ld_alpha": None}
    with pytest.raises(ValueError, match="ld_alpha"):
        module.on_load_checkpoint({"dpo_reference": saved})


# ------------------------------------------------------------------ options


def _never_built(**_):
    raise AssertionError("the model was built before the options were checked")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"loss_type": "dpo"}, "loss_type"),
        ({"loss_type": ["sigmoid", "nope"]}, "loss_type"),
        ({"loss_type": []}, "loss_type"),
        ({"loss_type": ["sigmoid", "sigmoid"]}, "loss_type"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "loss_weights"),
        ({"loss_type": "exo_pair"}, "label_smoothing"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "label_smoothing"),
        ({"f_divergence_type": "kl"}, "f_divergence_type"),
        ({"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}, "f_divergence_type"),
        ({"loss_type": "ipo", "reduction": "mean"}, "reduction"),
        ({"loss_type": ["sigmoid", "sigmoid_norm"], "reduction": "mean"}, "reduction"),
        ({"ld_alpha": 1.5}, "ld_alpha"),
        ({"ld_alpha": -0.1}, "ld_alpha"),
        ({"ld_alpha": 0.5, "reduction": "mean"}, "ld_alpha"),
        ({"discopop_tau": 0.0}, "discopop_tau"),
        ({"padding_free": "yes"}, "padding_free"),
        ({"beta": 0.0}, "beta"),
        ({"rpo_alpha": -1.0}, "rpo_alpha"),
        ({"reduction": "avg"}, "reduction"),
        ({"reference": "nope"}, "reference"),
    ],
)
def test_bad_options_are_named_before_the_model_is_built(options, named):
    with pytest.raises(ValueError, match=named):
        DPOModule(model=_never_built, **options)


def test_hydra_lists_are_accepted():
    module = DPOModule(
        model=functools.partial(preset_model, "tiny"),
        loss_type=OmegaConf.create(["sigmoid", "bco_pair", "sft"]),
        loss_weights=OmegaConf.create([0.8, 0.2, 1.0]),
    )
    assert module.loss_types == ("sigmoid", "bco_pair", "sft")
    assert module.loss_weights == (0.8, 0.2, 1.0)
    assert module.hparams["loss_type"] == ["sigmoid", "bco_pair", "sft"]
