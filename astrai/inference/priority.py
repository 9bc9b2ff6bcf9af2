"""vLLM's `scheduling_policy`: which waiting request starts next and which running one yields.

"fcfs" (the default): waiting requests start in arrival order (a preempted one first again)
and, when the KV pool runs short, the newest running request is preempted. "priority": each
request's `SamplingParams.priority` (an int, lower = sooner, as vLLM) orders the waiting
queue by (priority, arrival), and the preempted request is the running one with the largest
(priority, arrival): the least urgent, the latest among equals. A request preempted under
"priority" waits at its own place in that order. vLLM refuses a non-zero priority under
"fcfs" (`Got priority ... but Priority scheduling is not enabled`): so does `FcfsPolicy`.
Each policy is a type (`scheduling_policy(name)`); the scheduler asks it, never its name.

Imports no torch: `engine_options` checks the setting before a command loads its model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from astrai.inference.task import Task


def rank(task: Task) -> tuple[int, int]:
    """(priority, arrival): task ids are given in submission order."""
    return task.params.priority, task.id


class SchedulingPolicy(Protocol):
    def check(self, priority: int) -> None:
        """A ValueError naming `priority` when this policy cannot honour it."""

    def first_waiting(self, candidates: Iterable[Task]) -> Task | None:
        """The waiting task to admit next among `candidates` (in queue order); None: none."""

    def victim(self, running: list[Task]) -> Task:
        """The running task to preempt when the KV pool is short."""


class FcfsPolicy:
    """Arrival order; the newest running request yields; no priorities (vLLM's rule)."""

    def check(self, priority: int) -> None:
        if priority != 0:
            raise ValueError(
                f"priority {priority} needs scheduling_policy=priority; this engine's is fcfs "
                "(priority scheduling is not enabled)"
            )

    def first_waiting(self, candidates: Iterable[Task]) -> Task | None:
        return next(iter(candidates), None)

    def victim(self, running: list[Task]) -> Task:
        return running[-1]


class PriorityPolicy:
    """(priority, arrival) order; the least urgent, latest running request yields."""

    def check(self, priority: int) -> None:
        """Any int goes (its type is `SamplingParams.validate`'s check)."""

    def first_waiting(self, candidates: Iterable[Task]) -> Task | None:
        return min(candidates, key=rank, default=None)

    def victim(self, running: list[Task]) -> Task:
        return max(running, key=rank)


POLICIES: dict[str, type[FcfsPolicy] | type[PriorityPolicy]] = {
    "fcfs": FcfsPolicy,
    "priority": PriorityPolicy,
}
SCHEDULING_POLICIES = tuple(POLICIES)


def check_scheduling_policy(policy: object) -> str:
    """`policy` if it is one of `SCHEDULING_POLICIES`; a ValueError naming the key otherwise."""
    if not isinstance(policy, str) or policy not in SCHEDULING_POLICIES:
        choices = " or ".join(SCHEDULING_POLICIES)
        raise ValueError(f"scheduling_policy must be {choices}, got {policy!r}")
    return policy


def scheduling_policy(name: object) -> SchedulingPolicy:
    """The policy called `name` (checked)."""
    return POLICIES[check_scheduling_policy(name)]()
