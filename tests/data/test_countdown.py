"""The Countdown task (astrai.data.countdown): seeded problems split by a hash, the `countdown`
reward against TinyZero's checker, the weak solver's demonstrations (wrong or absent often
enough), the builtin records, the eval suite on an engine, and the experiments' composition."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from astrai.data.builtin import builtin_records
from astrai.data.countdown import (
    OPS,
    apply_op,
    countdown_format,
    countdown_problems,
    countdown_reward,
    final_expression,
    parse_expression,
    solver_figures,
    weak_solve,
)
from astrai.data.rewards import get_reward

CONF = Path(__file__).resolve().parents[2] / "conf"
RECORD = {"numbers": [2, 7, 2], "target": 18}


def _key(problem: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    return tuple(sorted(problem["numbers"])), problem["target"]


# ------------------------------------------------------------------------------ generator
def test_problems_are_seeded_solvable_and_split_disjoint() -> None:
    first = countdown_problems(300, seed=3)
    assert first == countdown_problems(300, seed=3)
    assert first != countdown_problems(300, seed=4)
    assert countdown_problems(100, seed=3) == first[:100]  # a longer draw extends a shorter one
    train = countdown_problems(4000, seed=0, split="train")
    val = countdown_problems(1500, seed=1, split="val")
    assert not {_key(p) for p in train} & {_key(p) for p in val}
    # the split is by problem, not by draw: another seed's val problems are never train ones
    assert not {_key(p) for p in train} & {_key(p) for p in countdown_problems(500, 9, split="val")}
    for p in train[:500] + val[:500]:
        assert len(p["numbers"]) == 3 and all(1 <= n <= 10 for n in p["numbers"])
        assert 1 <= p["target"] <= 100
        assert countdown_reward(p, f"The answer is {p['answer']}.") == 1.0  # reachable
        assert str(p["target"]) in p["prompt"]
        assert all(str(n) in p["prompt"] for n in p["numbers"])


def test_unique_draws_distinct_problems_and_says_when_too_few() -> None:
    val = countdown_problems(256, seed=0, split="val", unique=True)
    assert len({_key(p) for p in val}) == 256
    with pytest.raises(ValueError, match="cannot draw 50 distinct problems"):
        countdown_problems(50, split="val", unique=True, max_number=2)
    with pytest.raises(ValueError, match="num_count >= 2"):
        countdown_problems(3, num_count=1)


# ------------------------------------------------------------------------------- the reward
# The reference: TinyZero's checker, transcribed from Jiayi-Pan/TinyZero
# verl/utils/reward_score/countdown.py (validate_equation, evaluate_equation and the test of
# compute_score), which checks the numbers by regex and evaluates with a restricted eval().
def tinyzero_validate_equation(equation_str: str, available_numbers: Sequence[int]) -> bool:
    try:
        numbers_in_eq = [int(n) for n in re.findall(r"\d+", equation_str)]
        return sorted(numbers_in_eq) == sorted(available_numbers)
    except Exception:
        return False


def tinyzero_evaluate_equation(equation_str: str) -> Any:
    try:
        if not re.match(r"^[\d+\-*/().\s]+$", equation_str):
            raise ValueError("Invalid characters in equation.")
        return eval(equation_str, {"__builtins__": None}, {})  # the reference's own
    except Exception:
        return None


def tinyzero_correct(equation: str, numbers: Sequence[int], target: int) -> bool:
    if not tinyzero_validate_equation(equation, numbers):
        return False
    result = tinyzero_evaluate_equation(equation)
    return result is not None and abs(result - target) < 1e-5


def _all_expressions(numbers: Sequence[int]) -> list[str]:
    """Every expression over the numbers in every order, operators and both tree shapes."""
    if len(numbers) == 2:
        return [f"{a} {op} {b}" for a, b in itertools.permutations(numbers) for op in OPS]
    out = []
    for a, b, c in itertools.permutations(numbers):
        for o1, o2 in itertools.product(OPS, repeat=2):
            out += [
                f"({a} {o1} {b}) {o2} {c}",
                f"{a} {o1} ({b} {o2} {c})",
                f"{a} {o1} {b} {o2} {c}",
            ]
    return out


def _in_order(numbers: Sequence[int]) -> list[str]:
    """The expressions the weak solver chooses among: the given order, left to right."""
    a, b, c = numbers
    return [f"({a} {o1} {b}) {o2} {c}" for o1, o2 in itertools.product(OPS, repeat=2)]


def test_reward_agrees_with_tinyzero_on_every_expression() -> None:
    problems = countdown_problems(12, seed=5, split="val")
    checked = right = 0
    for p in problems:
        others = [[*p["numbers"][:2], p["numbers"][2] % 10 + 1], p["numbers"][:2]]
        for numbers in [p["numbers"], *others]:  # the right numbers, a wrong one, one missing
            for expression in _all_expressions(numbers):
                expected = tinyzero_correct(expression, p["numbers"], p["target"])
                got = countdown_reward(p, f"... The answer is {expression}.")
                assert got == float(expected), (p, expression)
                checked, right = checked + 1, right + int(expected)
    assert checked > 3000 and right > 10  # many right answers per problem, many wrong ones


def test_reward_on_right_wrong_malformed_and_unsafe_answers() -> None:
    reward = get_reward("countdown")
    assert reward is countdown_reward
    right = ["(2 + 7) * 2", "2 * (7 + 2)", "(7 + 2) * 2", "2*(2+7)", " ( 2 + 7 ) * 2 "]
    for expression in right:
        assert reward(RECORD, f"2 + 7 = 9, 9 * 2 = 18. The answer is {expression}.") == 1.0
    # the value restated, no final period, the marker missing (the last line is the answer)
    assert reward(RECORD, "The answer is (2 + 7) * 2 = 18.") == 1.0
    assert reward(RECORD, "The answer is (2 + 7) * 2") == 1.0
    assert reward(RECORD, "thinking...\n(2 + 7) * 2") == 1.0
    # exact fractions: (7 - 3) / 2 * 5 = 10; 1 / 3 * 3 is 1, not 0.999...
    assert reward({"numbers": [7, 3, 2, 5], "target": 10}, "The answer is (7 - 3) / 2 * 5.") == 1.0
    assert reward({"numbers": [1, 3, 3], "target": 1}, "The answer is 1 / 3 * 3.") == 1.0
    assert reward({"numbers": [1, 3, 3], "target": 1}, "The answer is 3 / 3 / 1.") == 1.0
    wrong = [
        "(2 * 7) + 2",  # the weak solver's answer: 16
        "2 * 7 + 2 + 2",  # 18, but a 2 used three times
        "2 * 9",  # 18 without the given numbers
        "(2 + 7) * 2 * 1",  # an extra number
        "7 + 7 + 2 + 2",  # 18 with 7 used twice
        "18",
    ]
    for expression in wrong:
        assert reward(RECORD, f"The answer is {expression}.") == 0.0, expression
    malformed = ["", "The answer is", "The answer is (2 + 7 * 2.", "The answer is 2 7 2.", "hi"]
    for text in malformed:
        assert reward(RECORD, text) == 0.0, text
    unsafe = [
        "__import__('os').system('echo hi')",
        "(2 + 7) * 2 if True else 0",
        "[2, 7, 2][0] * 9",
        "2 ** 7 - 2",  # power
        "7 // 2 * 2",  # floor division
        "-2 + 7 * 2 + 2 + 2",  # a unary sign
        "(2 + 7) * 2.0",  # a float literal
        "2 / (7 - 7) + 2",  # division by zero
        "(" * 500 + "2" + ")" * 500,  # too long to parse
    ]
    for expression in unsafe:
        assert reward(RECORD, f"The answer is {expression}.") == 0.0, expression
        assert parse_expression(expression) is None, expression
    with pytest.raises(KeyError, match="target"):
        reward({"numbers": [1, 2]}, "The answer is 1 + 2.")


def test_parse_expression_values_and_final_expression() -> None:
    value, used = parse_expression("(10 - 4) / 4 + 7")
    assert value == Fraction(3, 2) + 7 and used == [10, 4, 4, 7]
    assert final_expression("a. The answer is 1 + 2. The answer is (3 * 4) - 5.") == "(3 * 4) - 5"
    assert final_expression("x = 3\n\n1 + 2 = 3") == "1 + 2"


def test_format_reward() -> None:
    fmt = get_reward("countdown_format")
    assert fmt is countdown_format
    assert fmt(RECORD, "2 * 7 = 14. The answer is (2 * 7) + 2.") == 1.0  # wrong but well formed
    assert fmt(RECORD, "The answer is (2 * 7) + 2 = 16.") == 0.0
    assert fmt(RECORD, "The answer is (2 * 7) + 2") == 0.0
    assert fmt(RECORD, "The answer is 2 ** 7.") == 0.0
    assert fmt(RECORD, "(2 * 7) + 2.") == 0.0


# ------------------------------------------------------------------------- the weak solver
def test_weak_solver_is_greedy_left_to_right() -> None:
    # 2 + 7 = 9 or 2 * 7 = 14: 14 is closer to 18; then 14 + 2 = 16 beats 14 * 2 = 28
    assert weak_solve([2, 7, 2], 18) == ("(2 * 7) + 2", ["2 * 7 = 14", "14 + 2 = 16"], 16)
    # 9 / 3 = 3 lands on the target; then 3 * 1 and 3 / 1 tie: the first of + - * / wins
    assert weak_solve([9, 3, 1], 3) == ("(9 / 3) * 1", ["9 / 3 = 3", "3 * 1 = 3"], 3)


def test_the_solver_explores_apart_from_the_problems() -> None:
    greedy = countdown_problems(400, seed=2, split="val", explore=0.0)
    noisy = countdown_problems(400, seed=2, split="val")
    assert [_key(p) for p in greedy] == [_key(p) for p in noisy]  # the same problems
    for p in greedy:  # explore=0: the greedy attempt, written when within slack
        expression, _, value = weak_solve(p["numbers"], p["target"])
        assert (p["solution"] is None) == (abs(value - p["target"]) > 5)
        assert p["solution"] is None or p["solution"].endswith(f"The answer is {expression}.")
    moves = [a["solution"] != b["solution"] for a, b in zip(greedy, noisy)]
    assert 0.2 < sum(moves) / len(moves) < 0.9
    rescued = [
        b for a, b in zip(greedy, noisy) if a["solver"] != "right" and b["solver"] == "right"
    ]
    assert rescued  # a random move finds answers greedy misses: the data holds more than one move
    with pytest.raises(ValueError, match="explore must be in"):
        countdown_problems(1, explore=1.5)


def test_weak_demonstrations_are_often_wrong_or_absent() -> None:
    problems = countdown_problems(1000, seed=1, split="val")
    counts = {
        kind: sum(p["solver"] == kind for p in problems) for kind in ("right", "wrong", "none")
    }
    assert all(counts[k] > 150 for k in counts), counts
    for p in problems:
        if p["solution"] is None:
            assert p["solver"] == "none"
            continue
        # the label is the reward's verdict; each worked step is true arithmetic
        assert countdown_reward(p, p["solution"]) == float(p["solver"] == "right"), p
        assert countdown_format(p, p["solution"]) == 1.0
        for a, op, b, c in re.findall(r"(-?\d+) ([-+*/]) (\d+) = (-?\d+)", p["solution"]):
            assert apply_op(Fraction(int(a)), op, Fraction(int(b))) == int(c), p["solution"]
    figures = solver_figures(problems)
    assert figures["coverage"] == pytest.approx(1 - counts["none"] / 1000)
    assert figures["accuracy"] == pytest.approx(counts["right"] / 1000)
    assert figures["accuracy"] < 0.6 and figures["precision"] < 0.8
    # the reward accepts more: some problems the solver gets wrong or gives up on have an
    # answer in the given order alone, and every problem has one (its `answer`)
    failed = [p for p in problems if p["solver"] != "right"]
    in_order = [p for p in failed if any(countdown_reward(p, e) for e in _in_order(p["numbers"]))]
    assert len(in_order) > 0.2 * len(failed)


def test_builtin_records_by_name() -> None:
    sft = list(builtin_records("countdown/sft/val", n=200, seed=1))
    problems = countdown_problems(200, seed=1, split="val")
    assert len(sft) == sum(p["solution"] is not None for p in problems) < 200
    assert [r["messages"][1]["content"] for r in sft] == [
        p["solution"] for p in problems if p["solution"] is not None
    ]
    prompts = list(builtin_records("countdown/prompt", n=50, seed=0, max_number=5))
    assert len(prompts) == 50 and all(max(r["numbers"]) <= 5 for r in prompts)
    assert set(prompts[0]) == {"id", "prompt", "numbers", "target", "answer"}
    with pytest.raises(ValueError, match="unknown builtin data"):
        list(builtin_records("countdown/preference"))


# ------------------------------------------------------------------------------ eval suite
class _Answering:
    """Stands in for an engine: answers each prompt with `reply(prompt text)`."""

    def __init__(self, tokenizer: Any, reply: Any) -> None:
        self.tokenizer, self.reply = tokenizer, reply

    def run_batch(self, prompts: Sequence[Sequence[int]], params: Any, **_: Any) -> list[Any]:
        from astrai.inference import BatchResult

        texts = [self.reply(self.tokenizer.decode(ids)) for ids in prompts]
        return [BatchResult(self.tokenizer.encode(t), None, "stop") for t in texts]


def _suite(num_prompts: int) -> Any:
    cfg = OmegaConf.load(CONF / "eval" / "countdown.yaml")
    cfg.num_prompts = num_prompts
    return instantiate(cfg)


def test_eval_suite_scores_the_countdown_reward(stdlib_tokenizer: Any) -> None:
    suite = _suite(6)
    assert suite.chat and suite.name == "countdown"
    answers = {r["prompt"]: r for r in suite.records}

    def reply(text: str) -> str:  # right on the first three problems, the solver's own after
        record = next(r for prompt, r in answers.items() if prompt in text)
        if suite.records.index(record) < 3:
            return f"The answer is {record['answer']}."
        return weak_solve(record["numbers"], record["target"])[0]

    result = suite.run(_Answering(stdlib_tokenizer, reply))
    expected = [countdown_reward(r, reply(r["prompt"])) for r in suite.records]
    assert [row["countdown"] for row in result.samples] == expected
    assert result.metrics["countdown"] == pytest.approx(sum(expected) / 6) and sum(expected) >= 3
    assert result.metrics["countdown_format"] == pytest.approx(0.5)


def test_eval_suite_runs_on_a_tiny_model(stdlib_tokenizer: Any) -> None:
    from tiny_parts import tiny_transformer

    from astrai.inference import InferenceEngine

    suite = _suite(4)
    model = tiny_transformer(len(stdlib_tokenizer), 256)
    engine = InferenceEngine(
        model, stdlib_tokenizer, start=False, max_batch_size=4, max_seq_len=256
    )
    result = suite.run(engine)
    assert len(result.samples) == 4 and result.metrics["completion_len"] > 0
    for row, record in zip(result.samples, suite.records):
        assert row["countdown"] == countdown_reward(record, row["completion"])
    assert 0.0 <= result.metrics["countdown"] <= 1.0


# ----------------------------------------------------------------------------- experiments
@pytest.mark.parametrize(
    "name", ["tiny_sft_countdown_start", "tiny_sft_countdown_continue", "tiny_grpo_countdown"]
)
def test_countdown_experiments_compose(name: str) -> None:
    """The record's runs: the same suite, the start's export, equal steps and problems per
    step for the control and GRPO. (tiny_dapo needs dynamic_sampling and overlong_penalty,
    which other branches of #48 add.)"""
    from astrai.train.runner import compose

    cfg = compose([f"+experiment={name}", "paths.output_dir=/tmp/unused"])
    suites = OmegaConf.to_container(cfg.callbacks.eval.suites, resolve=True)
    assert suites["arithmetic"] is None and suites["countdown"]["task"] == "countdown"
    assert suites["countdown"]["metrics"] == ["countdown", "countdown_format"]
    if name == "tiny_sft_countdown_start":
        assert cfg.data.train.source == "builtin:countdown/sft/train"
        assert cfg.strategy.get("init_from") is None
        return
    assert cfg.strategy.init_from.endswith("/tiny_sft_countdown_start/latest/export")
    rl = compose(["+experiment=tiny_grpo_countdown", "paths.output_dir=/tmp/unused"])
    assert (cfg.trainer.max_steps, cfg.data.batch_size) == (
        rl.trainer.max_steps,
        rl.data.batch_size,
    )
    if name == "tiny_grpo_countdown":
        assert cfg.data.train.source == "builtin:countdown/prompt/train"
        assert OmegaConf.to_container(cfg.strategy.rewards) == [
            {"name": "countdown", "weight": 1.0}
        ]
        assert cfg.strategy.loss_type == "dapo" and cfg.strategy.epsilon_high == 0.28
    else:
        assert cfg.data.train.source == "builtin:countdown/sft/train"
