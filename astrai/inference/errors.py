"""The engine's request-level exceptions (importable without building an engine)."""

from __future__ import annotations

from astrai.inference.task import Rejection


class EngineNotReady(RuntimeError):
    """The engine was shut down, or its loop crashed."""


class RequestRejected(ValueError):
    """Valid settings, but a prompt that can never run (empty, too long, ids outside the
    vocabulary, `max_tokens` <= 0, prompt + `max_tokens` beyond the context with
    `max_tokens_policy="error"`, the engine crashed): `submit` ends such a request at once
    with finish reason `rejected` instead of raising. `param`: the setting at fault
    (``"prompt"``, ``"max_tokens"``, ``"prompt_logprobs_start"``: see
    `InferenceScheduler.problem`), None when the engine has failed; `rejection` the whole
    `Rejection` (with `exceeds_context`)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.reason)
        self.rejection = rejection

    @property
    def param(self) -> str | None:
        return self.rejection.param
