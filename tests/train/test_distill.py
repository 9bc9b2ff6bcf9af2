"""strategy=distill end to end: the student's on-policy rollouts are the engine's seeded
generations; a short tiny_distill run (a tiny teacher trained by tiny_sft first) moves the
student towards the teacher, records its on-policy samples in the step ledger, resumes
bit-exact after a SIGKILL in the middle of a step, and a replay of its steps from the
ledger reproduces them bit for bit."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import h5py
import pytest
import torch
from test_replay import checkpoint_digest, replay
from train_helpers import TINY_MODEL, checkpoint_differences, cli, run_dirs

from astrai.data import SFTDataset
from astrai.inference import InferenceEngine
from astrai.model import Transformer, load_pretrained
from astrai.model.hub import read_config
from astrai.train.strategies.distill import DistillModule
from astrai.train.strategies.distill.sequences import dataset_sequences, prompts_of
from astrai.train.strategies.distill.stored_teacher import StoredTopKTeacher
from astrai.train.strategies.distill.teacher import DistillLoss

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": str(HERE)}  # _callbacks (KillAtStep)

SHARED = [
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",  # shared with the other CLI tests' cache
    "data.train.prepare.builtin.n=64",
    "callbacks=default",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
]
TEACHER = [
    "+experiment=tiny_sft",
    *SHARED,
    "trainer.max_steps=12",
    "trainer.limit_val_batches=0",
    "data.batch_size=8",
    "optim.lr=3e-3",
    "optim.schedule.warmup_steps=2",
]
STEPS = 6


def distill_args(teacher: Path) -> list[str]:
    return [
        "+experiment=tiny_distill",
        *SHARED,
        f"strategy.teacher_model_name_or_path={teacher}",
        "strategy.init_from=null",
        "strategy.lmbda=0.5",
        "strategy.max_new_tokens=8",
        "strategy.logits_chunk_size=16",
        "data.batch_size=4",
        "optim.lr=1e-2",
        "optim.schedule.warmup_steps=0",
        f"trainer.max_steps={STEPS}",
        "callbacks.model_checkpoint.every_n_train_steps=1",
        "callbacks.model_checkpoint.save_top_k=-1",
        "ledger=true",
    ]


def _student(tok_dir: Path, **options) -> DistillModule:
    return DistillModule(
        model=load_pretrained(tok_dir, dtype=torch.float32).train(),
        tokenizer=str(tok_dir),
        teacher_model_name_or_path=str(tok_dir),
        engine=functools.partial(InferenceEngine, max_batch_size=8, max_seq_len=96),
        **options,
    )


def test_student_rollouts_are_the_engines_seeded_generations(
    tmp_path, stdlib_tokenizer, save_model_dir
):
    """The on-policy completions of a micro-batch are what the engine generates for its
    prompts with the micro-batch's seed (GRPO's scheme: rollout_seed + index * count), on
    the live weights; another seed gives other completions."""
    model_dir = save_model_dir(tmp_path / "m", stdlib_tokenizer, seed=3)
    module = _student(model_dir, lmbda=1.0, max_new_tokens=12, temperature=1.0, rollout_seed=7)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(stdlib_tokenizer), (3, 10), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 6:9] = ids[:, 7:10]
    labels[:, 9] = 5
    batch = {"input_ids": ids, "labels": labels}
    seqs = module.student_rollouts(batch)
    prompts = prompts_of(batch)
    assert [len(p) for p in prompts] == [7, 7, 7]

    reference = copy.deepcopy(module.model).eval()
    engine = InferenceEngine(reference, stdlib_tokenizer, max_batch_size=8, max_seq_len=96)
    try:
        params = module.options.sampling
        seed = module.rollout_seed(len(prompts))
        assert seed == 7  # micro-batch 0 of a one-process run
        expected = engine.run_batch(prompts, params, seed=seed, return_details=True)
        other = engine.run_batch(prompts, params, seed=seed + 1, return_details=True)
    finally:
        engine.shutdown()
    for i, (prompt, result) in enumerate(zip(prompts, expected)):
        row = prompt + list(result.token_ids)
        assert seqs.input_ids[i, : len(row)].tolist() == row
        assert int(seqs.mask[i].sum()) == len(result.token_ids)
    assert [r.token_ids for r in other] != [r.token_ids for r in expected]
    module.teardown("fit")


def _student_logits(state: dict, teacher_dir: Path, batch: dict):
    """A checkpoint's student logits ``[n, V]`` at the trained positions of ``batch`` (the
    dataset's completions), those positions, and the sequences."""
    student = Transformer(read_config(teacher_dir))
    student.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    seqs = dataset_sequences(batch, 0)
    positions = seqs.mask.reshape(-1).nonzero()[:, 0]
    with torch.no_grad():
        logits = student.eval()(seqs.input_ids)[:, :-1]
    return logits.reshape(-1, logits.shape[-1])[positions], positions, seqs


def _gkd_to_teacher(state: dict, teacher_dir: Path, batch: dict) -> float:
    """The generalised JSD (beta 0.5) of a student state from the teacher on a fixed batch of
    the dataset's completions."""
    from astrai.train.strategies.distill.losses import generalized_jsd

    s, positions, seqs = _student_logits(state, teacher_dir, batch)
    teacher = load_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        t = teacher(seqs.input_ids)[:, :-1]
    t = t.reshape(-1, t.shape[-1])[positions]
    return float(generalized_jsd(s, t, 0.5).mean())


def _stored_to_teacher(state: dict, teacher_dir: Path, batch: dict) -> float:
    """The stored-top-k loss (beta 0.5, with the tail) of a student state on a fixed batch."""
    s, positions, seqs = _student_logits(state, teacher_dir, batch)
    scores = StoredTopKTeacher().score(seqs.input_ids, batch)
    return float(scores.divergence(positions, s, s.argmax(-1), DistillLoss()).mean())


@pytest.mark.slow
def test_tiny_distill_trains_resumes_and_replays(reference_run, tmp_path, data_dir):
    teacher_run = reference_run("distill-teacher", TEACHER)
    teacher = teacher_run / "export"
    assert (teacher / "config.json").is_file()
    args = distill_args(teacher)

    straight = tmp_path / "straight"
    cli([*args, *run_dirs(straight, data_dir)], env=ENV)
    run = straight / "run"
    with h5py.File(run / "ledger.h5") as f:
        on_policy = len(f["rollouts/seed"])
        assert 0 < on_policy < STEPS, on_policy  # lmbda 0.5: both kinds of micro-batch
        assert len(f["rollouts/completion_tokens"]) > 0

    # the student moved towards the teacher (measured on the dataset's own completions)
    data = SFTDataset(next((data_dir / "prepared").glob("sft-*/arithmetic_sft_train.h5")))
    batch = data.collate([data[i] for i in range(8)])
    ckpt = run / "checkpoints"
    first = torch.load(ckpt / "step000001.ckpt", map_location="cpu", weights_only=False)
    last = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=False)
    before = _gkd_to_teacher(first["state_dict"], teacher, batch)
    after = _gkd_to_teacher(last["state_dict"], teacher, batch)
    assert after < 0.8 * before, (before, after)
    assert "distill_lmbda_generator" in last

    # killed in the middle of step 4 (after its backward), resumed: bit-identical
    killed_dir = tmp_path / "killed"
    killed_args = [*args, *run_dirs(killed_dir, data_dir)]
    killed = cli(
        [*killed_args, "+callbacks.kill._target_=_callbacks.KillAtStep", "+callbacks.kill.step=3"],
        env=ENV,
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    cli([*killed_args, "ckpt_path=last"], env=ENV)
    assert not checkpoint_differences(run, killed_dir / "run", STEPS)

    # a replay of steps 2..STEPS from step 1's checkpoint, with the ledger's rollouts
    out = tmp_path / "replay.json"
    proc = replay(run, "step=2", "--until", str(STEPS), out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    checks = json.loads(out.read_text())
    assert [(c["step"], c["ok"]) for c in checks] == [(s, True) for s in range(2, STEPS + 1)]
    assert checks[-1]["replayed"]["weights_digest"] == checkpoint_digest(
        ckpt / f"step{STEPS:06d}.ckpt"
    )

    # offline: the same teacher's top-k stored by prepare (data=arithmetic_sft_kd), no teacher
    # path, lmbda 0: no teacher model is loaded, no rollouts, and the student moves towards
    # the stored targets
    offline_dir = tmp_path / "offline"
    offline = [
        *[a for a in args if not a.startswith(("strategy.teacher_model", "strategy.lmbda"))],
        "data=arithmetic_sft_kd",
        f"data.train.prepare.teacher={teacher}",
        f"data.val.prepare.teacher={teacher}",
        "data.val.prepare.builtin.n=16",
        "strategy.lmbda=0",
        "strategy.teacher_model_name_or_path=null",
        *run_dirs(offline_dir, data_dir),
    ]
    proc = cli(offline, env=ENV)
    assert "teacher loaded" not in proc.stdout + proc.stderr
    off = offline_dir / "run"
    with h5py.File(off / "ledger.h5") as f:
        assert "rollouts/seed" not in f or len(f["rollouts/seed"]) == 0
    kd = SFTDataset(next((data_dir / "prepared").glob("sft-*/arithmetic_sft_kd_train.h5")))
    batch = kd.collate([kd[i] for i in range(8)])
    first = torch.load(off / "checkpoints/step000001.ckpt", map_location="cpu", weights_only=False)
    last = torch.load(off / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    before = _stored_to_teacher(first["state_dict"], teacher, batch)
    after = _stored_to_teacher(last["state_dict"], teacher, batch)
    assert after < 0.8 * before, (before, after)
