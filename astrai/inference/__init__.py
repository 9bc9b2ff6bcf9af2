"""Inference engine: paged KV cache, continuous-batching scheduler, sampling, engine API."""

from astrai.inference.engine import EngineNotReady, GenerateResult, InferenceEngine
from astrai.inference.sampling import SamplingParams
from astrai.inference.scheduler import BatchResult, InferenceScheduler
from astrai.inference.task import Task

__all__ = [
    "BatchResult",
    "EngineNotReady",
    "GenerateResult",
    "InferenceEngine",
    "InferenceScheduler",
    "SamplingParams",
    "Task",
]
