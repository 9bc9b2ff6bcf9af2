"""Tensor parallelism (`trainer=fsdp2 trainer.strategy.tensor_parallel_size=N`,
`astrai.train.tensor_parallel`) on CPU processes (gloo): 2 tensor-parallel ranks train as one
process does (loss of every step, the logged gradient norm, the exported weights after 10
steps), with the chunked vocabulary-parallel head and with the dense one; composed with FSDP2
(2 x 2 ranks) likewise; a TP=2 run killed mid-step resumes bit for bit; bad settings are
refused before anything loads, naming the key.

The tiny model has tied embeddings (the head shares the vocabulary-sharded embedding) and
here Qwen3's q/k norms (their weight gradients sum the heads of both ranks); the gradient
clipping threshold is below these steps' norms, so the clipped norm must be the whole one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import SMALL, TINY_MODEL, cli

from astrai.model.config import preset
from astrai.train import preflight
from astrai.train.runner import compose
from astrai.train.sharding import FullyShardStrategy
from astrai.train.tensor_parallel import KEY, tensor_parallel_problems

HERE = Path(__file__).resolve().parent
STEPS = 10
COMMON = [
    *TINY_MODEL,
    *SMALL,
    "+model.qk_norm=true",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "optim.lr=1e-2",
    "trainer.gradient_clip_val=0.5",
    "callbacks.model_checkpoint.every_n_train_steps=1",
    "+callbacks.losses._target_=_scale_callbacks.GlobalLoss",
]
ONE = ["data.batch_size=8", "data.val_batch_size=8"]
TP2 = [
    "trainer=fsdp2",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    f"{KEY}=2",
    *ONE,  # one data-parallel rank: both tensor-parallel ranks read the same 8 rows
]
TP2_DP2 = [
    "trainer=fsdp2",
    "trainer.accelerator=cpu",
    "trainer.devices=4",
    f"{KEY}=2",
    "data.batch_size=4",
    "data.val_batch_size=4",
]


def _run(where: Path, data_dir: Path, extra: list[str], check: bool = True) -> int:
    proc = cli(
        [
            *COMMON,
            *extra,
            f"+callbacks.losses.path={where / 'losses.jsonl'}",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={where / 'outputs'}",
            f"hydra.run.dir={where / 'run'}",
        ],
        env={"PYTHONPATH": str(HERE)},
        check=check,
    )
    return proc.returncode


def _built(shared_build, data_dir: Path, label: str, extra: list[str]) -> Path:
    return shared_build(f"tp-{label}", lambda where: _run(where, data_dir, extra))


def _steps(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _grad_norms(run: Path) -> list[float]:
    import csv

    (metrics,) = (run / "run" / "csv").glob("*/metrics.csv")
    with open(metrics) as fh:
        return [float(r["train/grad_norm"]) for r in csv.DictReader(fh) if r["train/grad_norm"]]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "run" / "export" / "model.safetensors")


def _assert_equal_runs(run: Path, ref: Path) -> str:
    """`run` trained as `ref` did, within 1e-5: each step's samples and loss, the logged
    gradient norms, every exported weight. Returns the figures."""
    rows, ref_rows = _steps(run), _steps(ref)
    assert sorted(rows) == sorted(ref_rows) == list(range(1, STEPS + 1))
    for step, row in rows.items():  # (tensor-parallel ranks gather the same rows twice)
        assert set(row["samples"]) == set(ref_rows[step]["samples"]), step
    loss = max(abs(rows[s]["loss"] - ref_rows[s]["loss"]) for s in rows)
    norms, ref_norms = _grad_norms(run), _grad_norms(ref)
    assert any(n > 0.5 for n in ref_norms), ref_norms  # clipping engaged
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-4, atol=0)
    w, ref_w = _weights(run), _weights(ref)
    assert w.keys() == ref_w.keys()
    weights = max(float((w[k] - ref_w[k]).abs().max()) for k in w)
    figures = f"max |loss difference| {loss:.2e}, max |weight difference| {weights:.2e}"
    assert loss <= 1e-5 and weights <= 1e-5, figures
    return figures


# ---------------------------------------------------------------------- processes (slow)
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tied", "untied", "olmo2", "gemma3"])
def test_split_model_scores_as_the_whole_one(model: str) -> None:
    """Per-token log-probs, entropy, smoothing term and every gradient of the split model
    (both heads: the chunked one through VocabParallel, the dense one from vocabulary-sharded
    logits) equal the unsplit model's (tests/train/_tp_worker.py): Llama/Qwen3 blocks tied and
    untied, OLMo 2's and Gemma 3's blocks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, str(HERE / "_tp_worker.py"), str(port), model],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for head, diff in found.items():
        assert diff.pop("plain"), f"{head}: the scores must be plain tensors"
        # gradients relative to the largest one (OLMo 2's and Gemma 3's reach 13-17: their
        # differences, sums in another order, are ~1e-6 of it)
        assert diff.pop("grad") <= 2e-6 * max(1.0, diff.pop("grad_scale")), (head, diff)
        assert max(diff.values()) <= 1e-5, (head, diff)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_equal_one_process(shared_build, data_dir: Path) -> None:
    """The chunked head (the default); the dense head under TP is held to the unsplit model
    per token and per gradient (`test_split_model_scores_as_the_whole_one`), which keeps the
    suite within its time (each run here is two processes for 10 steps)."""
    one = _built(shared_build, data_dir, "one-chunked", ONE)
    tp = _built(shared_build, data_dir, "tp2-chunked", TP2)
    shards = sorted(p.name for p in (tp / "run" / "checkpoints" / "last.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], shards
    _assert_equal_runs(tp, one)


@pytest.mark.slow
def test_tensor_parallel_composed_with_fsdp2_equals_one_process(
    shared_build, data_dir: Path
) -> None:
    one = _built(shared_build, data_dir, "one-chunked", ONE)
    composed = _built(shared_build, data_dir, "tp2-dp2-chunked", TP2_DP2)
    _assert_equal_runs(composed, one)


@pytest.mark.slow
def test_tensor_parallel_run_killed_mid_step_resumes_bit_for_bit(
    tmp_path: Path, shared_build, data_dir: Path
) -> None:
    uninterrupted = _built(shared_build, data_dir, "tp2-chunked", TP2)
    kill_at = random.Random().randint(2, STEPS - 3)
    extra = [
        *TP2,
        "+callbacks.kill._target_=_callbacks.KillAtStep",
        f"+callbacks.kill.step={kill_at}",
    ]
    killed = _run(tmp_path, data_dir, extra, check=False)
    assert killed == -signal.SIGKILL, f"killed at step {kill_at}: status {killed}"
    _run(tmp_path, data_dir, [*TP2, "ckpt_path=last"])
    rows, ref = _steps(tmp_path), _steps(uninterrupted)
    assert sorted(rows) == list(range(1, STEPS + 1)), f"killed at {kill_at}: a step repeated"
    for step, row in rows.items():
        assert row["loss"] == ref[step]["loss"], f"killed at {kill_at}: step {step}"
        assert row["samples"] == ref[step]["samples"], f"killed at {kill_at}: step {step}"
    w, ref_w = _weights(tmp_path), _weights(uninterrupted)
    for key in ref_w:
        assert torch.equal(w[key], ref_w[key]), f"killed at {kill_at}: {key}"


# ---------------------------------------------------------------------- settings (fast)
def test_sizes_that_do_not_divide_the_model_are_named() -> None:
    config = preset("tiny", num_attention_heads=6, num_key_value_heads=3, intermediate_size=170)
    found = tensor_parallel_problems(config, 4)
    assert found == [
        f"{KEY}=4 does not divide model.num_attention_heads=6",
        f"{KEY}=4 does not divide model.num_key_value_heads=3",
        f"{KEY}=4 does not divide model.intermediate_size=170",
    ]
    assert tensor_parallel_problems(preset("tiny", vocab_size=513), 2) == [
        f"{KEY}=2 does not divide model.vocab_size=513"
    ]
    assert tensor_parallel_problems(preset("tiny"), 2, world_size=4) == []
    (world,) = tensor_parallel_problems(preset("tiny"), 2, world_size=3)
    assert world.startswith(f"{KEY}=2: the 3 processes")
    assert tensor_parallel_problems(preset("tiny"), 1) == []
    (bad,) = tensor_parallel_problems(preset("tiny"), 0)
    assert bad.startswith(f"{KEY}=0: must be an int >= 1")


def test_models_without_a_plan_are_refused() -> None:
    (mla,) = tensor_parallel_problems(preset("tiny-mla"), 2)
    assert "model.attention_type='mla'" in mla and KEY in mla
    moe = [p for p in tensor_parallel_problems(preset("tiny", num_experts=4), 2) if "expert" in p]
    assert moe and "model.num_experts=4" in moe[0]
    (sinks,) = tensor_parallel_problems(preset("tiny", attention_sinks=True), 2)
    assert "model.attention_sinks=true" in sinks and KEY in sinks


def test_preflight_refuses_before_anything_loads() -> None:
    cfg = compose([*TINY_MODEL, "trainer=fsdp2", "trainer.accelerator=cpu", f"{KEY}=8"])
    found = preflight.problems(cfg)
    assert f"{KEY}=8: the 2 processes (trainer.devices x trainer.num_nodes) are not" in found[0]
    assert f"{KEY}=8 does not divide model.num_attention_heads=4" in found
    assert f"{KEY}=8 does not divide model.num_key_value_heads=2" in found
    cfg = compose([*TINY_MODEL, "trainer=fsdp2", "trainer.accelerator=cpu", f"{KEY}=2"])
    assert preflight.problems(cfg) == []


def test_the_strategy_refuses_a_bad_size() -> None:
    for size in (0, 1.5, True):
        with pytest.raises(ValueError, match=KEY):
            FullyShardStrategy(tensor_parallel_size=size)  # type: ignore[arg-type]


def test_a_lora_model_is_refused_before_anything_is_split(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from astrai.model import Transformer
    from astrai.model.lora import LoRAConfig, inject_lora
    from astrai.train.tensor_parallel import apply_tensor_parallel

    model = inject_lora(Transformer(preset("tiny")), LoRAConfig(r=2, target_modules=["q_proj"]))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        with pytest.raises(
            ValueError, match=rf"{KEY}=1: layers.0.self_attn.q_proj is a LoRALinear"
        ):
            apply_tensor_parallel(model, mesh)
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # nothing split
    finally:
        dist.destroy_process_group()
