"""One generation request as the scheduler sees it."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from astrai.inference.sampling import SamplingParams

_ids = itertools.count(1)


class TaskState(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Finish reasons: "stop" (a stop token), "length" (max_tokens or context full),
# "cancelled", "rejected" (never admitted, see `error`), "aborted" (failed while running).
FINISH_REASONS = ("stop", "length", "cancelled", "rejected", "aborted")


@dataclass(eq=False)
class Task:
    """Prompt, limits and progress of one request.

    `computed` counts the tokens whose KV is in the cache: prompt tokens during (chunked)
    prefill, then prompt + all but the newest output token while decoding.
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    on_token: Callable[[Task, int, float], None] | None = None
    on_finish: Callable[[Task], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # Attention backend chosen by the submitting thread (`attn_backend(...)`), None = auto.
    backend: str | None = None

    state: TaskState = TaskState.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    row: int | None = None
    cached_len: int = 0
    computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    cancel_requested: bool = False
    policy_version: int = 0
    created_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is TaskState.FINISHED

    def materialized_ids(self) -> list[int]:
        """Tokens whose KV has been written (the newest sampled token has not been fed yet)."""
        return (self.prompt_ids + self.output_ids)[: self.computed]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.created_at
