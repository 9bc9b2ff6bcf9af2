"""Code generation scored by execution: pass@k over HumanEval-shaped tasks.

A task file holds ``{"task_id", "prompt", "test", "entry_point"}`` per line (HumanEval's
shape: ``prompt`` is a signature and docstring, ``test`` defines ``check(candidate)``). The
model completes each prompt ``num_samples`` times; a completion is cut at the first stop
sequence, and the program ``prompt + completion + test + check(entry_point)`` runs in the
sandbox (:mod:`astrai.eval.sandbox`). ``pass@k`` is the unbiased estimator of Chen et al.
(2021), ``1 - C(n - c, k) / C(n, k)`` for ``c`` passing samples out of ``n``, averaged over
tasks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from astrai.eval.sandbox import run_programs
from astrai.eval.suite import Suite, SuiteResult, progress_bar
from astrai.eval.tasks import DataError, read_records, resolve_path, text_field
from astrai.inference.params import MAX_N

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

__all__ = ["HUMANEVAL_STOP", "CodeSuite", "pass_at_k", "program_of", "truncate"]

#: HumanEval's stop sequences: the completion of one function ends where top-level code starts.
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
SAMPLE_FILE = "code_sample.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of `k` samples drawn without replacement from `n`, of
    which `c` pass, passes: ``1 - C(n-c, k) / C(n, k)``, as a numerically stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def truncate(completion: str, stop: Sequence[str]) -> str:
    """`completion` up to the first occurrence of any stop sequence."""
    cut = min((i for s in stop if s and (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


def program_of(task: dict[str, Any], completion: str) -> str:
    """The program that checks one completion (HumanEval's ``check_program``)."""
    return f"{task['prompt']}{completion}\n\n{task['test']}\n\ncheck({task['entry_point']})\n"


def _check_task(record: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("prompt", "test", "entry_point"):
        text_field(record, key, where)
    if not record["entry_point"].isidentifier():
        raise DataError(f"{where}: field 'entry_point' must be a Python identifier")
    return {**record, "task_id": str(record.get("task_id", where))}


class CodeSuite(Suite):
    """pass@k of sampled completions, each checked by running its tests in the sandbox.

    Args:
        name: metric namespace.
        path: JSONL of HumanEval-shaped tasks (None: the small sample shipped with astrai).
        limit: read at most this many tasks.
        num_samples: completions per task (``n``); every ``k`` must be <= ``n``.
        k: the ``pass@k`` values reported.
        max_tokens, temperature, top_p, top_k, seed: sampling (the seed of each sample:
            `complete`).
        stop: stop sequences the completion is cut at.
        timeout, memory_mb: per-program wall-clock seconds and address space (sandbox).
        workers: programs run at once.
        chunk_size: prompts per ``run_batch`` call (each with its ``num_samples`` samples).
    """

    def __init__(
        self,
        name: str = "code",
        *,
        path: str | None = None,
        limit: int | None = None,
        num_samples: int = 1,
        k: int | Sequence[int] = (1,),
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Sequence[str] = HUMANEVAL_STOP,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        workers: int = 4,
        chunk_size: int = 256,
    ) -> None:
        self.name = name
        self.num_samples = int(num_samples)
        if self.num_samples < 1:
            raise ValueError(f"{name}: num_samples must be >= 1, got {num_samples}")
        self.k = [int(k)] if isinstance(k, int) else [int(x) for x in k]
        bad = [x for x in self.k if not 1 <= x <= self.num_samples]
        if not self.k or bad:
            raise ValueError(
                f"{name}: every k must be in 1..num_samples={self.num_samples}, got k={self.k}"
            )
        if int(max_tokens) < 1 or timeout <= 0 or memory_mb <= 0:
            raise ValueError(f"{name}: max_tokens, timeout and memory_mb must be > 0")
        rows = read_records(resolve_path(path, SAMPLE_FILE), limit)
        self.wheres = [where for where, _ in rows]
        self.tasks = [_check_task(rec, where) for where, rec in rows]
        self.sampling = self.sampling_params(max_tokens, temperature, top_p, top_k)
        self.seed = int(seed)
        self.stop = tuple(stop)
        self.limits = {"timeout": float(timeout), "memory_mb": int(memory_mb)}
        self.workers = int(workers)
        self.chunk_size = max(1, int(chunk_size))

    def required_seq_len(self, tokenizer: AutoTokenizer) -> int:
        longest = max(len(tokenizer.encode(t["prompt"])) for t in self.tasks)
        return longest + self.sampling.max_tokens

    def complete(self, engine: InferenceEngine, progress: bool = False) -> list[list[str]]:
        """`num_samples` truncated completions per task.

        A task's samples are one group (`run_batch` with ``n=num_samples``): its prompt is
        prefilled once and shared through the prefix cache of a paged engine. Above the
        engine's `MAX_N` they come in blocks of at most `MAX_N` samples (the later blocks
        find the prompt in the prefix cache too). Sample ``j0 + j`` of task ``i``, in the
        block of ``m`` samples from ``j0``, draws with seed
        ``seed + j0 * tasks + i * m + j``; with ``num_samples <= MAX_N`` that is
        ``seed + i * num_samples + j``. (Before groups, sample ``j`` of every task came
        from one call with seeds ``seed + j * tasks + i``: seeded completions changed.)
        """
        tok = engine.tokenizer
        prompts = [tok.encode(t["prompt"]) for t in self.tasks]
        out: list[list[str]] = [[] for _ in self.tasks]
        total = len(prompts) * self.num_samples
        with progress_bar(total, f"eval {self.name}", progress, "sample") as bar:
            for j0 in range(0, self.num_samples, MAX_N):
                m = min(MAX_N, self.num_samples - j0)
                params = self.request(dataclasses.replace(self.sampling, n=m))
                for start in range(0, len(prompts), self.chunk_size):
                    chunk = prompts[start : start + self.chunk_size]
                    results = engine.run_batch(
                        chunk,
                        params,
                        seed=self.seed + j0 * len(prompts) + start * m,
                        return_details=True,
                    )
                    for k, res in enumerate(results):  # prompt-major: k = i * m + j
                        text = tok.decode(res.token_ids, skip_special_tokens=True)
                        out[start + k // m].append(truncate(text, self.stop))
                    bar.update(len(results))
        return out

    def run(self, engine: InferenceEngine, *, progress: bool = False) -> SuiteResult:
        started = time.perf_counter()
        completions = self.complete(engine, progress)
        programs = [program_of(t, c) for t, cs in zip(self.tasks, completions) for c in cs]
        executed = run_programs(programs, workers=self.workers, progress=progress, **self.limits)
        rows, per_k = [], {k: [] for k in self.k}
        n = self.num_samples
        for i, (task, cs) in enumerate(zip(self.tasks, completions)):
            results = executed[i * n : (i + 1) * n]
            passed = sum(r.passed for r in results)
            row: dict[str, Any] = {
                "task_id": task["task_id"],
                "where": self.wheres[i],
                "completions": cs,
                "status": [r.status for r in results],
                "passed": passed,
            }
            failure = next((r for r in results if not r.passed), None)
            if failure is not None:
                row["first_failure"] = failure.stderr[-1000:]
            for k in self.k:
                row[f"pass@{k}"] = value = pass_at_k(n, passed, k)
                per_k[k].append(value)
            rows.append(row)
        metrics = {f"pass@{k}": sum(v) / len(v) for k, v in per_k.items()}
        return SuiteResult(self.name, metrics, rows, time.perf_counter() - started)
