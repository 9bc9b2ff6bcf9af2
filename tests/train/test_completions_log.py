"""`astrai.train.completions_log.CompletionsLog` on a GRPO run with canned rollouts: the
JSONL rows are the rollouts' (texts, the reward function's value, group-normalised
advantages computed here in torch), logged at the due steps, and the W&B table (offline)
holds the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from grpo_helpers import CANNED_TEXTS, FakeResult, make_grpo, prompt_data, prompt_module
from train_helpers import quiet_trainer

from astrai.data.rewards import get_reward
from astrai.train.completions_log import CompletionsLog

G = 4


@pytest.fixture(scope="module")
def prompt_setup(tmp_path_factory):
    return prompt_data(tmp_path_factory.mktemp("completions"))


def _canned_module(root: Path, tok):
    module = make_grpo(root, tok, rewards=["format"], num_generations=G, kl_coef=0.0)
    order: dict[tuple[int, ...], int] = {}

    def fake_generate(prompt_list, *, seed, params):
        out = []
        for p in prompt_list:
            k = order.setdefault(tuple(p), len(order))
            for i in range(params.n):
                ids = tok.encode(CANNED_TEXTS[k % 2][i])
                out.append(FakeResult(ids, [-0.5] * len(ids)))
        return out

    module.live_source.generate = fake_generate
    return module


def _expected_advantages(rewards: list[float]) -> list[float]:
    r = torch.tensor(rewards).view(-1, G)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten().tolist()


def test_rows_are_the_rollouts_at_the_due_steps_and_the_wandb_table_has_them(
    prompt_setup, tmp_path, monkeypatch
) -> None:
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    root, tok = prompt_setup
    path = tmp_path / "run" / "completions.jsonl"
    logs = CompletionsLog(path, every_n_steps=2, num_completions_to_print=6)
    wandb = WandbLogger(save_dir=tmp_path, offline=True, project="astrai-test")
    trainer = quiet_trainer(
        max_steps=5,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=[logs],
        logger=wandb,
        log_every_n_steps=1,
    )
    trainer.fit(_canned_module(root, tok), datamodule=prompt_module(root, 2))
    run_dir = Path(wandb.experiment.dir)
    wandb.experiment.finish()

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # steps 0..4 each sample a batch; logged: the first at or after 0, 2 and 4
    assert [r["step"] for r in rows] == [0] * 6 + [2] * 6 + [4] * 6
    canned = [t for texts in CANNED_TEXTS for t in texts]
    for batch in (rows[:6], rows[6:12], rows[12:]):
        # 2 prompts x G completions, prompt-major: the first 6 are group 1 and half of 2
        texts = [r["completion"] for r in batch]
        assert texts in (canned[:6], canned[4:] + canned[:2]), texts
        rewards = [get_reward("format")({}, t) for t in canned]
        first = 0 if texts == canned[:6] else 4
        order = rewards[first:] + rewards[:first]
        for row, reward, adv in zip(batch, order, _expected_advantages(order), strict=False):
            assert row["reward"] == pytest.approx(reward)
            assert row["format"] == pytest.approx(reward)  # the reward function's column
            assert row["advantage"] == pytest.approx(adv, abs=1e-5)
            assert row["prompt"].strip() and not row["truncated"]
        assert len({r["prompt"] for r in batch[:G]}) == 1  # one group, one prompt

    tables = sorted((run_dir / "media" / "table").glob("completions_*.table.json"))
    assert len(tables) == 3
    table = json.loads(tables[0].read_text())
    assert table["columns"] == list(rows[0])
    assert [dict(zip(table["columns"], r, strict=True)) for r in table["data"]] in (
        rows[:6],
        rows[6:12],
        rows[12:],
    )


def test_a_module_without_rollouts_is_left_alone(tmp_path) -> None:
    import lightning as L

    logs = CompletionsLog(tmp_path / "c.jsonl")
    logs.setup(quiet_trainer(), L.LightningModule(), "fit")
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"every_n_steps": 0}, r"callbacks\.completions\.every_n_steps: 0"),
        ({"num_completions_to_print": 0}, r"callbacks\.completions\.num_completions_to_print"),
    ],
)
def test_bad_settings_are_refused_naming_the_option(tmp_path, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        CompletionsLog(tmp_path / "c.jsonl", **kw)


def test_the_next_due_step_travels_in_the_checkpoint(tmp_path) -> None:
    logs = CompletionsLog(tmp_path / "c.jsonl", every_n_steps=5)
    logs.next_step = 15
    resumed = CompletionsLog(tmp_path / "c.jsonl", every_n_steps=5)
    resumed.load_state_dict(logs.state_dict())
    assert resumed.next_step == 15
