"""The tasks of `n` samples per prompt, and what `run_batch` returns for a finished task.

One place decides the seeds of a group, so `submit_group`, `run_batch` and the server's
`n` cannot disagree: sample `j` of a group whose settings carry seed `s` draws with
`s + j`; `run_batch` gives prompt `i` the group seed `seed + i * n`, so its result
`i * n + j` draws with `seed + i * n + j` (what the expanded list `[p0] * n + [p1] * n + ...`
got before `n` existed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from astrai.inference.params import SamplingParams
from astrai.inference.structured import StructuredOutput, per_prompt
from astrai.inference.task import Rejection, Task


@dataclass
class BatchResult:
    """One `run_batch` output: token ids, aligned log-probs, why it ended, and how many of
    its prompt tokens the prefix cache served."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    error: str | None = None
    cached_prompt_tokens: int = 0


def group_tasks(
    prompt_ids: Sequence[int], params: SamplingParams, backend: str | None = None
) -> list[Task]:
    """The `params.n` tasks of one prompt, leader first: each one sequence (`n=1`), sample
    `j` seeded with `params.seed + j` (unseeded: all unseeded)."""
    one = dataclasses.replace(params, n=1) if params.n != 1 else params
    seed = params.seed
    return [
        Task(
            prompt_ids=list(prompt_ids),
            params=one if seed is None or j == 0 else dataclasses.replace(one, seed=seed + j),
            backend=backend,
        )
        for j in range(params.n)
    ]


def prompt_groups(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    structured: StructuredOutput | Sequence[StructuredOutput | None] | None,
    check: Callable[[list[int], SamplingParams], Rejection | None],
    backend: str | None,
    on_group: Callable[[int, list[BatchResult]], None] | None = None,
) -> list[tuple[list[Task], Rejection | None]]:
    """`run_batch`'s groups, one per prompt, each checked (`check`: its `Rejection`, or
    None) before anything runs: prompt `i` seeded `seed + i * n`, with its own output
    constraint when `structured` gives one per prompt."""
    n, seed = params.n, params.seed
    constraints = None if structured is None else per_prompt(structured, len(prompts))
    groups = []
    for i, prompt_ids in enumerate(prompts):
        p = params if seed is None else dataclasses.replace(params, seed=seed + i * n)
        if constraints is not None:
            p = dataclasses.replace(p, structured=constraints[i])
        ids = list(prompt_ids)
        groups.append((group_tasks(ids, p, backend), check(ids, p)))
    watch_groups(groups, on_group)
    return groups


def batch_output(task: Task, *, return_logprobs: bool, return_details: bool) -> Any:
    """A finished task as `run_batch` returns it: token ids, `(ids, logprobs)` or a
    `BatchResult`."""
    ids = list(task.output_ids)
    if return_details:
        return BatchResult(
            ids, list(task.logprobs), task.finish_reason, task.error, task.cached_tokens
        )
    if return_logprobs:
        return ids, list(task.logprobs)
    return ids


def watch_groups(
    groups: Sequence[tuple[list[Task], Rejection | None]],
    on_group: Callable[[int, list[BatchResult]], None] | None,
) -> None:
    """`run_batch`'s per-group hook: `on_group(i, results)` (`BatchResult`s) as soon as
    every task of group `i` is finished (on the engine's thread, between steps: keep it short, e.g. hand the
    outputs to a pool), so a caller scores a group while the engine generates the others.
    A rejected group is never reported; None: no hook."""
    if on_group is None:
        return
    for i, (tasks, rejection) in enumerate(groups):
        if rejection is not None:
            continue
        left = [len(tasks)]

        def done(_: Task, i: int = i, tasks: list[Task] = tasks, left: list[int] = left) -> None:
            left[0] -= 1
            if left[0] == 0:
                outputs = [
                    batch_output(t, return_logprobs=True, return_details=True) for t in tasks
                ]
                on_group(i, outputs)

        for t in tasks:
            t.on_finish = done


def single(params: SamplingParams, api: str) -> SamplingParams:
    """`params` of an API that runs one sequence; `n > 1` is a ValueError naming `n`."""
    if params.n != 1:
        raise ValueError(
            f"n must be 1 for {api} (got {params.n!r}): it runs one sequence; "
            "use submit_group (or run_batch, generate) for n > 1"
        )
    return params
