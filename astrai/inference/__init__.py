"""Inference: KV cache, a scheduler that plans, a model runner that runs, and the engine API.

`InferenceEngine` is the front door. Each step, `InferenceScheduler.schedule()` decides
which requests run with how many tokens (a `StepPlan`), `ModelRunner.run(plan)` runs the
forward and samples (a `StepOutput`: the tokens each row emitted, one, or 1..k+1 with
speculation), and `InferenceScheduler.postprocess(plan, out)` appends them and applies
the stop rules. A request's settings travel as one `SamplingParams`
(`astrai.inference.params`: the settings, their checks and the request limits). Prompt
log-probs and `InferenceEngine.score` (log-likelihoods): `astrai.inference.logprobs`.
`SamplingParams.n` samples of one prompt prefill it once (`astrai.inference.groups`).

Everything is imported on first use (`astrai.lazy`): `astrai.inference.params` imports no
torch, so a command can build and check its settings first.
"""

from typing import TYPE_CHECKING

from astrai.lazy import lazy_exports

if TYPE_CHECKING:
    from astrai.inference.engine import (
        BatchResult,
        EngineNotReady,
        InferenceEngine,
        RequestRejected,
    )
    from astrai.inference.logprobs import ScoreResult, TokenLogprob
    from astrai.inference.params import SamplingParams
    from astrai.inference.result import GenerateResult
    from astrai.inference.runner import ModelRunner
    from astrai.inference.scheduler import InferenceScheduler, StepPlan
    from astrai.inference.task import Task

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.inference.engine": (
            "BatchResult",
            "EngineNotReady",
            "InferenceEngine",
            "RequestRejected",
        ),
        "astrai.inference.logprobs": ("ScoreResult", "TokenLogprob"),
        "astrai.inference.result": ("GenerateResult",),
        "astrai.inference.runner": ("ModelRunner",),
        "astrai.inference.params": ("SamplingParams",),
        "astrai.inference.scheduler": ("InferenceScheduler", "StepPlan"),
        "astrai.inference.task": ("Task",),
    },
)

__all__ = [
    "BatchResult",
    "EngineNotReady",
    "GenerateResult",
    "InferenceEngine",
    "InferenceScheduler",
    "ModelRunner",
    "RequestRejected",
    "SamplingParams",
    "ScoreResult",
    "StepPlan",
    "Task",
    "TokenLogprob",
]
