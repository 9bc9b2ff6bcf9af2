"""Reward functions for verifiable tasks, by name.

A reward takes ``(record, completion)``, where ``record`` is the prompt record (with e.g. its
reference ``answer``) and ``completion`` the generated text, and returns a float. Strategies
look rewards up by the names in their config::

    reward = get_reward("exact_match")
    r = reward({"prompt": "What is 2 + 3?", "answer": "5"}, "2 + 3 = 5. The answer is 5.")

A reward that lives in a package this one must not import (``code_tests`` runs programs in
``astrai.eval``'s sandbox) is registered by import path and imported on first use. A reward
may also have a ``batch(records, completions) -> list[float]`` method, which callers that
score many completions at once use instead (``code_tests`` runs its programs in parallel).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from astrai.data.math_answer import math_answer

RewardFn = Callable[[Mapping[str, Any], str], float]

#: The answer format the built-in tasks teach: the last sentence is ``The answer is <number>.``
ANSWER_PREFIX = "The answer is"
_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_FORMAT_RE = re.compile(rf"{ANSWER_PREFIX} ({_NUMBER})\.?\s*$")

#: Registered rewards: a callable, or the dotted import path of one (or of a class whose
#: default instance is one) that :func:`get_reward` imports on first use.
REWARDS: dict[str, RewardFn | str] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to :data:`REWARDS` under ``name``."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered ({REWARDS[name]!r})")
        REWARDS[name] = fn
        return fn

    return deco


def register_reward_path(name: str, path: str) -> None:
    """Register the reward at dotted import ``path`` (a function, or a class built with its
    defaults) under ``name`` without importing it: its module is imported by the first
    :func:`get_reward` of ``name``, so this registry never imports the package it lives in."""
    if name in REWARDS and REWARDS[name] != path:
        raise ValueError(f"reward {name!r} is already registered ({REWARDS[name]!r})")
    REWARDS[name] = path


def _load(name: str, path: str) -> RewardFn:
    module, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"reward {name!r}: cannot import {path!r}: {err}") from err
    fn = obj() if inspect.isclass(obj) else obj
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {path!r} is a {type(fn).__name__}, not callable")
    return fn


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name`` (imported now if registered by path); a ``KeyError``
    lists the available ones."""
    try:
        entry = REWARDS[name]
    except KeyError:
        raise KeyError(f"unknown reward {name!r}; available: {sorted(REWARDS)}") from None
    if isinstance(entry, str):
        entry = REWARDS[name] = _load(name, entry)
    return entry


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


register_reward("math_answer")(math_answer)
register_reward_path("code_tests", "astrai.eval.code_reward.CodeTests")
register_reward_path("countdown", "astrai.data.countdown.countdown_reward")
register_reward_path("countdown_format", "astrai.data.countdown.countdown_format")
