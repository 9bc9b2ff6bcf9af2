"""Test-only callbacks for the post-training-under-FSDP2 tests (tests/train/test_fsdp_rl.py),
loaded by `python -m astrai.train` through `+callbacks.<name>._target_=_rl_callbacks.<Class>`
with this folder on PYTHONPATH."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepRecord(Callback):
    """Per optimizer step, appended to JSON-lines files in folder `path` (a resumed run
    appends to the same files): `steps.jsonl` from rank 0, the training loss averaged over
    the ranks (and for GRPO the global batch's prompts, sorted); for GRPO
    `rollouts.rank<r>.jsonl` from every rank, each new generation batch's completions (token
    ids) and their sampling log-probs."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.last: Any = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        mean = trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        step, rank = trainer.global_step, trainer.global_rank
        batch = args[0]
        prompts = None
        if "prompt_ids" in batch:
            mine = [list(map(int, p)) for p in batch["prompt_ids"]]
            parts = [mine]
            if trainer.world_size > 1:
                import torch.distributed as dist

                parts = [None] * trainer.world_size
                dist.all_gather_object(parts, mine)
            prompts = sorted(p for part in parts for p in part)
        if trainer.is_global_zero:
            row = {"step": step, "loss": float(mean), "world": trainer.world_size}
            if prompts is not None:
                row["prompts"] = prompts
            with open(self.path / "steps.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
        generation = getattr(pl_module, "generation", None)
        if generation is not None and generation.completions != self.last:
            self.last = generation.completions
            row = {
                "step": step,
                "world": trainer.world_size,
                "completions": generation.completions,
                "logprobs": generation.logprobs,
            }
            with open(self.path / f"rollouts.rank{rank}.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")


class ServeProbe(Callback):
    """On rank 0, before each optimizer step of `steps`, sends one greedy completion request
    to the run's live policy server (`serve_policy.port=0`) and waits until the gate holds
    it; after the step (the server answered it at the batch end) appends the answer to
    `<path>/served.jsonl`: its text, token log-probs and system fingerprint."""

    def __init__(self, path: str, steps: list[int]) -> None:
        self.path = Path(path)
        self.steps = set(steps)
        self.pending: Any = None

    @staticmethod
    def _server(trainer: Any) -> Any:
        from astrai.train.serve_policy import PolicyServer

        return next(c for c in trainer.callbacks if isinstance(c, PolicyServer))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        if not trainer.is_global_zero or trainer.global_step + 1 not in self.steps:
            return
        import threading
        from concurrent.futures import Future

        import httpx

        server = self._server(trainer)
        body = {
            "model": server.model_name,
            "prompt": "12+7=",
            "max_tokens": 6,
            "temperature": 0.0,
            "logprobs": 1,
        }
        future: Future = Future()

        def ask() -> None:
            try:
                future.set_result(
                    httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
                )
            except BaseException as err:
                future.set_exception(err)

        threading.Thread(target=ask, daemon=True).start()
        assert server.gate.wait_for_waiting(1, timeout=60), "the request never reached the gate"
        self.pending = future

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        if self.pending is None:
            return
        reply = self.pending.result(timeout=120).json()
        self.pending = None
        choice = reply["choices"][0]
        row = {
            "step": trainer.global_step,
            "text": choice["text"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "fingerprint": reply["system_fingerprint"],
        }
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / "served.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
