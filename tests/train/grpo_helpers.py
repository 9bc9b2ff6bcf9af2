"""Helpers for the GRPO tests: a tiny module on built-in arithmetic prompts, canned results."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.train.optim import adamw, constant


def prompt_data(root: Path) -> tuple[Path, Any]:
    """A tokenizer trained on the arithmetic chats and 32 prepared prompts (`prompts.h5`)."""
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    texts = [m["content"] for r in sft_records(arithmetic_problems(300)) for m in r["messages"]]
    tok = AutoTokenizer.train(texts * 2, vocab_size=320)
    tok.save_pretrained(root / "tok")
    prepare(
        "prompt",
        "builtin:arithmetic/prompt/train",
        root,
        root / "tok",
        name="prompts",
        required_fields=["answer"],
        builtin={"n": 32, "seed": 0},
        progress=False,
    )
    return root, tok


def prompt_module(root: Path, batch_size: int = 2) -> Any:
    """A data module over `prompt_data`'s 32 prompts (seed 0)."""
    from astrai.data import AstraiDataModule, PromptDataset

    return AstraiDataModule(
        train=PromptDataset(str(root / "prompts.h5")), batch_size=batch_size, seed=0
    )


def make_grpo(root: Path, tok: Any, **kw: Any) -> Any:
    """A `GRPOModule` on the tiny preset (seeded: equal arguments give equal weights)."""
    from astrai.train.strategies.grpo import GRPOModule

    torch.manual_seed(0)
    args = dict(
        model=functools.partial(preset_model, "tiny", vocab_size=320),
        optimizer=functools.partial(adamw, lr=1e-3),
        scheduler=constant,
        tokenizer=str(root / "tok"),
        num_generations=4,
        max_new_tokens=6,
        rewards=[{"name": "exact_match", "weight": 1.0}, {"name": "format", "weight": 0.5}],
        kl_coef=0.1,
        epsilon=0.2,
        engine=functools.partial(InferenceEngine, max_batch_size=16, max_seq_len=64),
    )
    args.update(kw)
    return GRPOModule(**args)


class FakeResult:
    """A `BatchResult` stand-in: canned token ids and log-probs."""

    def __init__(self, ids: list[int], lps: list[float], finish_reason: str = "stop") -> None:
        self.token_ids, self.logprobs = ids, lps
        self.finish_reason, self.error = finish_reason, None


# canned completions whose lengths differ per prompt (and so do the micro-batches' token counts)
CANNED_TEXTS = [
    ["The answer is 5.", "x", "The answer is 77.", "y"],
    ["1", "The answer is 2.", "z", "w"],
]


def fit_one_canned_step(
    root: Path, tok: Any, *, batch_size: int, accumulate: int, **options: Any
) -> tuple[dict[str, torch.Tensor], list[tuple[int, ...]]]:
    """One SGD step (lr 1) under Lightning of a `make_grpo` module rewarded by `format`, its
    rollouts `CANNED_TEXTS` in turn per prompt: the weights after it and the prompts in the
    order first seen."""
    from train_helpers import quiet_trainer

    module = make_grpo(
        root,
        tok,
        rewards=["format"],
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1.0),
        **options,
    )
    order: dict[tuple[int, ...], int] = {}

    def fake_generate(prompt_list: Any, *, seed: int, params: Any) -> list[FakeResult]:
        out = []
        for p in prompt_list:
            k = order.setdefault(tuple(p), len(order))
            for i in range(params.n):
                ids = tok.encode(CANNED_TEXTS[k % 2][i])
                out.append(FakeResult(ids, [-0.5 - 0.1 * (j % 3) for j in range(len(ids))]))
        return out

    module.live_source.generate = fake_generate
    trainer = quiet_trainer(
        max_steps=1,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=prompt_module(root, batch_size))
    return module.model.state_dict(), list(order)


# tiny_grpo made small: a fresh tiny model, mu = 2, a test reward plugged in by `_target_`
# (tests/train/_rewards.py: varies for a random policy, so the policy moves)
TINY_GRPO_CLI = [
    "+experiment=tiny_grpo",
    "model=tiny",
    "tokenizer.train.max_bytes=400000",  # shared with the other CLI tests' cache
    "tokenizer.train.vocab_size=512",
    "data.train.prepare.builtin.n=32",
    "strategy.init_from=null",
    "strategy.num_generations=4",
    "strategy.max_new_tokens=8",
    "strategy.num_iterations=2",
    "strategy.kl_coef=0.04",
    "strategy.rewards=[{_target_: _rewards.length_mod3, _partial_: true}]",
    "callbacks=default",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    "optim.lr=1e-2",
]
