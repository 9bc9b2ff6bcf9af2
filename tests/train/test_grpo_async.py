"""Asynchronous GRPO (``async_rollouts``): staleness 0 is the synchronous run bit for bit;
staleness 1 samples each batch with the weights that started the previous one, and its loss
is the reference recomputed from the saved behaviour log-probs and versions; resume is exact;
the off-policy correction is TRL's."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_helpers import make_grpo, prompt_data, prompt_module
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from train_helpers import quiet_trainer

from astrai.data.rewards import register_reward
from astrai.train.module import token_logprobs
from astrai.train.strategies.grpo.async_source import AsyncRollouts
from astrai.train.strategies.grpo.generation import build_rollouts
from astrai.train.strategies.grpo.loss import (
    IS_CORRECTIONS,
    LOSS_TYPES,
    grpo_loss,
    importance_sampling_ratio,
)

LENGTH_REWARD = "test_grpo_async_length"


@register_reward(LENGTH_REWARD)
def _length(record, completion):
    return float(len(completion) % 3)


KW = dict(rewards=[LENGTH_REWARD], loss_type="bnpo", kl_coef=0.0, rollout_seed=3)


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("grpo-async"))


class _Trace(Callback):
    """Per micro-step: the weights it started with, the generation it trained on, its loss."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.generations: list = []
        self.losses: list[float] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.weights.append({k: v.detach().clone() for k, v in module.model.state_dict().items()})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.generations.append(module.generation)
        self.losses.append(float(outputs["loss"]))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(root, tok, steps, *, trace=None, ckpt_dir=None, ckpt_path=None, **kw):
    module = make_grpo(root, tok, **{**KW, **kw})
    callbacks = [trace] if trace is not None else []
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="s{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    trainer = quiet_trainer(
        default_root_dir=ckpt_dir,
        max_steps=steps,
        callbacks=callbacks,
        enable_checkpointing=ckpt_dir is not None,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root), ckpt_path=ckpt_path)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}, module


# ------------------------------------------------------------------ staleness 0
def test_staleness_zero_is_the_synchronous_run(prompt_setup):
    """Every batch sampled on the generator thread, by the engine on its own copy of the
    weights (updated by snapshot), waited for at once: the same weights, bit for bit."""
    root, tok = prompt_setup
    sync, _ = _fit(root, tok, 3)
    trace = _Trace()
    zero, module = _fit(root, tok, 3, trace=trace, async_rollouts={"max_staleness": 0})
    assert module.batch_lookahead == 0
    assert [m["train/async/staleness"] for m in trace.metrics] == [0.0, 0.0, 0.0]
    assert [g.versions[0] for g in trace.generations] == [0, 1, 2]  # its copy was updated
    initial = make_grpo(root, tok, **KW).model.state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in sync.items())
    for key, value in sync.items():
        assert torch.equal(zero[key], value), key


# ------------------------------------------------------------------ staleness 1
def _behaviour_logp(root, tok, weights, generation):
    """Log-probs of the generation's completions under ``weights`` (a fresh module's model)."""
    model = make_grpo(root, tok, **KW).model
    model.load_state_dict(weights)
    r = build_rollouts(generation.prompts, generation.completions, generation.logprobs)
    with torch.no_grad():
        logp = token_logprobs(model(r.input_ids)[:, :-1], r.input_ids[:, 1:])
    return logp, r


def test_staleness_one_is_sampled_ahead_and_its_loss_is_the_reference(prompt_setup):
    """Batch n + 1 is sampled by the weights that started batch n (its saved behaviour
    log-probs are theirs); trained with the next weights, the loss is TRL's with the old
    log-probs recomputed at first use and the truncated importance ratio towards the
    behaviour policy, recomputed here from the saved log-probs and versions."""
    root, tok = prompt_setup
    trace = _Trace()
    clip_max = 1.02  # low, so that some weights are truncated
    _fit(
        root,
        tok,
        4,
        trace=trace,
        async_rollouts={"max_staleness": 1, "importance_sampling_clip_max": clip_max},
    )
    staleness = [m["train/async/staleness"] for m in trace.metrics]
    assert staleness == [0.0, 1.0, 1.0, 1.0]  # the first batch could not be sampled ahead
    for step in range(1, 4):
        generation = trace.generations[step]
        assert generation.versions == [step - 1] * len(generation.completions)
        # the saved behaviour log-probs are those of the weights that started step - 1
        behaviour, r = _behaviour_logp(root, tok, trace.weights[step - 1], generation)
        torch.testing.assert_close(behaviour * r.mask, r.old_logp, atol=1e-5, rtol=1e-5)
        # the loss, recomputed: old = the weights at first use (this step's), ratio 1
        logp, _ = _behaviour_logp(root, tok, trace.weights[step], generation)
        weight = torch.clamp(torch.exp((logp - r.old_logp) * r.mask), max=clip_max)
        adv = torch.tensor(generation.advantages).unsqueeze(-1)
        expected = (-adv * weight * r.mask).sum() / r.mask.sum()  # bnpo, no KL, ratio 1
        assert trace.losses[step] == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
        truncated = (torch.exp((logp - r.old_logp) * r.mask) > clip_max) & r.mask.bool()
        assert truncated.any()  # the cap was exercised
        assert trace.metrics[step]["train/async/is_ratio_max"] == pytest.approx(clip_max)
    # on-policy first batch: no correction at all
    assert trace.generations[0].is_weights is None


def test_staleness_two_samples_two_batches_ahead(prompt_setup):
    """K = 2: the first batch queues the next two with its weights; from then on each new
    batch is queued two ahead, so the staleness runs 0, 1, 2, 2."""
    root, tok = prompt_setup
    trace = _Trace()
    _fit(root, tok, 4, trace=trace, async_rollouts={"max_staleness": 2})
    assert [m["train/async/staleness"] for m in trace.metrics] == [0.0, 1.0, 2.0, 2.0]
    assert [g.versions[0] for g in trace.generations] == [0, 0, 0, 1]
    assert trace.metrics[-1]["train/async/staleness_frac/2"] == pytest.approx(0.5)


@pytest.mark.parametrize("staleness", [0, 1])
def test_async_resume_is_exact(prompt_setup, tmp_path, staleness):
    """The checkpoint waits for the batch queued ahead and carries its samples: resumed from
    step 2, the run ends where the uninterrupted one does, bit for bit (staleness 0 has
    nothing queued between steps)."""
    root, tok = prompt_setup
    options = {"async_rollouts": {"max_staleness": staleness}}
    final, _ = _fit(root, tok, 4, ckpt_dir=tmp_path / "a", **options)
    (mid,) = (tmp_path / "a").glob("s*2.ckpt")
    saved = torch.load(mid, weights_only=False)
    resumed, _ = _fit(root, tok, 4, ckpt_dir=tmp_path / "b", ckpt_path=mid, **options)
    for key, value in final.items():
        assert torch.equal(resumed[key], value), key
    if staleness == 0:
        assert "grpo_pending" not in saved
        return
    (pending,) = saved["grpo_pending"]
    assert pending["samples"]["version"] == 1  # sampled by the weights that started step 1
    # Without the queued samples (a checkpoint written without them) the resumed run samples
    # them again, with the checkpoint's weights and the same seed: another run, but the same
    # one every time.
    del saved["grpo_pending"]
    torch.save(saved, tmp_path / "no-pending.ckpt")
    again = [
        _fit(
            root, tok, 4, ckpt_dir=tmp_path / d, ckpt_path=tmp_path / "no-pending.ckpt", **options
        )[0]
        for d in ("c", "d")
    ]
    assert any(not torch.equal(again[0][k], v) for k, v in final.items())
    for key, value in again[0].items():
        assert torch.equal(again[1][key], value), key


def test_the_loader_shows_the_next_batches(prompt_setup):
    """``batch_lookahead`` K: each batch carries the next K of its epoch (fewer at its end;
    that the data position is untouched is the exact-resume test's)."""
    from astrai.data.datamodule import with_upcoming

    batches = [{"prompt_ids": [[i]]} for i in range(5)]
    seen = [[u["prompt_ids"][0][0] for u in b["upcoming"]] for b in with_upcoming(iter(batches), 2)]
    assert seen == [[1, 2], [2, 3], [3, 4], [4], []]
    assert list(with_upcoming(iter(batches), 0)) == batches


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_staleness": 1.5}, "max_staleness"),
        ({"importance_sampling_correction": "clip"}, "importance_sampling_correction"),
        ({"importance_sampling_clip_max": -1.0}, "importance_sampling_clip_max"),
        ({"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 1.0}, "clip_min"),
        ({"generator_threads": 0}, "generator_threads"),
        ({"staleness": 1}, "unknown key"),
        (3, "mapping"),
    ],
)
def test_bad_async_options_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        AsyncRollouts.parse(spec)


# ------------------------------------------------------------------ against TRL
def _tensors():
    g = torch.Generator().manual_seed(11)
    n, c = 4, 5
    mask = torch.zeros(n, c)
    for i, length in enumerate([5, 2, 4, 3]):
        mask[i, :length] = 1
    logp = -2.0 * torch.rand(n, c, generator=g)
    old = logp + 0.3 * torch.randn(n, c, generator=g)
    behaviour = old + 0.8 * torch.randn(n, c, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    return logp, old, behaviour, adv, mask


def _trl_is_ratio(old, behaviour, mask, mode, low, high):
    """TRL 1.16's ``_generate_and_score_completions`` lines, transcribed."""
    diff = (old - behaviour) * mask
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return ratio if low is None and high is None else torch.clamp(ratio, min=low, max=high)
    lo = low if low is not None else -math.inf
    hi = high if high is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


@pytest.mark.parametrize("mode", IS_CORRECTIONS)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 1.5)])
def test_importance_sampling_ratio_is_trls(mode, bounds):
    _, old, behaviour, _, mask = _tensors()
    ours = importance_sampling_ratio(
        old, behaviour, mask, mode=mode, clip_min=bounds[0], clip_max=bounds[1]
    )
    torch.testing.assert_close(ours, _trl_is_ratio(old, behaviour, mask, mode, *bounds))
    if bounds == (0.5, 1.5):  # the bounds bite in every mode on these tensors
        assert not torch.equal(ours, _trl_is_ratio(old, behaviour, mask, mode, None, None))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("trl")
    from trl_helpers import hf_parts

    return hf_parts(tmp_path_factory.mktemp("trl-async"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_corrected_loss_equals_trl(hf, loss_type, mode):
    """The off-policy weight enters the loss where TRL's vLLM correction does: on the policy
    term, not the KL."""
    from trl_helpers import grpo_trainer, trl_loss

    logp, old, behaviour, adv, mask = _tensors()
    ref = logp + 0.2
    ratio = importance_sampling_ratio(old, behaviour, mask, mode=mode, clip_max=2.0)
    trainer = grpo_trainer(
        hf, f"async-{loss_type}-{mode}", beta=0.04, loss_type=loss_type, max_completion_length=6
    )
    theirs = trl_loss(trainer, logp, old, ref, adv, mask, is_ratio=ratio)
    ours, _ = grpo_loss(
        logp,
        old,
        adv,
        mask,
        loss_type=loss_type,
        ref_logp=ref,
        kl_coef=0.04,
        use_bias_correction_kl=True,
        max_completion_length=6,
        is_weight=ratio,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    plain, _ = grpo_loss(
        logp, old, adv, mask, loss_type=loss_type, ref_logp=ref, kl_coef=0.04,
        use_bias_correction_kl=True, max_completion_length=6,
    )  # fmt: skip
    assert not torch.allclose(plain, ours)


def test_refused_under_fsdp2_naming_the_key(prompt_setup):
    """Its generator copies the live policy, which FSDP2 shards: refused when the strategy
    shards the module (`shard_companions`), before any step."""
    root, tok = prompt_setup
    module = make_grpo(root, tok, **KW, async_rollouts={"max_staleness": 1})
    with pytest.raises(ValueError, match=r"strategy\.async_rollouts.*trainer=fsdp2"):
        module.shard_companions(lambda model: None)
