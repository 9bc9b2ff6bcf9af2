"""The planted run of the bisect, rebuild and attribute tests: tiny GRPO whose reward flips
at step FLIP (`_rewards.Planted`), a ledger and a checkpoint after every step."""

from __future__ import annotations

from pathlib import Path

from grpo_helpers import TINY_GRPO_CLI

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _rewards, _probes
FLIP = 5
STEPS = 8
GROUP = 4  # completions per prompt (TINY_GRPO_CLI)
PROMPTS = 4
PLANTED = [
    *TINY_GRPO_CLI,
    f"data.batch_size={PROMPTS}",
    "strategy.num_iterations=1",
    "strategy.kl_coef=0.0",
    "strategy.scale_rewards=none",
    "optim.weight_decay=0.0",
    "strategy.rewards=[{_target_: _rewards.Planted, flip_at: "
    f"{FLIP}, calls_per_step: {PROMPTS * GROUP}}}]",
    f"trainer.max_steps={STEPS}",
    "ledger=true",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
]


def planted_run(reference_run) -> Path:
    return reference_run("bisect-planted", PLANTED, env=ENV)


def sparse_copy(run: Path, where: Path, keep: tuple[str, ...]) -> Path:
    """A copy of ``run`` with only the checkpoints named in ``keep``."""
    import shutil

    shutil.copytree(run, where)
    for ckpt in (where / "checkpoints").glob("*.ckpt"):
        if ckpt.name not in keep:
            ckpt.unlink()
    return where
