"""GRPO with LoRA: rollouts run the live adapter through the engine's adapter slots (the
path served adapters take), never merged, and agree with the training forward."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_helpers import make_grpo, prompt_data, prompt_module
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.inference import InferenceEngine
from astrai.inference.adapters import LIVE_ADAPTER
from astrai.model import merge_lora

LENGTH_REWARD = "test_grpo_lora_length"


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    return float(len(completion) % 3)  # varies across a random policy's samples


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-lora"))


def _grpo(root, tok, **kw):
    module = make_grpo(root, tok, lora=LORA, kl_coef=0.0, **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a non-zero adapter, so that generation depends on it
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _held(engine):
    return [h.info.name for h in engine.adapters.slots.holder if h is not None]


def test_rollouts_run_the_live_adapter_in_a_slot_and_match_training(prompt_setup):
    """The rollout engine serves the policy's adapter as its live adapter (one slot), and
    the training forward gives the rollouts' own log-probs back: ratio 1 (1e-5)."""
    root, tok = prompt_setup
    module = _grpo(root, tok, temperature=0.7)
    engine = module.engine
    assert engine.lora_enabled and engine.adapters.default.info.name == LIVE_ADAPTER
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    _, metrics = module.compute_loss({"prompt_ids": prompts, "records": [{"answer": "5"}] * 2})
    assert _held(engine) == [LIVE_ADAPTER]  # the rollouts took the slot path
    assert metrics["ratio"].item() == pytest.approx(1.0, abs=1e-5)
    module.teardown("fit")


def test_live_adapter_rollouts_equal_the_merged_policy(prompt_setup):
    """Greedy rollouts through the slot path are the merged policy's, token for token, and
    their log-probs agree to 1e-5, also after the adapter trained (the versioned update
    re-reads its tensors)."""
    root, tok = prompt_setup
    module = _grpo(root, tok)
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 7 - 1?"), tok.encode("Hi")]

    def check(version: int) -> None:
        engine = module.engine
        if version > engine.policy_version:
            engine.update_weights(version=version)
        got = engine.run_batch(prompts, temperature=0.0, max_tokens=8, return_logprobs=True)
        merged = merge_lora(copy.deepcopy(module.model)).eval()
        with InferenceEngine(merged, tok, max_batch_size=4, max_seq_len=64) as ref_engine:
            want = ref_engine.run_batch(
                prompts, temperature=0.0, max_tokens=8, return_logprobs=True
            )
        for (ids, lps), (ref_ids, ref_lps) in zip(got, want):
            assert ids == ref_ids
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-5, rtol=0)

    check(0)
    with torch.no_grad():  # what an optimizer step does to the adapter
        for name, p in module.model.named_parameters():
            if "lora_" in name:
                p.mul_(1.5).add_(0.01)
    check(1)
    module.teardown("fit")


def test_lora_grpo_trains_under_lightning_and_keeps_matching(prompt_setup, tmp_path):
    """Two real optimizer steps move the adapter; the next rollouts still give ratio 1."""
    root, tok = prompt_setup
    module = _grpo(root, tok, temperature=0.7, rewards=[LENGTH_REWARD])
    before = {k: v.clone() for k, v in module.model.state_dict().items() if "lora_" in k}
    trainer = quiet_trainer(
        default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, use_distributed_sampler=False
    )
    trainer.fit(module, datamodule=prompt_module(root))
    after = module.model.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in before.items())
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    _, metrics = module.compute_loss({"prompt_ids": prompts, "records": [{"answer": "5"}] * 2})
    assert module.engine.policy_version == 2
    assert metrics["ratio"].item() == pytest.approx(1.0, abs=1e-5)
    module.teardown("fit")


def test_deep_copies_of_a_served_policy_carry_no_engine_state(prompt_setup):
    """An export or a frozen reference copied from a policy an engine serves has no adapter
    slots of its own (engine state is not model state)."""
    root, tok = prompt_setup
    module = _grpo(root, tok)
    engine = module.engine
    hooked = [m for m in module.model.modules() if getattr(m, "lora", None) is not None]
    assert hooked
    clone = copy.deepcopy(module.model)
    assert all(getattr(m, "lora", None) is None for m in clone.modules())
    engine.shutdown()
    assert all(getattr(m, "lora", None) is None for m in module.model.modules())


def test_rollouts_with_speculative_decoding_are_the_same_samples(prompt_setup):
    """`engine.speculative` in GRPO's engine: the seeded rollouts are the same completions,
    with the same log-probs (1e-5), as without it, so training sees no difference."""
    import functools

    root, tok = prompt_setup
    prompts = [tok.encode("What is 2 + 3?"), tok.encode("What is 3 * 4?")]
    batch = {"prompt_ids": prompts, "records": [{"answer": "5"}] * 2}
    runs = {}
    for name, spec in (("off", None), ("on", {"method": "ngram", "num_speculative_tokens": 3})):
        engine = functools.partial(
            InferenceEngine, max_batch_size=16, max_seq_len=64, speculative=spec
        )
        module = _grpo(root, tok, temperature=0.7, engine=engine)
        _, metrics = module.compute_loss(batch)
        runs[name] = (module.generation, metrics["ratio"].item())
        if spec is not None:
            assert module.engine.get_stats()["spec_draft_tokens"] > 0  # it did speculate
        module.teardown("fit")
    (off, _), (on, ratio) = runs["off"], runs["on"]
    assert on.completions == off.completions
    for a, b in zip(on.logprobs, off.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert ratio == pytest.approx(1.0, abs=1e-5)
