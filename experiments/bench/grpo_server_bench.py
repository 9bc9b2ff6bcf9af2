"""GRPO wall time per optimizer step: colocated vs server mode with one replica vs
asynchronous server mode (``max_staleness: 1``), same seed, same data, same model.

The workload is the GRPO tests' (tests/train/grpo_helpers.py: built-in arithmetic prompts,
a BPE of 320 tokens) on a larger preset (astrai-5m's shape, random weights), in one
process per mode; the replica is a ``python -m astrai.serve`` subprocess started here.
Writes a JSON of per-step seconds; experiments/bench/grpo-server.md reads it.

    OMP_NUM_THREADS=1 python experiments/bench/grpo_server_bench.py \\
        --out experiments/bench/grpo-server-cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "train")]

import torch  # noqa: E402
from grpo_helpers import make_grpo, prompt_data, prompt_module  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from server_process import free_port, stop, wait_healthy  # noqa: E402
from train_helpers import quiet_trainer  # noqa: E402

from astrai.inference import InferenceEngine  # noqa: E402
from astrai.model import preset_model, save_pretrained  # noqa: E402
from astrai.train.remote_policy import RemotePolicy  # noqa: E402

PRESET = dict(name="astrai-5m", vocab_size=320)
MAX_SEQ_LEN = 128


class StepTimes(Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.started = 0.0

    def on_train_batch_start(self, *args) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def run(root: Path, tok, args, **kw) -> dict:
    engine = functools.partial(
        InferenceEngine,
        cache_mode="paged",
        max_batch_size=64,
        max_seq_len=MAX_SEQ_LEN,
        batch_invariant=args.batch_invariant,
    )
    module = make_grpo(
        root,
        tok,
        model=functools.partial(preset_model, **PRESET),
        num_generations=args.generations,
        max_new_tokens=args.max_new_tokens,
        rollout_seed=7,
        engine=engine,
        **kw,
    )
    times = StepTimes()
    trainer = quiet_trainer(
        max_steps=args.steps, callbacks=[times], limit_val_batches=0, use_distributed_sampler=False
    )
    trainer.fit(module, datamodule=prompt_module(root, batch_size=args.prompts))
    timed = times.seconds[args.warmup :]
    out = {
        "seconds": times.seconds,
        "mean": statistics.mean(timed),
        "median": statistics.median(timed),
        "weights_sum": float(sum(p.double().sum() for p in module.model.parameters())),
    }
    if isinstance(module.rollout_engine, RemotePolicy):
        out["last_push_seconds"] = module.rollout_engine.channel.push_seconds
    return out


def replica(model_dir: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "astrai.serve",
        f"model_path={model_dir}",
        f"port={port}",
        "allow_weight_updates=true",
        f"threads={args.replica_threads}",
        "device=cpu",
        "engine=paged",
        f"engine.batch_invariant={str(args.batch_invariant).lower()}",
        "engine.max_batch_size=64",
        f"engine.max_seq_len={MAX_SEQ_LEN}",
        "engine.kv_tokens=16384",
        "log_level=warning",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.replica_threads)}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout=300)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--replica-threads", type=int, default=1)
    parser.add_argument("--batch-invariant", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        root, tok = prompt_data(Path(tmp))
        save_pretrained(preset_model(**PRESET), root / "policy", tokenizer=tok)
        results["colocated"] = run(root, tok, args)
        proc, url = replica(root / "policy", args)
        try:
            server = {"mode": "server", "servers": [url]}
            results["server1"] = run(root, tok, args, rollout=server)
            results["server1_async1"] = run(
                root, tok, args, rollout=server, async_rollouts={"max_staleness": 1}
            )
        finally:
            stop(proc)
    results["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps(results, indent=1))
    for mode in ("colocated", "server1", "server1_async1"):
        r = results[mode]
        print(f"{mode:16s} mean {r['mean']:.3f} s/step  median {r['median']:.3f}")
    print(results["uptime"])


if __name__ == "__main__":
    main()
