"""Evaluation on the inference engine: suites that run on local files, no download needed.

* :class:`PerplexitySuite`: token nll, perplexity, bits per byte and per-document
  percentiles over text / JSONL files or a prepared H5 storage (rolling windows).
* :class:`MultipleChoiceSuite`: ``acc`` and ``acc_norm`` by log-likelihood of each choice.
* :class:`GenerationSuite`: completions scored by reward functions (exact match, format),
  including the built-in ``arithmetic`` and ``stdlib`` prompts.
* :class:`CodeSuite`: pass@k of sampled programs, run in a sandbox.

``python -m astrai.eval`` runs them from ``conf/eval.yaml``; the training callback
(:mod:`astrai.train.evaluation`) runs them on the live weights. The lm-evaluation-harness
model lives in :mod:`astrai.eval.harness` and is imported only from there.

The suites are imported on first use (`astrai.lazy`), so that ``python -m astrai.eval``
checks its options and the model directory before torch is imported.
"""

from typing import TYPE_CHECKING

from astrai.eval.suite import Suite, SuiteResult
from astrai.lazy import lazy_exports

if TYPE_CHECKING:
    from astrai.eval.choice import MultipleChoiceSuite
    from astrai.eval.code import CodeSuite, pass_at_k
    from astrai.eval.generation import GenerationSuite, builtin_prompts
    from astrai.eval.perplexity import PerplexitySuite

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.eval.choice": ("MultipleChoiceSuite",),
        "astrai.eval.code": ("CodeSuite", "pass_at_k"),
        "astrai.eval.generation": ("GenerationSuite", "builtin_prompts"),
        "astrai.eval.perplexity": ("PerplexitySuite",),
    },
)

__all__ = [
    "CodeSuite",
    "GenerationSuite",
    "MultipleChoiceSuite",
    "PerplexitySuite",
    "Suite",
    "SuiteResult",
    "builtin_prompts",
    "pass_at_k",
]
