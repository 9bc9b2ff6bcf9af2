"""Our GRPO loss against TRL's own: every ``loss_type`` is computed by TRL 1.16's
``GRPOTrainer._compute_loss`` (a real trainer on a tiny random local Llama) from the same
per-token log-probs, old and reference log-probs, advantages and completion masks, and must
match ours in value, gradient and clip-ratio metrics. And TRL's dapo normaliser over a
simulated two-rank split (gradient accumulation under Lightning: test_grpo.py)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from astrai.train.strategies.grpo_loss import LOSS_TYPES, grpo_loss  # noqa: E402

VOCAB = 32
EPSILON, EPSILON_HIGH, BETA, MAX_COMPLETION = 0.2, 0.28, 0.04, 6


@pytest.fixture(scope="module")
def hf_parts(tmp_path_factory):
    """A saved tiny random Llama (TRL loads its reference model from the path) and a
    word-level tokenizer built in memory: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("trl")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    word = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="t0", eos_token="t1")
    return root, tok


def _trainer(hf_parts, loss_type: str, bias_correction: bool):
    from datasets import Dataset

    root, tok = hf_parts
    args = trl.GRPOConfig(
        output_dir=str(root / f"out-{loss_type}-{bias_correction}"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        beta=BETA,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        loss_type=loss_type,
        use_bias_correction_kl=bias_correction,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = trl.GRPOTrainer(
        model=str(root / "model"),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["t2 t3"] * 4}),
        processing_class=tok,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one step here
    return trainer


def _batch():
    """Four completions of lengths 5, 3, 1 and 4 (padded to 5), ratios on both sides of the
    clip range, advantages of both signs, a reference that differs from the policy."""
    g = torch.Generator().manual_seed(3)
    n, c = 4, 5
    mask = torch.zeros(n, c)
    for i, length in enumerate([5, 3, 1, 4]):
        mask[i, :length] = 1
    logp = -2.0 * torch.rand(n, c, generator=g)
    old = logp + 0.4 * torch.randn(n, c, generator=g)
    ref = logp + 0.3 * torch.randn(n, c, generator=g)
    adv = torch.tensor([1.2, -0.7, 0.5, -1.0])
    return logp, old, ref, adv, mask


def _trl_loss(trainer, logp, old, ref, adv, mask):
    """TRL's `_compute_loss` with its log-prob forward replaced by our fixed tensor."""
    n, c = mask.shape
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logp,
        torch.zeros_like(logp),
        None,
    )
    inputs = {
        "prompt_ids": torch.full((n, 2), 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.full((n, c), 3, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return trainer._compute_loss(trainer.model, inputs)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_equals_trl(hf_parts, loss_type, bias_correction):
    trainer = _trainer(hf_parts, loss_type, bias_correction)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (EPSILON, EPSILON_HIGH)
    logp, old, ref, adv, mask = _batch()

    theirs_lp = logp.clone().requires_grad_(True)
    theirs = _trl_loss(trainer, theirs_lp, old, ref, adv, mask)
    theirs.backward()

    ours_lp = logp.clone().requires_grad_(True)
    ours, metrics = grpo_loss(
        ours_lp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        ref_logp=ref,
        kl_coef=BETA,
        use_bias_correction_kl=bias_correction,
        max_completion_length=MAX_COMPLETION,
    )
    ours.backward()

    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-6, atol=1e-8)
    assert ours_lp.grad[2, 1:].eq(0).all()  # padding of the one-token completion
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        assert metrics[key].item() == pytest.approx(logged[key], abs=1e-6), key
    # the batch exercises both clip regions and the asymmetric bound
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    ratio = torch.exp(logp - old)[mask.bool()]
    assert ((ratio > 1 + EPSILON) & (ratio <= 1 + EPSILON_HIGH)).any()


def test_the_loss_types_differ_on_this_batch():
    """So the comparison above can tell them apart (different lengths make the aggregations
    disagree); on one batch of one process dapo is bnpo (they part across micro-batches and
    ranks: test_grpo.py)."""
    logp, old, ref, adv, mask = _batch()
    values = {
        lt: grpo_loss(
            logp,
            old,
            adv,
            mask,
            loss_type=lt,
            epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH,
            ref_logp=ref,
            kl_coef=BETA,
            max_completion_length=MAX_COMPLETION,
        )[0].item()
        for lt in LOSS_TYPES
    }
    assert len({round(values[k], 6) for k in ("grpo", "bnpo", "dr_grpo")}) == 3, values
    assert values["dapo"] == pytest.approx(values["bnpo"], rel=1e-6)


def test_dapo_over_two_ranks_equals_one_process():
    """DDP averages the ranks' gradients; with ``num_items`` = global tokens / world size each
    rank's dapo loss averages to the single-process value, in value and gradient, even when
    the ranks hold different numbers of completion tokens (bnpo would not)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 5, generator=g)
    old = logp + 0.3 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.zeros(6, 5)
    for i, n in enumerate([5, 5, 4, 1, 2, 1]):  # rank 0: 14 tokens, rank 1: 4
        mask[i, :n] = 1
    kw = dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    whole = logp.clone().requires_grad_(True)
    single, _ = grpo_loss(whole, old, adv, mask, **kw)
    single.backward()
    split = logp.clone().requires_grad_(True)
    per_rank = [
        grpo_loss(split[r], old[r], adv[r], mask[r], num_items=mask.sum() / 2, **kw)[0]
        for r in (slice(0, 3), slice(3, 6))
    ]
    ddp = (per_rank[0] + per_rank[1]) / 2
    ddp.backward()
    torch.testing.assert_close(ddp, single)
    torch.testing.assert_close(split.grad, whole.grad)
    bnpo = [
        grpo_loss(logp[r], old[r], adv[r], mask[r], loss_type="bnpo")[0]
        for r in (
            slice(0, 3),
            slice(3, 6),
        )
    ]
    assert not torch.allclose((bnpo[0] + bnpo[1]) / 2, single)
