"""Built-in data (stdlib corpus, arithmetic tasks) and the reward registry."""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest

from astrai.data.builtin import (
    arithmetic_problems,
    builtin_records,
    preference_records,
    prompt_records,
    sft_records,
    stdlib_corpus,
    stdlib_files,
    stdlib_root,
    write_builtin_jsonl,
)
from astrai.data.rewards import REWARDS, extract_final_number, get_reward, register_reward
from astrai.data.storage import JsonStorage


def test_stdlib_split_is_deterministic_and_disjoint() -> None:
    train, val = stdlib_files("train"), stdlib_files("val")
    assert len(train) > 100 and len(val) > 5
    assert not {r for r, _ in train} & {r for r, _ in val}
    assert train == sorted(train) and stdlib_files("train") == train
    assert all(
        "test" not in Path(r).parts[:-1] and "site-packages" not in r for r, _ in train + val
    )
    assert {r for r, _ in train} | {r for r, _ in val} == {r for r, _ in stdlib_files(None)}
    assert "os.py" in {r for r, _ in train + val}
    assert all(p.is_relative_to(stdlib_root()) for _, p in train[:5])


def test_stdlib_limits() -> None:
    assert len(stdlib_files("train", max_files=3)) == 3
    small = stdlib_files("train", max_bytes=50_000)
    assert sum(p.stat().st_size for _, p in small) <= 50_000 or len(small) == 1
    texts = list(stdlib_corpus("val", max_files=2))
    assert len(texts) == 2 and all(isinstance(t, str) and t for t in texts)
    with pytest.raises(ValueError, match="split must be one of"):
        stdlib_files("dev")


def _eval(expression: str) -> int:
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant)
        return node.value

    return walk(ast.parse(expression, mode="eval").body)


def test_arithmetic_is_seeded_exact_and_split() -> None:
    a = arithmetic_problems(50, seed=4, max_terms=3)
    assert a == arithmetic_problems(50, seed=4, max_terms=3)
    assert a != arithmetic_problems(50, seed=5, max_terms=3)
    for p in a:
        assert int(p["answer"]) == _eval(p["expression"])
        assert p["prompt"] == f"What is {p['expression']}?"
    val = arithmetic_problems(50, seed=4, split="val", max_terms=3)
    assert not {p["expression"] for p in a} & {p["expression"] for p in val}
    with pytest.raises(ValueError, match="max_terms"):
        arithmetic_problems(3, max_terms=1)


def test_task_builders_and_rewards_agree() -> None:
    problems = arithmetic_problems(20, seed=0)
    exact, fmt = get_reward("exact_match"), get_reward("format")
    for s, pref, prompt in zip(
        sft_records(problems), preference_records(problems), prompt_records(problems)
    ):
        answer = s["messages"][-1]["content"]
        assert s["messages"][0]["role"] == "user" and s["messages"][1]["role"] == "assistant"
        assert exact(prompt, answer) == 1.0 and fmt(prompt, answer) == 1.0
        assert exact(prompt, pref["chosen"]) == 1.0
        assert exact(prompt, pref["rejected"]) == 0.0 and fmt(prompt, pref["rejected"]) == 1.0
        assert set(prompt) == {"id", "prompt", "answer", "solution"}
        assert prompt["solution"] == answer  # the worked solution SFT teaches
    assert preference_records(problems, seed=1) == preference_records(problems, seed=1)


@pytest.mark.parametrize("ops", ["+", "-"])
def test_column_solutions_are_schoolbook_arithmetic(ops: str) -> None:
    """Every column step is a true one-digit sum or difference, the steps run units first,
    and the digits they produce (carries and borrows included) spell the answer."""
    import re

    problems = arithmetic_problems(400, seed=3, max_operand=99, ops=ops, solution="columns")
    exact = get_reward("exact_match")
    for p in problems:
        text = p["solution"]
        assert exact(p, text) == 1.0
        a, op, b = p["expression"].split()
        a, b = int(a), int(b)
        if op == "-" and a < b:
            assert text.startswith(f"{p['expression']} = -({b} - {a}): ")
            a, b = b, a
        steps = re.findall(
            r"(\d+) ([+-]) (\d+)(?: \+ (1))? = (\d+)", text.split(". ")[0].split(": ")[1]
        )
        assert steps, text
        digits, carry = [], 0
        for i, (x, sign, y, c, result) in enumerate(steps):
            da = (a // 10**i) % 10
            db = (b // 10**i) % 10
            x, y, result = int(x), int(y), int(result)
            assert int(result) == (x + y + (1 if c else 0) if sign == "+" else x - y), text
            if sign == "+":
                assert (x, y, bool(c)) == (da, db, bool(carry)), text
                carry = result // 10
                digits.append(result % 10)
            else:
                assert y == db and x in (da - carry, da - carry + 10), text
                carry = int(x != da - carry)
                digits.append(result)
        value = int("".join(map(str, reversed(digits)))) + (
            carry * 10 ** len(digits) if op == "+" else 0
        )
        assert value == abs(int(p["answer"])), text
    plain = arithmetic_problems(5, seed=3, max_operand=99, ops=ops)
    assert all(
        p["solution"] == f"{p['expression']} = {p['answer']}. The answer is {p['answer']}."
        for p in plain
    )


def test_unique_draws_distinct_problems_and_says_when_too_few() -> None:
    problems = arithmetic_problems(300, seed=0, split="val", max_operand=99, ops="+-", unique=True)
    assert len({p["expression"] for p in problems}) == 300
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_problems(200, seed=0, split="val", max_operand=9, ops="+", unique=True)
    with pytest.raises(ValueError, match="solution"):
        arithmetic_problems(2, solution="essay")


def test_builtin_records_by_name(tmp_path: Path) -> None:
    sft = list(builtin_records("arithmetic/sft/val", n=4, seed=2))
    assert len(sft) == 4 and all(r["id"].startswith("arith-val-2") for r in sft)
    assert write_builtin_jsonl("arithmetic/preference", tmp_path / "p.jsonl", n=6) == 6
    assert len(JsonStorage(tmp_path / "p.jsonl")) == 6
    assert len(list(builtin_records("stdlib/val", max_files=2))) == 2
    with pytest.raises(ValueError, match=r"unknown builtin data 'arithmetic/chat'.*available"):
        list(builtin_records("arithmetic/chat"))


def test_rewards() -> None:
    rec = {"prompt": "What is 6 * 7?", "answer": "42"}
    exact, fmt = REWARDS["exact_match"], REWARDS["format"]
    assert exact(rec, "6 * 7 = 42. The answer is 42.") == 1.0
    assert exact(rec, "It is 41, no, 42") == 1.0  # last number without the format
    assert exact(rec, "The answer is 42. Or 41.") == 1.0  # the stated answer wins
    assert exact(rec, "The answer is 4.") == 0.0 and exact(rec, "no idea") == 0.0
    assert exact({"answer": "-1,000"}, "The answer is -1000.") == 1.0
    assert fmt(rec, "The answer is 42.") == 1.0 and fmt(rec, "The answer is 42. Bye") == 0.0
    assert fmt(rec, "42") == 0.0
    assert extract_final_number("x = 3.5") == 3.5
    with pytest.raises(KeyError, match="needs an 'answer' field"):
        exact({"prompt": "q"}, "1")
    with pytest.raises(
        KeyError, match=r"unknown reward 'nope'; available: .*'exact_match'.*'format'"
    ):
        get_reward("nope")


def test_register_reward() -> None:
    @register_reward("test_length")
    def length(record, completion: str) -> float:
        return float(len(completion))

    try:
        assert get_reward("test_length")({}, "abc") == 3.0
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_length")(lambda r, c: 0.0)
    finally:
        REWARDS.pop("test_length")
