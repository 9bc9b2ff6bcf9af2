"""Kill-anywhere resume of every preference strategy of #30 (`python -m astrai.train ...
ckpt_path=last`): each run is SIGKILLed in the optimizer step after a checkpoint and resumed;
it must end with the uninterrupted run's weights and optimizer state, bit for bit. LoRA
dropout draws from the global RNG at every step, so a resumed run that replayed the random
stream from the wrong place would differ. The reference-free strategies (SimPO, CPO, ORPO)
and the reward model also show here that their checkpoints hold nothing but the policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import TINY_MODEL, checkpoint_differences, cli, run_dirs

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
KILL = {"PYTHONPATH": str(HERE)}  # the test-only KillAtStep callback
STEPS = 4

COMMON = [
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "callbacks.model_checkpoint.save_top_k=-1",
    "optim.schedule.warmup_steps=1",
    "data.batch_size=4",
    "data.num_workers=0",
    "strategy.lora={r: 4, lora_alpha: 8, lora_dropout: 0.2}",
]
PAIRS = [
    "data=arithmetic_preference",
    "data.train.prepare.builtin.n=48",
    "data.val.prepare.builtin.n=8",
]

# (strategy, its extra overrides); each is a new strategy of #30, DPO with its new options
CASES = {
    "simpo": ["strategy=simpo", *PAIRS],
    "cpo": ["strategy=cpo", *PAIRS],
    "orpo": ["strategy=orpo", *PAIRS],
    "reward": ["strategy=reward", *PAIRS, "strategy.center_rewards_coefficient=0.01"],
    "dpo_losses": [
        "strategy=dpo",
        *PAIRS,
        "strategy.loss_type=[sigmoid,bco_pair,sft]",
        "strategy.loss_weights=[0.8,0.2,1.0]",
        "strategy.padding_free=true",
    ],
    "kto": ["strategy=kto", "data=unpaired_files"],
}
REFERENCE_FREE = ("simpo", "cpo", "orpo", "reward")


def unpaired_files(root: Path) -> list[str]:
    """The built-in preference pairs as unpaired KTO records: chosen up, rejected down."""
    from astrai.data.builtin import builtin_records

    paths = []
    for split, n, seed in (("train", 24, 0), ("val", 4, 1)):
        path = root / f"unpaired_{split}.jsonl"
        with path.open("w") as f:
            records = builtin_records(f"arithmetic/preference/{split}", n=n, seed=seed)
            for rec in records:
                for side, label in (("chosen", True), ("rejected", False)):
                    row = {"prompt": rec["prompt"], "completion": rec[side], "label": label}
                    f.write(json.dumps(row) + "\n")
        paths.append(f"data.{split}.source={path}")
    return paths


@pytest.mark.parametrize("case", sorted(CASES))
def test_kill_after_a_checkpoint_resumes_bit_identical(case, tmp_path, data_dir):
    run = [*COMMON, *CASES[case]]
    if case == "kto":
        run += unpaired_files(tmp_path)
    cli([*run, *run_dirs(tmp_path / "ref", data_dir)], env=KILL)
    where = tmp_path / "killed"
    args = [*run, *run_dirs(where, data_dir)]
    killed = cli(
        [*args, "+callbacks.kill._target_=_callbacks.KillAtStep", "+callbacks.kill.step=2"],
        check=False,
        env=KILL,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    cli([*args, "ckpt_path=last"], env=KILL)
    different = checkpoint_differences(tmp_path / "ref" / "run", where / "run", STEPS)
    assert not different, f"{case}: {different}"

    ckpts = where / "run" / "checkpoints"
    first = torch.load(ckpts / "step000002.ckpt", map_location="cpu", weights_only=False)
    last = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=False)
    assert any(  # the weights moved: the comparison above is not of untouched weights
        not torch.equal(v, last["state_dict"][k]) for k, v in first["state_dict"].items()
    )
    if case in REFERENCE_FREE:  # nothing but the policy (and its head) is kept
        assert "dpo_reference" not in last
        assert not [k for k in last["state_dict"] if "reference" in k]
