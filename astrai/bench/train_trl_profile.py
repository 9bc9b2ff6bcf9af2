"""Where astrai's GRPO step spends its time, phase by phase, measured inside the real
Lightning loop of ``bench train_trl`` (so the profile is of the very steps that are timed).

A callback stamps the step's hooks and two forward pre-hooks; a source wrapper stamps the
rollout. A step, from the end of the previous one to its own end, splits into:

- ``generation``: the rollout source's ``take`` (the engine's prefill and decode, with the
  rewards scored as groups finish);
- ``host_before``: the rest up to the policy's next forward (advantages, the slice's
  padding and tensors, Lightning's batch hooks);
- ``old_logp``: a forward of the policy without gradient before the training forward (the
  old policy's log-probs computed apart from the rollout's: 0 when the engine's sampling
  log-probs serve, as with ``num_iterations=1``);
- ``forward``: the policy's forward with the LM head (log-probs and entropy), up to the
  reference's forward;
- ``reference``: the reference's forward (its log-probs) and the loss, up to the backward;
- ``backward``; ``host_after_backward``: gradient statistics and clipping, up to the
  optimizer's step; ``optimizer``: its step and ``zero_grad``;
- ``loop``: what is left (Lightning's loop, logging, the engine's weight version bump).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from astrai.train.strategies.grpo.source import RolloutSource, WrappingSource

PHASES = (
    "generation",
    "host_before",
    "old_logp",
    "forward",
    "reference",
    "backward",
    "host_after_backward",
    "optimizer",
    "loop",
)


class TimedSource(WrappingSource):
    """``inner``'s samples; when each ``take`` started and ended goes to ``marks``."""

    def __init__(self, inner: RolloutSource, marks: dict[str, float]) -> None:
        super().__init__(inner)
        self.marks = marks

    def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Any:
        self.marks["gen_start"] = time.perf_counter()
        samples = self.inner.take(batch, seed, step)
        self.marks["gen_end"] = time.perf_counter()
        self.waited = self.inner.waited
        return samples


class GRPOStepProfile(L.Callback):
    """Per-step phase seconds (:data:`PHASES`) of a ``GRPOModule`` run, in :attr:`steps`."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.marks: dict[str, float] = {}
        self._last_end: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        pl_module.wrap_source(lambda inner: TimedSource(inner, self.marks))
        pl_module.model.register_forward_pre_hook(self._mark("forward"))
        if pl_module.reference is not None:
            pl_module.reference.model.register_forward_pre_hook(self._mark("reference"))

    def _mark(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            # the first training forward after the rollout (the engine runs the same model);
            # the policy's without gradient there is an old-log-probs pass
            key = "old_logp" if name == "forward" and not torch.is_grad_enabled() else name
            if "gen_end" in self.marks and key not in self.marks:
                self.marks[key] = time.perf_counter()

        return hook

    def _stamp(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.marks.clear()
        if self._last_end is None:
            self._last_end = time.perf_counter()

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: Any) -> None:
        self._stamp("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._stamp("backward_end")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._stamp("optimizer")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        end, m = time.perf_counter(), self.marks
        start = self._last_end if self._last_end is not None else m["gen_start"]
        reference_end = m.get("reference", m["backward"])
        old_logp = m.get("old_logp", m["forward"])
        phases = {
            "generation": m["gen_end"] - m["gen_start"],
            "host_before": old_logp - m["gen_end"],
            "old_logp": m["forward"] - old_logp,
            "forward": reference_end - m["forward"],
            "reference": m["backward"] - reference_end,
            "backward": m["backward_end"] - m["backward"],
            "host_after_backward": m["optimizer"] - m["backward_end"],
            "optimizer": end - m["optimizer"],
        }
        phases["loop"] = (end - start) - sum(phases.values())
        phases["step"] = end - start
        self.steps.append(phases)
        self._last_end = end


def summarise(steps: list[dict[str, float]]) -> dict[str, float]:
    """The median seconds of each phase over ``steps`` (and of the whole step)."""
    return {k: statistics.median(s[k] for s in steps) for k in (*PHASES, "step")}


def format_profile(profile: Mapping[str, float]) -> list[str]:
    """One line per phase: median ms and share of the median step."""
    step = profile["step"]
    return [
        f"  {k:<20} {profile[k] * 1e3:9.1f} ms {profile[k] / step:6.1%}" for k in (*PHASES, "step")
    ]
