"""One generation request as the scheduler sees it (with its speculation state)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from astrai.inference.logprobs import TokenLogprob, TopLogprobs
from astrai.inference.params import SamplingParams

_ids = itertools.count(1)

# Backing off: after `n` verifications in a row that accepted nothing, a request skips
# speculation for 2**n - 1 steps (at most MAX_SKIP), so a workload where proposals fail
# decodes as without speculation, bar the proposals' lookups.
MAX_SKIP = 31


class TaskState(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Rejection:
    """Why a request can never run: `reason` for people, `param` the setting at fault
    (``"prompt"``, ``"max_tokens"``, ``"prompt_logprobs_start"``) for callers that answer in
    their own field names (`InferenceScheduler.problem`; None: the engine has failed), and
    `exceeds_context` when the request does not fit the context (OpenAI's
    `context_length_exceeded`)."""

    reason: str
    param: str | None = None
    exceeds_context: bool = False

    def __str__(self) -> str:
        return self.reason


@dataclass(slots=True)
class SpecState:
    """One request's speculation (`Task.spec`): this step's proposal `budget` (KV reserved
    for it), the tokens `proposed` and `accepted` so far, and its back-off (`misses` in a
    row that accepted nothing, `skip`: steps left without proposals)."""

    budget: int = 0
    proposed: int = 0
    accepted: int = 0
    misses: int = 0
    skip: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        """`accepted` of `proposed` proposals were kept: back off after a miss."""
        self.proposed += proposed
        self.accepted += accepted
        if not accepted:
            self.misses += 1
            self.skip = min((1 << self.misses) - 1, MAX_SKIP)
        else:
            self.misses = 0


@dataclass(eq=False)
class Task:
    """Prompt, settings and progress of one request.

    `computed` counts the tokens whose KV is in the cache: prompt tokens during (chunked)
    prefill, then prompt + all but the newest output token while decoding. A preempted task
    (its KV freed for others) is prefilled again over `prefill_ids`: the prompt plus the
    `recompute` output tokens it had, and samples its next token at the end of it.
    Finish reasons: "stop" (a stop token), "length" (max_tokens or context full),
    "cancelled", "rejected" (never admitted, see `error`), "aborted" (failed while running).
    `prompt_logprobs` (when `params.prompt_logprobs` is set) has one entry per prompt
    position, None before `params.prompt_logprobs_start`; `top_logprobs` is aligned with
    `output_ids` when `params.logprobs > 0` (the chosen tokens' own log-probs: `logprobs`).
    `rejection` is why a rejected task never ran (`Rejection`: the setting at fault, whether
    it did not fit the context), so a caller can name its own field.
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_token: Callable[[Task, int, float], None] | None = None
    on_finish: Callable[[Task], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # Attention backend chosen by the submitting thread (`attn_backend(...)`), None = auto.
    backend: str | None = None

    state: TaskState = TaskState.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    row: int | None = None
    computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    rejection: Rejection | None = None
    cancel_requested: bool = False
    queued_at: float | None = None  # perf_counter times, for TTFT and inter-token latency
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    recompute: int = 0
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first admission
    # The LoRA adapter it runs with (`astrai.inference.adapters.Adapter`, set when queued;
    # None: the base model) and, while running, its device slot (-1: none).
    adapter: Any = None
    adapter_slot: int = -1
    # Speculative decoding (`astrai.inference.speculative`): budget, figures, back-off.
    spec: SpecState = field(default_factory=SpecState)

    @property
    def prefix_namespace(self) -> int | None:
        """The prefix cache's key space: KV computed under one adapter is never another's."""
        return None if self.adapter is None else self.adapter.info.uid

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def error_param(self) -> str | None:
        """The setting a rejection is about (`Rejection.param`), None otherwise."""
        return self.rejection.param if self.rejection is not None else None

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens to prefill: the prompt, plus the outputs of a preempted task."""
        if not self.recompute:
            return self.prompt_ids
        return self.prompt_ids + self.output_ids[: self.recompute]

    @property
    def prefill_len(self) -> int:
        return len(self.prompt_ids) + self.recompute

    @property
    def prefilled(self) -> bool:
        return self.computed >= self.prefill_len

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is TaskState.FINISHED

    def materialized_ids(self) -> list[int]:
        """Tokens whose KV has been written (the newest sampled token has not been fed yet)."""
        return (self.prompt_ids + self.output_ids)[: self.computed]
