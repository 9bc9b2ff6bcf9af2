"""Data that ships with every Python installation or is generated: nothing is downloaded.

- :func:`stdlib_corpus`: the Python standard library's own ``.py`` sources, a real (code)
  text corpus present on every machine, split into train / val by a hash of the file path.
- :func:`arithmetic_problems`: seeded arithmetic questions with exact answers, and builders
  for SFT chats, preference pairs (correct vs. wrong answer) and GRPO prompts. Train and val
  problems are disjoint (split by a hash of the expression), so evaluation never sees a
  training question.
- ``countdown/sft`` and ``countdown/prompt``: the Countdown task of :mod:`astrai.data.countdown`
  (reach a target from given numbers; demonstrations from a weak solver only).

Everything is reproducible from its arguments. ``python -m astrai.data.prepare`` reads these
directly with ``input=builtin:stdlib/train``, ``builtin:arithmetic/sft``,
``builtin:arithmetic/tools`` (chats that call a ``calc`` tool:
the tool chats below), ... (see :func:`builtin_records`), or write them to JSONL
with :func:`write_builtin_jsonl`.
"""

from __future__ import annotations

import os
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from astrai.data.countdown import (
    PROBLEM_OPTIONS,
    countdown_problems,
    countdown_prompt_records,
    countdown_sft_records,
)
from astrai.data.rewards import format_answer
from astrai.data.splits import draw_in_split, in_split
from astrai.data.storage import write_jsonl

SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


# -------------------------------------------------------------------------------- stdlib corpus


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(
    split: str | None = "train",
    *,
    val_fraction: float = 0.05,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of the stdlib ``.py`` files of a split, sorted by path.

    Test suites, site-packages and caches are skipped. ``max_files`` / ``max_bytes`` cap the
    count and the total size (in sorted order) for quick experiments.
    """
    root = stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"standard library not found at {root} (sysconfig 'stdlib')")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    out: list[tuple[str, Path]] = []
    total = 0
    for rel, path in found:
        if not in_split(rel, split, val_fraction):
            continue
        size = path.stat().st_size
        if max_bytes is not None and total + size > max_bytes and out:
            break
        out.append((rel, path))
        total += size
        if max_files is not None and len(out) >= max_files:
            break
    return out


def stdlib_records(split: str | None = "train", **kwargs: Any) -> Iterator[dict[str, str]]:
    """``{"text", "path"}`` per stdlib source file (see :func:`stdlib_files`)."""
    for rel, path in stdlib_files(split, **kwargs):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield {"text": text, "path": rel}


def stdlib_corpus(split: str | None = "train", **kwargs: Any) -> Iterator[str]:
    """Texts of the stdlib source files of a split (see :func:`stdlib_files`)."""
    for record in stdlib_records(split, **kwargs):
        yield record["text"]


# ---------------------------------------------------------------------------------- arithmetic


def _evaluate(terms: list[int], ops: list[str]) -> int:
    """Value of ``t0 op0 t1 op1 t2 ...`` with the usual precedence (``*`` first)."""
    values, pending = [terms[0]], []
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            values[-1] *= term
        else:
            pending.append(op)
            values.append(term)
    result = values[0]
    for op, value in zip(pending, values[1:]):
        result = result + value if op == "+" else result - value
    return result


def arithmetic_problems(
    n: int,
    seed: int = 0,
    *,
    split: str | None = "train",
    val_fraction: float = 0.1,
    max_operand: int = 100,
    max_terms: int = 2,
    ops: str = "+-*",
    unique: bool = False,
    solution: str = "plain",
) -> list[dict[str, Any]]:
    """``n`` records ``{"id", "prompt", "expression", "answer"}`` (answer as a string).

    Expressions have 2..``max_terms`` operands in [0, ``max_operand``]; problems are assigned
    to ``train`` / ``val`` by a hash of the expression, so the two never share a question.
    ``unique`` draws distinct problems (evaluation sets), else with replacement (training).
    ``solution`` is the style of the worked ``solution`` of each record (:func:`solution_text`).
    """
    if solution not in SOLUTIONS:
        raise ValueError(
            f"arithmetic_problems: solution must be one of {SOLUTIONS}, got {solution!r}"
        )
    if n < 0 or max_terms < 2 or max_operand < 1 or not ops or set(ops) - set("+-*"):
        raise ValueError(
            f"arithmetic_problems: need n >= 0, max_terms >= 2, max_operand >= 1 and ops from "
            f"'+-*' (got n={n}, max_terms={max_terms}, max_operand={max_operand}, ops={ops!r})"
        )
    rng = random.Random(seed)

    def draw() -> tuple[str, Callable[[int], dict[str, Any]]]:
        k = rng.randint(2, max_terms)
        terms = [rng.randint(0, max_operand) for _ in range(k)]
        chosen_ops = [rng.choice(ops) for _ in range(k - 1)]
        expression = " ".join(
            [str(terms[0])] + [f"{op} {t}" for op, t in zip(chosen_ops, terms[1:])]
        )

        def build(index: int) -> dict[str, Any]:
            answer = str(_evaluate(terms, chosen_ops))
            return {
                "id": f"arith-{split or 'all'}-{seed}-{index}",
                "prompt": f"What is {expression}?",
                "expression": expression,
                "answer": answer,
                "solution": solution_text(expression, answer, solution),
            }

        return expression, build

    records = draw_in_split(
        draw,
        n,
        split=split,
        val_fraction=val_fraction,
        unique=unique,
        what=f"arithmetic_problems (max_operand={max_operand}, ops={ops!r})",
    )
    return records


SOLUTIONS = ("plain", "columns")


def _digits(n: int) -> list[int]:
    """Decimal digits of ``n >= 0``, units first."""
    return [int(c) for c in reversed(str(n))]


def _column_steps(a: int, b: int, op: str) -> list[str]:
    """Schoolbook column arithmetic for ``a op b`` (``a >= b >= 0`` for ``-``), units column
    first: ``9 + 9 = 18`` (carry to the next column), ``12 - 8 = 4`` after a borrow."""
    da, db = _digits(a), _digits(b)
    width = max(len(da), len(db))
    da, db = da + [0] * (width - len(da)), db + [0] * (width - len(db))
    steps, carry = [], 0
    for i in range(width):
        x, y = da[i], db[i]
        if op == "+":
            total = x + y + carry
            steps.append(f"{x} + {y}{' + 1' if carry else ''} = {total}")
            carry = total // 10
        else:
            x -= carry
            carry = int(x < y)
            steps.append(f"{x + 10 * carry} - {y} = {x + 10 * carry - y}")
    return steps


def solution_text(
    expression: str, answer: Any, style: str = "plain", terms: list[int] | None = None
) -> str:
    """The worked answer the SFT data teaches, ending ``The answer is <value>.``

    ``plain``: ``<expr> = <value>.``; ``columns``: for two operands and ``+`` or ``-``, the
    schoolbook columns first, units first (``89 + 99: 9 + 9 = 18, 8 + 9 + 1 = 18. 89 + 99 =
    188.``): each digit then depends on a few nearby tokens, which a small model learns much
    faster than the whole sum at once. Other expressions fall back to ``plain``.
    """
    if style not in SOLUTIONS:
        raise ValueError(f"solution style must be one of {SOLUTIONS}, got {style!r}")
    parts = expression.split()
    if style == "columns" and len(parts) == 3 and parts[1] in "+-":
        a, op, b = int(parts[0]), parts[1], int(parts[2])
        if op == "+":
            work = f"{expression}: {', '.join(_column_steps(a, b, '+'))}."
        elif a >= b:
            work = f"{expression}: {', '.join(_column_steps(a, b, '-'))}."
        else:
            work = f"{expression} = -({b} - {a}): {', '.join(_column_steps(b, a, '-'))}."
        return f"{work} {expression} = {answer}. {format_answer(answer)}"
    return f"{expression} = {answer}. {format_answer(answer)}"


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible but wrong answer (off by 1..10)."""
    delta = rng.choice([d for d in range(-10, 11) if d != 0])
    return str(int(answer) + delta)


def sft_records(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat records (``messages``) whose assistant turn solves the problem."""
    return [
        {
            "id": p["id"],
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["solution"]},
            ],
            "answer": p["answer"],
        }
        for p in problems
    ]


def preference_records(problems: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected"}``: the correct solution against a wrong final
    answer (off-policy pairs; ``astrai.data.OnPolicyPairs`` samples them from a policy)."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        wrong = wrong_answer(p["answer"], rng)
        out.append(
            {
                "id": p["id"],
                "prompt": p["prompt"],
                "chosen": p["solution"],
                "rejected": f"{p['expression']} = {wrong}. {format_answer(wrong)}",
                "answer": p["answer"],
            }
        )
    return out


def prompt_records(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GRPO prompts with the reference ``answer`` the rewards check against, and the worked
    ``solution`` (the on-policy pair builder's optional fallback ``chosen``)."""
    return [
        {
            "id": p["id"],
            "prompt": p["prompt"],
            "answer": p["answer"],
            "solution": p["solution"],
        }
        for p in problems
    ]


# ----------------------------------------------------------------------------- tool chats
# GRPO with a calculator can only reinforce tool calls the starting policy already makes, so
# the SFT start (`arithmetic/tools`) sees both ways of answering: a seeded `tool_fraction` of
# the problems call `calc` (Hermes/Qwen-style `tool_calls`), read the value from the tool
# turn and state it; the rest are the worked solutions of `arithmetic/sft`. No `tools` schema
# (the tiny model's context is too short); astrai.train.environments.Calculator answers
# exactly this conversation.

TOOL_NAME = "calc"


def tool_messages(problem: dict[str, Any]) -> list[dict[str, Any]]:
    """The four turns: question, ``calc`` call, the value, the plain answer."""
    expression, answer = problem["expression"], problem["answer"]
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expr": expression}}}
    return [
        {"role": "user", "content": problem["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": solution_text(expression, answer, "plain")},
    ]


def check_tool_fraction(tool_fraction: Any) -> float:
    """``tool_fraction`` as a float in [0, 1], else a ValueError naming the field."""
    if isinstance(tool_fraction, bool) or not isinstance(tool_fraction, int | float):
        raise ValueError(f"tool_fraction must be a number in [0, 1], got {tool_fraction!r}")
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction!r}")
    return float(tool_fraction)


def tool_records(
    problems: list[dict[str, Any]], tool_fraction: float = 0.5, seed: int = 0
) -> list[dict[str, Any]]:
    """``{"id", "messages", "answer"}`` per problem: the tool conversation with probability
    ``tool_fraction`` (seeded apart from the problem draw, one choice per record, so a
    longer list keeps the choices of a shorter one), else the direct SFT chat."""
    fraction = check_tool_fraction(tool_fraction)
    rng = random.Random(f"arithmetic/tools:{seed}")
    out = []
    for problem, direct in zip(problems, sft_records(problems)):
        if rng.random() < fraction:
            direct = {**direct, "messages": tool_messages(problem)}
        out.append(direct)
    return out


# ----------------------------------------------------------------------------------- by name

#: a data or corpus source `builtin:<name>` names records that ship with the package
BUILTIN_PREFIX = "builtin:"


def is_builtin(source: Any) -> bool:
    """`source` names built-in records (`builtin:arithmetic/sft`), not a file."""
    return isinstance(source, str) and source.startswith(BUILTIN_PREFIX)


BUILTIN_NAMES = (
    "stdlib/train",
    "stdlib/val",
    "arithmetic/sft",
    "arithmetic/preference",
    "arithmetic/prompt",
    "arithmetic/tools",
    "countdown/sft",
    "countdown/prompt",
)


def builtin_records(
    name: str,
    *,
    split: str | None = None,
    n: int = 1000,
    seed: int = 0,
    **options: Any,
) -> Iterator[dict[str, Any]]:
    """Records of a built-in source by name, e.g. ``stdlib/val`` or ``arithmetic/sft/val``.

    Arithmetic and countdown names take an optional split suffix (``/train`` default,
    ``/val``); ``n``, ``seed`` and further ``options`` go to :func:`arithmetic_problems`,
    :func:`~astrai.data.countdown.countdown_problems` or :func:`stdlib_files`;
    ``arithmetic/tools`` also takes ``tool_fraction`` (the tool chats below).
    ``countdown/sft`` holds the weak solver's demonstrations of the ``n`` problems drawn
    (fewer records: it gives up on some), ``countdown/prompt`` every problem.
    """
    parts = name.strip("/").split("/")
    source = parts[0]
    if source == "stdlib" and len(parts) <= 2:
        split = parts[1] if len(parts) == 2 else (split or "train")
        allowed = {"val_fraction", "max_files", "max_bytes"}
        yield from stdlib_records(split, **{k: v for k, v in options.items() if k in allowed})
        return
    if source == "arithmetic" and 2 <= len(parts) <= 3:
        task = parts[1]
        split = parts[2] if len(parts) == 3 else (split or "train")
        allowed = {"val_fraction", "max_operand", "max_terms", "ops", "unique", "solution"}
        problems = arithmetic_problems(
            n, seed, split=split, **{k: v for k, v in options.items() if k in allowed}
        )
        if task == "sft":
            yield from sft_records(problems)
            return
        if task == "preference":
            yield from preference_records(problems, seed=seed)
            return
        if task == "prompt":
            yield from prompt_records(problems)
            return
        if task == "tools":
            yield from tool_records(problems, options.get("tool_fraction", 0.5), seed=seed)
            return
    if source == "countdown" and 2 <= len(parts) <= 3 and parts[1] in ("sft", "prompt"):
        split = parts[2] if len(parts) == 3 else (split or "train")
        chosen = {k: v for k, v in options.items() if k in PROBLEM_OPTIONS}
        problems = countdown_problems(n, seed, split=split, **chosen)
        builder = countdown_sft_records if parts[1] == "sft" else countdown_prompt_records
        yield from builder(problems)
        return
    raise ValueError(
        f"unknown builtin data {name!r}; available: {', '.join(BUILTIN_NAMES)} "
        f"(arithmetic and countdown names accept a /train or /val suffix)"
    )


def write_builtin_jsonl(name: str, path: str | os.PathLike, **kwargs: Any) -> int:
    """Write :func:`builtin_records` to a JSONL file (atomically); returns the count."""
    return write_jsonl(builtin_records(name, **kwargs), path)
