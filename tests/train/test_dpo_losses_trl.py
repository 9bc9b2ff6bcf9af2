"""Our DPO loss family against TRL's own: for every ``loss_type`` (and an MPO combination,
each ``f_divergence_type``, ``ld_alpha``), TRL 1.16's ``DPOTrainer.compute_loss`` runs on a
tiny random Llama export and a batch from its own collator, and ``DPOModule.compute_loss``
runs on the same export (loaded with ``load_pretrained``) and the same pairs; the loss, the
logged rewards and log-probs and every parameter's gradient must agree.

Both backbones run in float64; TRL's fused LM head takes the log-softmax in float32 (its
kernel), ours too (``token_logprobs``), in different orders: that rounding is the floor of
the comparison (about 1e-7 relative), well inside the 1e-6 asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")

from trl_helpers import hf_parts  # noqa: E402

from astrai.data.datasets import collate_preference  # noqa: E402
from astrai.model import load_pretrained  # noqa: E402
from astrai.model.hub import from_hf_key, to_hf_key  # noqa: E402
from astrai.train.strategies.dpo import DPOModule  # noqa: E402
from astrai.train.strategies.dpo_losses import LOSS_TYPES  # noqa: E402

DTYPE = torch.float64
BETA = 0.5
# TRL's tokenizer here maps t10..t19 to two tokens: the pairs use t2..t9 and t20..t31
PAIRS = {
    "prompt": ["t2 t3", "t4", "t5 t6 t7", "t8 t9 t2 t3"],
    "chosen": [" t20 t21 t1", " t22 t1", " t23 t24 t25 t26 t27 t1", " t28 t1"],
    "rejected": [" t29 t1", " t30 t31 t2 t1", " t3 t5 t1", " t4 t6 t7 t8 t9 t1"],
}


def _case(loss_type: Any, **kw: Any) -> dict[str, Any]:
    # label smoothing wherever TRL reads it (robust, exo_pair, aot, aot_unpaired) and wherever
    # both sides must ignore it; not with sigmoid, where ours is cDPO and TRL 1.16's is not
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    smoothing = 0.0 if "sigmoid" in types else 0.1
    return {"loss_type": loss_type, "label_smoothing": smoothing, **kw}


CASES = {
    **{t: _case(t) for t in LOSS_TYPES},
    "mpo": _case(["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    "forward_kl": _case("sigmoid", f_divergence_type="forward_kl"),
    "js_divergence": _case("sigmoid", f_divergence_type="js_divergence"),
    "alpha_divergence": _case("sigmoid", f_divergence_type="alpha_divergence"),
    "alpha_divergence_0.3": _case(
        "sigmoid_norm", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3
    ),
    "js_robust": _case("robust", f_divergence_type="js_divergence"),
    "ld_alpha": _case("sigmoid", ld_alpha=0.5),
    "ld_alpha_sft": _case(["sigmoid", "sft"], ld_alpha=0.5, loss_weights=[1.0, 0.5]),
    "ld_alpha_0_ipo": _case("ipo", ld_alpha=0.0),
    "discopop_tau": _case("discopop", discopop_tau=0.5),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One TRL trainer (train mode, float64, policy = export + seeded noise, reference = the
    export), TRL's collated batch, ours for the same pairs, and the noise by HF name."""
    from datasets import Dataset

    root, tok = hf_parts(tmp_path_factory.mktemp("dpo-trl"))
    args = trl.DPOConfig(
        output_dir=str(root / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        beta=BETA,
    )
    trainer = trl.DPOTrainer(
        model=str(root / "model"),
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=tok,
    )
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS["prompt"]))]
    theirs = trainer.data_collator(examples)
    trainer.model.to(DTYPE).train()
    trainer.ref_model.to(DTYPE)
    g = torch.Generator().manual_seed(1)
    noise = {
        name: 0.05 * torch.randn(p.shape, generator=g, dtype=DTYPE)
        for name, p in sorted(trainer.model.named_parameters())
    }
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            p.add_(noise[name])
    return trainer, theirs, _our_batch(examples), noise, root / "model"


def _our_batch(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The pairs TRL tokenized, in our format (shifted labels, loss mask on the response)."""
    items = []
    for e in examples:
        item = {}
        for side in ("chosen", "rejected"):
            ids = torch.tensor(e["prompt_ids"] + e[f"{side}_ids"])
            response = torch.tensor([False] * len(e["prompt_ids"]) + [True] * len(e[f"{side}_ids"]))
            item[f"{side}_input_ids"] = ids[:-1]
            item[f"{side}_labels"] = ids[1:].masked_fill(~response[1:], -100)
            item[f"{side}_loss_mask"] = response[1:]
            item[f"{side}_position_ids"] = torch.arange(len(ids) - 1)
        items.append(item)
    return collate_preference(items, pad_id=0)


def _trl_loss(trainer, batch, case: dict[str, Any]) -> tuple[torch.Tensor, dict, dict]:
    types = case["loss_type"]
    trainer.loss_types = [types] if isinstance(types, str) else list(types)
    trainer.loss_weights = case.get("loss_weights") or [1.0] * len(trainer.loss_types)
    trainer.label_smoothing = case["label_smoothing"]
    trainer.f_divergence_type = case.get("f_divergence_type", "reverse_kl")
    trainer.f_alpha_divergence_coef = case.get("f_alpha_divergence_coef", 0.5)
    trainer.ld_alpha = case.get("ld_alpha")
    trainer.args.discopop_tau = case.get("discopop_tau", 0.05)
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {from_hf_key(n): p.grad for n, p in trainer.model.named_parameters()}
    return loss.detach(), logged, grads


def _our_loss(model_dir: Path, batch, noise, case: dict[str, Any]):
    module = DPOModule(model=load_pretrained(model_dir, dtype=DTYPE), beta=BETA, **case)
    with torch.no_grad():  # the reference copy was taken before: it stays the export
        for name, p in module.model.named_parameters():
            p.add_(noise[to_hf_key(name)])
    loss, metrics = module.compute_loss(batch)
    loss.backward()
    return loss.detach(), metrics, dict(module.model.named_parameters()), module


@pytest.mark.parametrize("name", list(CASES))
def test_dpo_loss_equals_trl(setup, name):
    trainer, theirs_batch, ours_batch, noise, model_dir = setup
    case = CASES[name]
    theirs, logged, their_grads = _trl_loss(trainer, theirs_batch, case)
    ours, metrics, params, module = _our_loss(model_dir, ours_batch, noise, case)

    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-6, atol=1e-7)
    for ours_key, their_key in (
        ("rewards/chosen", "rewards/chosen"),
        ("rewards/rejected", "rewards/rejected"),
        ("rewards/margin", "rewards/margins"),
        ("rewards/accuracy", "rewards/accuracies"),
        ("logps/chosen", "logps/chosen"),
        ("logps/rejected", "logps/rejected"),
    ):
        assert metrics[ours_key].item() == pytest.approx(logged[their_key], rel=1e-6, abs=1e-6), (
            ours_key
        )
    assert set(params) == set(their_grads)
    for pname, p in params.items():
        g = their_grads[pname]
        assert p.grad is not None and g is not None, pname
        scale = float(g.abs().max())
        assert scale > 0, pname  # every parameter takes part
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6 * scale, msg=pname)

    if len(module.loss_types) > 1:  # each component is logged; they add up to the loss
        parts = [metrics[f"loss/{t}"] for t in module.loss_types]
        total = sum(w * v for w, v in zip(module.loss_weights, parts))
        assert total.item() == pytest.approx(ours.item(), rel=1e-6)


def test_the_cases_are_away_from_their_trivial_point(setup):
    """The policy differs from the reference (rewards both ways) and the loss types give
    different values on this batch, so each comparison above can tell them apart."""
    _, _, ours_batch, noise, model_dir = setup
    values = {}
    for name in LOSS_TYPES:
        loss, _, _, _ = _our_loss(model_dir, ours_batch, noise, CASES[name])
        values[name] = round(loss.item(), 6)
    assert len(set(values.values())) == len(values), values
    _, metrics, _, _ = _our_loss(model_dir, ours_batch, noise, CASES["sigmoid"])
    assert 0 < metrics["rewards/accuracy"].item() < 1
    # ld_alpha changes the log-probs of the pairs of unequal lengths (all four here)
    _, ld, _, _ = _our_loss(model_dir, ours_batch, noise, CASES["ld_alpha"])
    assert ld["logps/chosen"].item() != pytest.approx(metrics["logps/chosen"].item(), abs=1e-3)
