"""Reward functions for verifiable tasks, by name.

A reward takes ``(record, completion)``, where ``record`` is the prompt record (with e.g. its
reference ``answer``) and ``completion`` the generated text, and returns a float. Strategies
look rewards up by the names in their config::

    reward = get_reward("exact_match")
    r = reward({"prompt": "What is 2 + 3?", "answer": "5"}, "2 + 3 = 5. The answer is 5.")
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[[Mapping[str, Any], str], float]

#: The answer format the built-in tasks teach: the last sentence is ``The answer is <number>.``
ANSWER_PREFIX = "The answer is"
_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FORMAT_RE = re.compile(rf"{ANSWER_PREFIX} ({_NUMBER})\.?\s*$")

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to :data:`REWARDS` under ``name``."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered ({REWARDS[name]!r})")
        REWARDS[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``; a ``KeyError`` lists the available ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; available: {sorted(REWARDS)}") from None


def format_answer(answer: Any) -> str:
    """The final sentence a correct completion ends with."""
    return f"{ANSWER_PREFIX} {answer}."


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def extract_final_number(completion: str) -> float | None:
    """The number after the last ``The answer is``, else the last number in the text."""
    idx = completion.rfind(ANSWER_PREFIX)
    if idx >= 0:
        match = _NUMBER_RE.search(completion, idx + len(ANSWER_PREFIX))
        if match:
            return _to_number(match.group())
    numbers = _NUMBER_RE.findall(completion)
    return _to_number(numbers[-1]) if numbers else None


@register_reward("exact_match")
def exact_match(record: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion's final number equals ``record["answer"]``, else 0.0."""
    if "answer" not in record:
        raise KeyError(f"exact_match needs an 'answer' field in the record (has: {sorted(record)})")
    expected = _to_number(str(record["answer"]))
    got = extract_final_number(completion)
    if expected is None or got is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=0.0, abs_tol=1e-9) else 0.0


@register_reward("format")
def format_reward(record: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion ends with ``The answer is <number>.``, whatever the number."""
    return 1.0 if _FORMAT_RE.search(completion.strip()) else 0.0


@register_reward("closeness")
def closeness(record: Mapping[str, Any], completion: str) -> float:
    """Dense partial credit ``1 / (1 + |answer - final number|)`` (0 without a number).

    Exact match alone gives a policy that is never right only zero-variance groups, hence no
    gradient; this shaping term lets a weak starting point climb towards the right answers.
    """
    if "answer" not in record:
        raise KeyError(f"closeness needs an 'answer' field in the record (has: {sorted(record)})")
    got = extract_final_number(completion)
    try:
        expected = float(str(record["answer"]).replace(",", ""))
    except ValueError:
        return 0.0
    if got is None or not math.isfinite(got):
        return 0.0
    return 1.0 / (1.0 + abs(got - expected))
