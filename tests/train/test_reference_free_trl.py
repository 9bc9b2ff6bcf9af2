"""CPO, SimPO and ORPO against TRL 1.16's own trainers: a real ``CPOTrainer`` / ``ORPOTrainer``
on a tiny random local Llama tokenises four preference pairs of different lengths with its
own ``tokenize_row`` and collator and computes its loss through ``get_batch_loss_metrics``;
our ``CPOModule`` / ``ORPOModule`` load the same export with ``astrai.model.load_pretrained``
and compute theirs through ``compute_loss`` on the astrai batch (our ``collate_preference``)
built from exactly the token ids TRL used. Loss, rewards, the logged metrics and the gradient
of every parameter must agree to 1e-6 (float32 on both sides: the two forwards agree to
~1e-7 here; our log-probs are fp32 whatever the model dtype, so float64 would not help)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from trl_helpers import hf_parts  # noqa: E402

from astrai.data import collate_preference  # noqa: E402
from astrai.model import load_pretrained  # noqa: E402
from astrai.model.hub import to_hf_key  # noqa: E402
from astrai.train.strategies.cpo import CPOModule  # noqa: E402
from astrai.train.strategies.orpo import ORPOModule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

TOL = dict(rtol=1e-6, atol=1e-6)
# t10..t19 would split into the added EOS token "t1" + an unknown "0": kept out of the texts
PAIRS = {
    "prompt": ["t2 t3", "t4", "t5 t6 t7", "t8 t9 t2 t3"],
    "chosen": [" t20 t21 t22", " t23", " t24 t25", " t26 t27 t28 t29 t30"],
    "rejected": [" t30", " t31 t2 t3 t4", " t5 t6", " t7"],
}
#: TRL's metric name -> ours
METRICS = {
    "rewards/chosen": "rewards/chosen",
    "rewards/rejected": "rewards/rejected",
    "rewards/accuracies": "rewards/accuracy",
    "rewards/margins": "rewards/margin",
    "logps/chosen": "logps/chosen",
    "logps/rejected": "logps/rejected",
    "nll_loss": "nll_loss",
}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return hf_parts(tmp_path_factory.mktemp("reference_free"))


def _trainer(parts, kind: str):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    root, tok = parts
    trainer_cls, config_cls = {"cpo": (CPOTrainer, CPOConfig), "orpo": (ORPOTrainer, ORPOConfig)}[
        kind
    ]
    args = config_cls(
        output_dir=str(root / f"out-{kind}"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
    )
    trainer = trainer_cls(
        model=str(root / "model"),
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=tok,
    )
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def cpo_trainer(parts):
    return _trainer(parts, "cpo")


@pytest.fixture(scope="module")
def orpo_trainer(parts):
    return _trainer(parts, "orpo")


def _trl_batch(trainer) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS["prompt"]))])


def _astrai_batch(trl_batch: dict) -> dict[str, torch.Tensor]:
    """Our collated batch from TRL's token ids: each sequence (TRL's unpadded ``input_ids``)
    shifted as our datasets do, the loss mask where TRL's labels are not -100 (the response
    and the EOS TRL appended), padded by ``collate_preference``."""
    items = []
    for i in range(trl_batch["chosen_input_ids"].shape[0]):
        item = {}
        for side in ("chosen", "rejected"):
            n = int(trl_batch[f"{side}_attention_mask"][i].sum())
            ids = trl_batch[f"{side}_input_ids"][i, :n]
            mask = trl_batch[f"{side}_labels"][i, :n] != -100
            item[f"{side}_input_ids"] = ids[:-1]
            item[f"{side}_labels"] = ids[1:].masked_fill(~mask[1:], -100)
            item[f"{side}_loss_mask"] = mask[1:]
            item[f"{side}_position_ids"] = torch.arange(n - 1)
        items.append(item)
    return collate_preference(items, pad_id=0)


def _compare(trainer, module, *, check_nll: bool = True, extra: tuple[str, ...] = ()) -> dict:
    trl_batch = _trl_batch(trainer)
    # responses of different lengths within and across pairs (sums and means disagree), and
    # chosen and rejected padded to different lengths by TRL
    lengths = {
        s: trl_batch[f"{s}_labels"].ne(-100).sum(-1).tolist() for s in ("chosen", "rejected")
    }
    assert len(set(lengths["chosen"])) == 4 and lengths["chosen"] != lengths["rejected"]
    assert trl_batch["chosen_input_ids"].shape != trl_batch["rejected_input_ids"].shape
    trainer.model.zero_grad(set_to_none=True)
    theirs, logged = trainer.get_batch_loss_metrics(trainer.model, trl_batch)
    theirs.backward()

    ours, metrics = module.compute_loss(_astrai_batch(trl_batch))
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), **TOL)
    for key, name in METRICS.items():
        if key == "nll_loss" and not check_nll:
            continue
        assert metrics[name].item() == pytest.approx(float(logged[key]), abs=1e-6), key
    for key in extra:
        assert metrics[key].item() == pytest.approx(float(logged[key]), abs=1e-6), key
    hf = dict(trainer.model.named_parameters())
    ours_params = {to_hf_key(n): p for n, p in module.model.named_parameters()}
    assert set(ours_params) == set(hf)
    for name, p in ours_params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, hf[name].grad, **TOL, msg=name)
    return logged


def _ours(parts, cls, **options):
    root, _ = parts
    return cls(model=load_pretrained(root / "model", dtype=torch.float32).train(), **options)


CPO_CASES = [
    # (loss_type, beta, label_smoothing, cpo_alpha, simpo_gamma)
    ("sigmoid", 0.1, 0.0, 1.0, None),  # TRL's defaults
    ("sigmoid", 0.7, 0.2, 0.5, None),
    ("hinge", 0.7, 0.0, 1.0, None),
    ("ipo", 0.7, 0.0, 1.0, None),
    ("simpo", 2.0, 0.0, 0.0, 0.5),  # pure SimPO (conf/strategy/simpo.yaml)
    ("simpo", 0.7, 0.1, 0.5, 0.3),  # SimPO + NLL (CPO-SimPO)
]


@pytest.mark.parametrize(("loss_type", "beta", "smoothing", "alpha", "gamma"), CPO_CASES)
def test_cpo_equals_trl(parts, cpo_trainer, loss_type, beta, smoothing, alpha, gamma):
    trainer = cpo_trainer
    trainer.loss_type, trainer.beta, trainer.label_smoothing = loss_type, beta, smoothing
    trainer.cpo_alpha = alpha
    trainer.simpo_gamma = 0.5 if gamma is None else gamma  # read by TRL only under simpo
    options = dict(loss_type=loss_type, beta=beta, label_smoothing=smoothing, cpo_alpha=alpha)
    if gamma is not None:
        options["simpo_gamma"] = gamma
    module = _ours(parts, CPOModule, **options)
    assert module.reference is None
    # TRL logs nll_loss 0 when cpo_alpha is 0; we log the chosen NLL whatever its weight
    _compare(trainer, module, check_nll=alpha > 0)


def test_simpo_gamma_beta_ratio_equals_trl(parts, cpo_trainer):
    """The SimPO paper's parametrisation: gamma_beta_ratio 0.25 at beta 2.0 is TRL's
    simpo_gamma 0.5."""
    trainer = cpo_trainer
    trainer.loss_type, trainer.beta, trainer.label_smoothing = "simpo", 2.0, 0.0
    trainer.cpo_alpha, trainer.simpo_gamma = 0.0, 0.5
    module = _ours(
        parts, CPOModule, loss_type="simpo", beta=2.0, cpo_alpha=0.0, gamma_beta_ratio=0.25
    )
    assert module.simpo_gamma == pytest.approx(0.5)
    _compare(trainer, module, check_nll=False)


def test_cpo_nll_metric_is_trls_nll_loss(parts, cpo_trainer):
    """With cpo_alpha 0 the logged nll_loss is still the chosen tokens' cross entropy: the
    value TRL computes (and logs) when the term is on."""
    trainer = cpo_trainer
    trainer.loss_type, trainer.beta, trainer.label_smoothing = "simpo", 2.0, 0.0
    trainer.cpo_alpha, trainer.simpo_gamma = 1.0, 0.5
    _, logged = trainer.get_batch_loss_metrics(trainer.model, _trl_batch(trainer))
    module = _ours(parts, CPOModule, loss_type="simpo", beta=2.0, cpo_alpha=0.0)
    _, metrics = module.compute_loss(_astrai_batch(_trl_batch(trainer)))
    assert metrics["nll_loss"].item() == pytest.approx(logged["nll_loss"], abs=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_equals_trl(parts, orpo_trainer, beta):
    orpo_trainer.beta = beta
    module = _ours(parts, ORPOModule, beta=beta)
    assert module.reference is None
    logged = _compare(orpo_trainer, module, extra=("log_odds_ratio", "log_odds_chosen"))
    # the NLL covers the prompt too (TRL's choice): it differs from the response-only one
    batch = _astrai_batch(_trl_batch(orpo_trainer))
    with torch.no_grad():
        logits = module.model(batch["chosen_input_ids"])
    response_nll = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["chosen_labels"].flatten(), ignore_index=-100
    )
    assert abs(response_nll.item() - logged["nll_loss"]) > 1e-3
