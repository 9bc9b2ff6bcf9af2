"""A request's settings as one typed object, `SamplingParams`, and every check of it.

This is the contract every caller hands the engine (the HTTP builders, batch generation, the
eval suites, the lm-eval model, GRPO rollouts), so it imports no torch: a command can build
and check its settings before the model code loads. The limits the server and the engine
both apply live here too, so the two cannot disagree. The tensor work on these settings is
`sampling.py`; the prompt checks (they need the engine's context and vocabulary) are
`InferenceScheduler.problem`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

from astrai.inference.structured import KINDS, StructuredOutput

if TYPE_CHECKING:
    import torch

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty, as OpenAI's
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20  # logprobs, prompt_logprobs, score's top_logprobs (OpenAI's top_logprobs)
# Stop strings per request (the HTTP APIs' `stop` / `stop_sequences`): the server matches
# each against every token's text. The engine's `stop_ids` are a set lookup: no count limit.
MAX_STOPS = 16
# Completions per prompt (`SamplingParams.n`, the HTTP APIs' `n`): one group of sequences
# sharing the prompt's prefill (`astrai.inference.groups`).
MAX_N = 16
# What a prompt + max_tokens beyond the model's context does: "clamp" generates until the
# context is full (finish reason length), "error" rejects the request at submission, naming
# both numbers (OpenAI's and vLLM's rule for their APIs).
MAX_TOKENS_POLICIES = ("clamp", "error")
LOGPROBS_MODES = ("raw", "scaled", "processed")  # sampling.py's module docstring

# `(generated_ids, logits_row) -> logits_row` (vLLM's shape): `processors.py` applies them.
LogitsProcessor = Callable[[Sequence[int], "torch.Tensor"], "torch.Tensor"]


# ---------------------------------------------------------------------- value checks
def is_int(value: object) -> bool:
    """An integer that is not a bool (True is not a token id or a count)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_number(
    name: str, value: object, low: float, high: float, *, low_open: bool = False
) -> None:
    """ValueError naming `name` unless `value` is a finite real in [low, high] ((low, high]
    with `low_open`); bools are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")


def check_count(name: str, value: object, high: int, *, optional: bool = False) -> None:
    """ValueError naming `name` unless `value` is an int in [0, high] (or None, `optional`)."""
    if optional and value is None:
        return
    if not is_int(value) or not 0 <= value <= high:
        what = "None or an int" if optional else "an int"
        raise ValueError(f"{name} must be {what} in [0, {high}], got {value!r}")


def check_max_prompt_tokens(value: object) -> None:
    """The prompt cap (`InferenceEngine(max_prompt_tokens=)`, the server's setting): None
    or a positive int."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"max_prompt_tokens must be a positive int or None, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`; otherwise a ValueError naming `name`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


# ---------------------------------------------------------------------- the settings
@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings (OpenAI semantics), travelling as one object.

    temperature 0 is greedy; top_k 0 or -1 is off; top_p 1 and min_p 0 are off. Penalties
    count only generated tokens. `seed` (any int, used mod 2**64) makes draws reproducible.
    Generation ends after `max_tokens` tokens, or at a token of `stop_ids` (None: the
    tokenizer's stop tokens) unless `ignore_eos`, or when the context is full.
    `max_tokens_policy`: a prompt + `max_tokens` beyond the context is ``"clamp"``ed (the
    default: generation stops when the context is full, finish reason length; rollouts and
    evaluation rely on it) or an ``"error"`` at submission naming both numbers (the HTTP
    API's rule for an explicit `max_tokens`, as OpenAI's). `logprobs_mode`: the returned
    log-probs' distribution (`sampling.py`); `logprobs`, `prompt_logprobs` (None: off;
    allows `max_tokens=0`), `prompt_logprobs_start`: `logprobs.py`; `logits_processors`:
    `processors.py`; `structured`: `structured.py`. `n` (vLLM's name): completions of the
    prompt, one group whose samples share its prefill; with a seed, sample `j` draws with
    `seed + j` (`InferenceEngine.submit_group`, `run_batch`). `adapter`: the name of a LoRA
    adapter the engine has loaded (`astrai.inference.adapters`; None: the base model, or a
    training run's live adapter). `priority` (vLLM's): an int, lower = served sooner, read
    only under the engine's `scheduling_policy="priority"` (`astrai.inference.priority`; a
    non-zero one under "fcfs" is refused, as vLLM). `skip_special_tokens` (vLLM's): the
    output's text leaves special tokens out (False: GPT-OSS's harmony markers, which its
    reasoning parser reads, `astrai.serve.harmony`). Frozen (batches reuse).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 256
    max_tokens_policy: str = "clamp"
    ignore_eos: bool = False
    stop_ids: frozenset[int] | None = None
    logprobs_mode: str = "raw"
    logprobs: int = 0
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    logits_processors: Sequence[LogitsProcessor] = ()
    structured: StructuredOutput | None = None
    n: int = 1
    adapter: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stops = self.stop_ids
        if stops is not None and not isinstance(stops, frozenset | str | bytes):
            with contextlib.suppress(TypeError):  # not iterable: validate() names it
                object.__setattr__(self, "stop_ids", frozenset(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ValueError naming the first bad field; return self for chaining.

        With `vocab_size`, the token ids of logit_bias and stop_ids are also checked against
        the vocabulary. Whether max_tokens fits the prompt and the context is the engine's
        question (`InferenceEngine.check_request`).
        """
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        check_number("min_p", self.min_p, 0.0, 1.0)
        check_number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        check_number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_logit_bias(self.logit_bias, vocab_size)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        check_count("logprobs", self.logprobs, MAX_LOGPROBS)
        check_count("prompt_logprobs", self.prompt_logprobs, MAX_LOGPROBS, optional=True)
        start = self.prompt_logprobs_start
        if not is_int(start) or start < 1:
            raise ValueError(f"prompt_logprobs_start must be an int >= 1, got {start!r}")
        _check_logits_processors(self.logits_processors)
        _check_structured(self.structured)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_stop_ids(self.stop_ids, vocab_size)
        check_choice("max_tokens_policy", self.max_tokens_policy, MAX_TOKENS_POLICIES)
        if self.adapter is not None and not (isinstance(self.adapter, str) and self.adapter):
            raise ValueError(f"adapter must be None or an adapter's name, got {self.adapter!r}")
        if not is_int(self.priority):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        return self

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded from `seed` (None without one). Keep it for the request's life:
        each step advances it by one draw, which is what makes the sequence reproducible."""
        if self.seed is None:
            return None
        import torch  # only the engine calls this, and it has torch loaded

        return torch.Generator(device=device).manual_seed(self.seed % 2**64)


def params_from(params: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
    """`params` with keyword overrides (or a fresh `SamplingParams` from the keywords): the
    one way every engine entry point turns its settings into the request's `SamplingParams`."""
    if params is None:
        return SamplingParams(**overrides)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params, **overrides) if overrides else params


def _check_logit_bias(bias: object, vocab_size: int | None) -> None:
    if bias is None:
        return
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping token_id -> bias, got {bias!r}")
    for token, value in bias.items():
        if not is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be int token ids >= 0, got {token!r}")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(
                f"logit_bias token id {token} is outside the vocabulary (size {vocab_size})"
            )
        check_number(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


def _check_stop_ids(stops: object, vocab_size: int | None) -> None:
    if stops is None:
        return
    if not (isinstance(stops, frozenset) and all(is_int(t) and t >= 0 for t in stops)):
        raise ValueError(f"stop_ids must be a set of int token ids >= 0, got {stops!r}")
    if vocab_size is not None:
        outside = sorted(t for t in stops if t >= vocab_size)
        if outside:
            raise ValueError(
                f"stop_ids token id {outside[0]} is outside the vocabulary (size {vocab_size})"
            )


def _check_logits_processors(processors: object) -> None:
    """Each processor is called per row with `(generated_ids, logits_row)`: a sequence of
    callables; what they return is checked when they run (`processors.py`)."""
    if isinstance(processors, str | bytes) or not isinstance(processors, Sequence):
        raise ValueError(
            f"logits_processors must be a sequence of callables, got {type(processors).__name__}"
        )
    for i, proc in enumerate(processors):
        if not callable(proc):
            raise ValueError(f"logits_processors[{i}] must be callable, got {proc!r}")


def _check_structured(value: object) -> None:
    """None or a well-formed `StructuredOutput`; whether its grammar compiles is checked
    against the tokenizer (`GrammarCompiler`, by `InferenceEngine.check_request`)."""
    if value is None:
        return
    if not isinstance(value, StructuredOutput):
        raise ValueError(
            f"structured must be a StructuredOutput (or None), got {type(value).__name__}"
        )
    if value.kind not in KINDS:
        raise ValueError(f"structured: unknown kind {value.kind!r}, expected one of {KINDS}")
    if not isinstance(value.spec, str) or not isinstance(value.field, str):
        raise ValueError(f"structured: spec and field must be strings, got {value!r}")
