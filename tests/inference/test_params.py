"""`SamplingParams` and its one `validate()`: torch-free, and every bad field named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import astrai.inference as inference
from astrai.inference.params import (
    MAX_LOGPROBS,
    MAX_TOKENS_POLICIES,
    SamplingParams,
    check_choice,
    check_count,
)
from astrai.inference.structured import StructuredOutput

ROOT = Path(__file__).resolve().parents[2]


def test_importing_params_imports_no_torch():
    """A command builds and checks its settings before torch loads (`astrai.generate`)."""
    code = (
        "import sys, astrai.inference.params as p\n"
        "p.SamplingParams(temperature=0.5, stop_ids=[1]).validate(vocab_size=8)\n"
        "print(*sorted(sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    loaded = set(run.stdout.split())
    assert run.returncode == 0 and "astrai.inference.params" in loaded, run.stderr[-2000:]
    assert not {"torch", "llguidance", "numpy"} & loaded
    assert inference.SamplingParams is SamplingParams  # the package's lazy name


class Opaque:
    """Not a number, a mapping, a sequence or a StructuredOutput."""


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "0.5", "must be a finite number"),
        ("top_p", None, "must be a finite number"),
        ("min_p", float("inf"), "must be a finite number"),
        ("presence_penalty", True, "must be a finite number"),
        ("seed", "7", "must be an int or None"),
        ("max_tokens", 8.0, "must be an int"),
        ("logprobs", MAX_LOGPROBS + 1, f"must be an int in [0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", -1, "must be None or an int"),
        ("logits_processors", "upper", "must be a sequence of callables"),
        ("logits_processors", [len, 3], "[1] must be callable"),
        ("structured", {"type": "object"}, "must be a StructuredOutput"),
        ("structured", StructuredOutput("yaml"), "unknown kind 'yaml'"),
        ("stop_ids", [-1], "must be a set of int token ids >= 0"),
        ("stop_ids", Opaque(), "must be a set of int token ids"),
        ("max_tokens_policy", "truncate", "must be one of clamp, error"),
        ("logprobs_mode", "logits", "must be one of"),
        ("logit_bias", {True: 1.0}, "keys must be int token ids"),
    ],
)
def test_validate_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=f"^{field}") as info:
        SamplingParams(**{field: value}).validate()
    assert message in str(info.value)


def test_the_vocabulary_bounds_logit_bias_and_stop_ids():
    ok = SamplingParams(logit_bias={7: 1.0}, stop_ids=[0, 7])
    assert ok.validate(vocab_size=8) is ok
    with pytest.raises(ValueError, match=r"^stop_ids token id 8 is outside the vocabulary"):
        SamplingParams(stop_ids=[3, 8, 9]).validate(vocab_size=8)
    with pytest.raises(ValueError, match=r"^logit_bias token id 8 is outside"):
        SamplingParams(logit_bias={8: 1.0}).validate(vocab_size=8)
    SamplingParams(stop_ids=[10**6]).validate()  # no vocabulary given: only the type


def test_huge_seeds_and_frozen_fields():
    assert SamplingParams(seed=-(2**80)).validate().make_generator() is not None
    params = SamplingParams(stop_ids=(4, 4, 5))
    assert params.stop_ids == frozenset({4, 5})
    with pytest.raises(AttributeError):
        params.temperature = 0.0  # type: ignore[misc]
    assert SamplingParams(temperature=0).greedy and not params.greedy


def test_the_shared_limit_checks_name_their_field():
    check_count("top_logprobs", MAX_LOGPROBS, MAX_LOGPROBS)
    with pytest.raises(ValueError, match=r"^top_logprobs must be an int in \[0, 20\], got 21"):
        check_count("top_logprobs", 21, MAX_LOGPROBS)
    check_count("prompt_logprobs", None, MAX_LOGPROBS, optional=True)
    assert check_choice("max_tokens_policy", "error", MAX_TOKENS_POLICIES) == "error"
    with pytest.raises(ValueError, match=r"^max_tokens_policy must be one of clamp, error"):
        check_choice("max_tokens_policy", 1, MAX_TOKENS_POLICIES)
