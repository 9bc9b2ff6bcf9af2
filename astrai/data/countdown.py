"""Countdown: reach a target from given numbers with ``+ - * /``, each number exactly once.

A task where the reward knows more than the demonstrations. Each problem has many valid
answers, checked exactly by :func:`countdown_reward`; the only demonstrations come from
:func:`weak_solve`, a greedy heuristic that is often wrong and often gives up, so SFT on them
is capped well below what the reward can teach (the built-in arithmetic task's SFT data holds
every answer, which lets more SFT beat every RL method there).

- Problems (:func:`countdown_problems`): ``num_count`` numbers in [1, ``max_number``] and a
  target in [1, ``max_target``] made by a random expression over all of them (so every
  problem is solvable), assigned to ``train`` / ``val`` by a hash of the sorted numbers and
  the target: the two splits never share a problem, whatever the seed or the order of the
  numbers.
- The rule (the reward's): the answer uses every given number **exactly once** (TinyZero's
  check: the multiset of the expression's numbers equals the given one), with ``+ - * /``
  and parentheses, and equals the target exactly (fractions: ``(7 - 3) / 2 * 5``). Exactly
  once keeps every answer the same shape (three numbers, two operators), which a 5M model
  learns quickly from the demonstrations, while the choice and order of the operators and
  numbers still leaves the reward plenty to teach.
- The weak solver keeps the given order, and at each step picks the operator whose result
  lands closest to the target (``/`` only when it divides exactly), or with probability
  ``explore`` (0.5) a random one; no backtracking, no reordering. When it reaches the target
  its demonstration is right; when it ends within ``slack`` of it, it writes its answer
  anyway (a wrong demonstration); otherwise it gives up and the problem has no
  demonstration. With the defaults it writes one for ~0.47 of the held-out problems, right
  on ~0.21 (greedy alone would be right on ~0.40): its exploration is what gives an SFT
  policy more than one move per problem, which a reward can then sort (a purely greedy
  solver's SFT start is nearly deterministic and leaves GRPO no varied groups).

Completions end ``The answer is <expression>.``; a demonstration works left to right first:
``5 * 3 = 15, 15 + 2 = 17. The answer is (5 * 3) + 2.``
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from astrai.data.rewards import ANSWER_PREFIX, format_answer
from astrai.data.splits import draw_in_split

OPS = ("+", "-", "*", "/")
#: the longest answer text the reward parses (a valid one over three small numbers is ~20)
MAX_EXPRESSION_CHARS = 200
_AST_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_ALLOWED_CHARS = re.compile(r"^[\d\s+\-*/()]+$")


def apply_op(a: Fraction, op: str, b: Fraction) -> Fraction:
    """``a op b`` exactly (a ``ZeroDivisionError`` for ``/ 0``)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


# ------------------------------------------------------------------------------- the checker


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """``(value, numbers used)`` of an arithmetic expression, or None when it is not one.

    Safe: the text is parsed with :mod:`ast` (never evaluated by Python) and only integer
    literals, ``+ - * /`` between two operands and parentheses are accepted; a unary sign,
    ``**``, ``//``, names, calls or anything else is rejected, as is division by zero and
    text over :data:`MAX_EXPRESSION_CHARS`.
    """
    text = text.strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ALLOWED_CHARS.match(text):
        return None
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            return apply_op(walk(node.left), _AST_OPS[type(node.op)], walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        value = walk(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return value, used


def final_expression(completion: str) -> str:
    """The answer a completion gives: the text after its last ``The answer is`` (else its
    last non-empty line), up to a ``=`` if it restates the value, without the final period."""
    idx = completion.rfind(ANSWER_PREFIX)
    if idx >= 0:
        text = completion[idx + len(ANSWER_PREFIX) :]
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.split("=", 1)[0].strip().rstrip(".").strip()


def check_answer(expression: str, numbers: Sequence[int], target: Any) -> bool:
    """Whether `expression` uses each of `numbers` exactly once and equals `target`."""
    parsed = parse_expression(expression)
    if parsed is None:
        return False
    value, used = parsed
    return Counter(used) == Counter(int(n) for n in numbers) and value == Fraction(target)


def _fields(record: Mapping[str, Any], reward: str) -> tuple[list[int], int]:
    missing = [k for k in ("numbers", "target") if k not in record]
    if missing:
        raise KeyError(f"{reward} needs {missing} in the record (has: {sorted(record)})")
    return [int(n) for n in record["numbers"]], int(record["target"])


def countdown_reward(record: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion's final expression (:func:`final_expression`) uses each of
    ``record["numbers"]`` exactly once and equals ``record["target"]``, else 0.0."""
    numbers, target = _fields(record, "countdown")
    return 1.0 if check_answer(final_expression(completion), numbers, target) else 0.0


def countdown_format(record: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion ends ``The answer is <expression>.`` with an expression the
    checker parses, whatever its numbers and value."""
    text = completion.strip()
    idx = text.rfind(ANSWER_PREFIX)
    if idx < 0 or not text.endswith("."):
        return 0.0
    answer = text[idx + len(ANSWER_PREFIX) : -1]
    return 1.0 if "=" not in answer and parse_expression(answer) is not None else 0.0


# ------------------------------------------------------------------------------ the problems


def _wrap(expression: str, is_leaf: bool) -> str:
    return expression if is_leaf else f"({expression})"


def random_solution(numbers: Sequence[int], rng: random.Random) -> tuple[str, Fraction]:
    """A random expression over all of `numbers` (random pairs combined with random
    operators until one is left) and its exact value; ``inf`` for a division by zero."""
    items: list[tuple[str, Fraction, bool]] = [(str(n), Fraction(n), True) for n in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (left, a, left_leaf), (right, b, right_leaf) = items[i], items[j]
        op = rng.choice(OPS)
        if op == "/" and b == 0:
            return "", Fraction(10**9)
        value = apply_op(a, op, b)
        text = f"{_wrap(left, left_leaf)} {op} {_wrap(right, right_leaf)}"
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(text, value, False)]
    return items[0][0], items[0][1]


def weak_solve(
    numbers: Sequence[int], target: int, rng: random.Random | None = None, explore: float = 0.0
) -> tuple[str, list[str], int]:
    """The weak solver's attempt: ``(expression, worked steps, its value)``.

    Left to right in the given order, each step takes the operator whose result is closest
    to the target (ties: ``+ - * /`` order; ``/`` only when it divides exactly), except that
    with probability `explore` (drawn from `rng`) it takes one of them at random: a noisy
    greedy search, so its demonstrations show more than one move per problem.
    """
    value, expression, steps = int(numbers[0]), str(numbers[0]), []
    for k, n in enumerate(numbers[1:]):
        n = int(n)
        options = [(value + n, "+"), (value - n, "-"), (value * n, "*")]
        if n != 0 and value % n == 0:
            options.append((value // n, "/"))
        if rng is not None and explore > 0 and rng.random() < explore:
            result, op = rng.choice(options)
        else:
            result, op = min(options, key=lambda option: abs(option[0] - target))
        steps.append(f"{value} {op} {n} = {result}")
        expression = f"{_wrap(expression, k == 0)} {op} {n}"
        value = result
    return expression, steps, value


def demonstration(
    numbers: Sequence[int],
    target: int,
    slack: int,
    rng: random.Random | None = None,
    explore: float = 0.0,
) -> tuple[str | None, str]:
    """The weak solver's written answer and how it fares: ``(text, "right")``, ``(text,
    "wrong")`` when it ends within `slack` of the target, else ``(None, "none")``."""
    expression, steps, value = weak_solve(numbers, target, rng, explore)
    if value != target and abs(value - target) > slack:
        return None, "none"
    text = f"{', '.join(steps)}. {format_answer(expression)}"
    return text, "right" if value == target else "wrong"


def problem_prompt(numbers: Sequence[int], target: int) -> str:
    return f"Make {target} from {', '.join(map(str, numbers))} using + - * / and each number once."


def countdown_problems(
    n: int,
    seed: int = 0,
    *,
    split: str | None = "train",
    val_fraction: float = 0.2,
    num_count: int = 3,
    max_number: int = 10,
    max_target: int = 100,
    slack: int = 5,
    explore: float = 0.5,
    unique: bool = False,
) -> list[dict[str, Any]]:
    """``n`` records ``{"id", "prompt", "numbers", "target", "answer", "solution",
    "solver"}``: ``answer`` is one valid expression (the one the target was made from),
    ``solution`` the weak solver's demonstration (None when it gives up) and ``solver``
    ``right`` / ``wrong`` / ``none`` says which (see the module docstring).

    ``unique`` draws distinct problems (evaluation sets), else with replacement (training).
    The defaults make ~2,900 distinct problems, a fifth of them held out (~580).
    """
    if n < 0 or num_count < 2 or max_number < 1 or max_target < 1 or slack < 0:
        raise ValueError(
            f"countdown_problems: need n >= 0, num_count >= 2, max_number >= 1, "
            f"max_target >= 1 and slack >= 0 (got n={n}, num_count={num_count}, "
            f"max_number={max_number}, max_target={max_target}, slack={slack})"
        )
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"countdown_problems: explore must be in [0, 1], got {explore!r}")
    rng = random.Random(f"countdown:{seed}")
    solver_rng = random.Random(f"countdown/solver:{seed}")  # apart: the problems never move

    def draw() -> tuple[str, Callable[[int], dict[str, Any]]] | None:
        numbers = [rng.randint(1, max_number) for _ in range(num_count)]
        answer, value = random_solution(numbers, rng)
        if value.denominator != 1 or not 1 <= value <= max_target:
            return None
        target = int(value)

        def build(index: int) -> dict[str, Any]:
            solution, solver = demonstration(numbers, target, slack, solver_rng, explore)
            return {
                "id": f"countdown-{split or 'all'}-{seed}-{index}",
                "prompt": problem_prompt(numbers, target),
                "numbers": numbers,
                "target": target,
                "answer": answer,
                "solution": solution,
                "solver": solver,
            }

        return f"{' '.join(map(str, sorted(numbers)))} -> {target}", build

    records: list[dict[str, Any]] = draw_in_split(
        draw,
        n,
        split=split,
        val_fraction=val_fraction,
        unique=unique,
        what=(
            f"countdown_problems (num_count={num_count}, max_number={max_number}, "
            f"max_target={max_target})"
        ),
    )
    return records


def countdown_sft_records(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chats whose assistant turn is the weak solver's demonstration, right or wrong; the
    problems it gave up on have none and are left out."""
    return [
        {
            "id": p["id"],
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["solution"]},
            ],
            "numbers": p["numbers"],
            "target": p["target"],
        }
        for p in problems
        if p["solution"] is not None
    ]


def countdown_prompt_records(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """GRPO / evaluation prompts with the ``numbers`` and ``target`` the reward checks."""
    return [
        {
            "id": p["id"],
            "prompt": p["prompt"],
            "numbers": p["numbers"],
            "target": p["target"],
            "answer": p["answer"],
        }
        for p in problems
    ]


PROBLEM_OPTIONS = frozenset(
    {"val_fraction", "num_count", "max_number", "max_target", "slack", "explore", "unique"}
)


def solver_figures(problems: list[dict[str, Any]]) -> dict[str, float]:
    """The weak solver's calibration on `problems`: ``coverage`` (a demonstration is
    written), ``accuracy`` (it is right, over all problems) and ``precision`` (right, over
    the written ones), each checked by the reward's own checker."""
    written = [p for p in problems if p["solution"] is not None]
    right = sum(countdown_reward(p, p["solution"]) for p in written)
    total = max(1, len(problems))
    return {
        "problems": float(len(problems)),
        "coverage": len(written) / total,
        "accuracy": right / total,
        "precision": right / max(1, len(written)),
    }
