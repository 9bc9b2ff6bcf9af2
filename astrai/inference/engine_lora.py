"""The engine's LoRA-adapter surface: load, unload, list, and the per-request checks.

A mixin of `InferenceEngine` (its `adapters`, an `EngineAdapters` or None, and its
`scheduler`), kept apart so the engine's file stays about the engine's loop; the adapters
themselves are `astrai.inference.adapters`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from astrai.inference.adapters import AdapterError, AdapterInfo, AdapterNotFound, EngineAdapters
from astrai.inference.task import Rejection, Task

if TYPE_CHECKING:
    from astrai.inference.scheduler import InferenceScheduler

NO_ADAPTERS = "this engine serves no LoRA adapters (start it with lora=..., engine.lora)"


class AdapterMethods:
    """`InferenceEngine`'s adapter methods."""

    adapters: EngineAdapters | None
    scheduler: InferenceScheduler

    @property
    def lora_enabled(self) -> bool:
        return self.adapters is not None

    def load_adapter(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        """Register the PEFT-layout adapter at `path` (ours or PEFT's) as `name`, while
        serving; an `AdapterError` names the file and the limit it breaks."""
        return self._adapters().load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`; `AdapterInUse` while queued or running requests use it."""
        self._adapters().unload(name, self.scheduler.uses_adapter)

    def list_adapters(self) -> list[AdapterInfo]:
        return [] if self.adapters is None else self.adapters.list()

    def _adapters(self) -> EngineAdapters:
        if self.adapters is None:
            raise AdapterError(NO_ADAPTERS)
        return self.adapters

    def reweigh(self, fn: Any) -> None:
        """Run a weight update's `fn`, then copy a training run's live adapter's new tensors
        into its slot (the versioned update is how the engine reads them)."""
        if fn is not None:
            fn()
        if self.adapters is not None:
            self.adapters.refresh_live()

    # ------------------------------------------------------------------ per request
    def check_adapter(self, name: str | None) -> None:
        """`AdapterNotFound` unless `name` (a request's `SamplingParams.adapter`) is served."""
        if name is None:
            return
        if self.adapters is None:
            raise AdapterNotFound(f"adapter {name!r}: {NO_ADAPTERS}")
        self.adapters.resolve(name)

    def adapter_lock(self) -> Any:
        """Held while a request's adapter is resolved and it is queued: no unload between."""
        return self.adapters.lock if self.adapters is not None else contextlib.nullcontext()

    def assign_adapter(self, tasks: Sequence[Task]) -> Rejection | None:
        """Give the tasks of one prompt their adapter (None: the base, or a training run's
        live adapter); a `Rejection` if it was unloaded since the request was checked."""
        if self.adapters is None:
            return None
        try:
            adapter = self.adapters.resolve(tasks[0].params.adapter)
        except AdapterNotFound as err:
            return Rejection(str(err), param="adapter")
        for task in tasks:
            task.adapter = adapter
        return None
