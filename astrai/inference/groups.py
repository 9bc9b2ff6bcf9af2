"""Group prefill: the followers of a group wait, off the queue, for their leader's prompt KV.

A group is the `n` samples of one prompt (`SamplingParams.n`): a leader and followers with
the same prompt and settings, different seeds. A prompt's complete pages enter the prefix
cache when its prefill completes (`InferenceScheduler.postprocess`), so when the pool
shares prefixes, followers queued after the leader's prefill find its pages and prefill
only their tail (SGLang's and vLLM V1's `n`). Queued at once, all `n` would prefill the
whole prompt side by side. `HeldFollowers` is that waiting room; the scheduler decides
when to hold (`PagePool.shareable_tokens`) and releases a group to the front of its queue
when the leader's prefill completes, or when the leader ends or is preempted before that
(nothing is lost). The scheduler's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from astrai.inference.task import Task


class HeldFollowers:
    """Followers held per leader, in their order."""

    def __init__(self) -> None:
        self._by_leader: dict[int, list[Task]] = {}  # leader task id -> followers

    def __len__(self) -> int:
        return sum(len(f) for f in self._by_leader.values())

    def __iter__(self) -> Iterator[Task]:
        for followers in self._by_leader.values():
            yield from followers

    def holds_for(self, leader: Task) -> bool:
        return leader.id in self._by_leader

    def hold(self, leader: Task, followers: Sequence[Task]) -> None:
        if followers:
            self._by_leader.setdefault(leader.id, []).extend(followers)

    def release(self, leader: Task) -> list[Task]:
        """The followers of `leader` (no longer held), in order; [] when none are held."""
        return self._by_leader.pop(leader.id, [])

    def take_cancelled(self) -> list[Task]:
        """Stop holding the followers whose cancellation was requested; return them."""
        taken: list[Task] = []
        for leader_id, followers in list(self._by_leader.items()):
            kept = [t for t in followers if not t.cancel_requested]
            if len(kept) < len(followers):
                taken += [t for t in followers if t.cancel_requested]
                if kept:
                    self._by_leader[leader_id] = kept
                else:
                    del self._by_leader[leader_id]
        return taken

    def drain(self) -> list[Task]:
        """Every held follower; none is held afterwards."""
        tasks = list(self)
        self._by_leader.clear()
        return tasks
