"""vLLM's `scheduling_policy`: which waiting request starts next and which running one yields.

"fcfs" (the default): waiting requests start in arrival order (a preempted one first again)
and, when the KV pool runs short, the newest running request is preempted. "priority": each
request's `SamplingParams.priority` (an int, lower = sooner, as vLLM) orders the waiting
queue by (priority, arrival), and the preempted request is the running one with the largest
(priority, arrival): the least urgent, the latest among equals. A request preempted under
"priority" waits at its own place in that order. vLLM refuses a non-zero priority under
"fcfs" (`Got priority ... but Priority scheduling is not enabled`): so does `check_priority`.

Imports no torch: `engine_options` checks the setting before a command loads its model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.inference.task import Task

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_scheduling_policy(policy: object) -> str:
    """`policy` if it is one of `SCHEDULING_POLICIES`; a ValueError naming the key otherwise."""
    if not isinstance(policy, str) or policy not in SCHEDULING_POLICIES:
        choices = " or ".join(SCHEDULING_POLICIES)
        raise ValueError(f"scheduling_policy must be {choices}, got {policy!r}")
    return policy


def check_priority(priority: int, policy: str) -> None:
    """A non-zero priority needs the "priority" policy (vLLM's rule): a ValueError naming
    `priority` (the server's 400) otherwise. Its type is `SamplingParams.validate`'s check."""
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority {priority} needs scheduling_policy=priority; this engine's is {policy} "
            "(priority scheduling is not enabled)"
        )


def rank(task: Task) -> tuple[int, int]:
    """(priority, arrival): task ids are given in submission order."""
    return task.params.priority, task.id


def first_waiting(candidates: Iterable[Task], policy: str) -> Task | None:
    """The waiting task to admit next among `candidates` (in queue order); None: none."""
    if policy == "priority":
        return min(candidates, key=rank, default=None)
    return next(iter(candidates), None)


def preemption_victim(running: list[Task], policy: str) -> Task:
    """The running task to preempt when the KV pool is short: the newest (fcfs), or the one
    with the largest (priority, arrival)."""
    return max(running, key=rank) if policy == "priority" else running[-1]
