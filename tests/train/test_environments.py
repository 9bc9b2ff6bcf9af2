"""Multi-turn environments: the calculator's safe evaluation, tool answers and refusals, and
the code environment's sandboxed tests with its second-attempt feedback."""

from __future__ import annotations

import re

import pytest

from astrai.train.environments import Calculator, CodeRepair, StepResult
from astrai.train.environments.calculator import CalcError, evaluate, format_value


def _call(name: str = "calc", **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _turn(*calls: dict, content: str = "") -> list[dict]:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return [{"role": "user", "content": "What is 23 + 45?"}, message]


# ---------------------------------------------------------------------- evaluation
@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("23 + 45 * 2", 23 + 45 * 2),
        ("(23 + 45) * 2", (23 + 45) * 2),
        ("-7 + -(3 - 10)", -7 + -(3 - 10)),
        ("100 // 7", 100 // 7),
        ("-100 // 7", -100 // 7),
        ("  12 - 30  ", 12 - 30),
        ("+5", 5),
    ],
)
def test_integer_expressions_match_python(expr, value):
    assert format_value(evaluate(expr)) == str(value)


def test_true_division_is_exact():
    assert format_value(evaluate("84 / 4")) == "21"  # an integral quotient prints as one
    assert format_value(evaluate("7 / 2")) == "3.5"
    assert format_value(evaluate("1 / 3")) == "0.333333"
    assert format_value(evaluate("(1 / 3) * 3")) == "1"  # rationals: no rounding error


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("__import__('os').system('true')", "unsupported syntax: Call"),
        ("2 ** 10", "unsupported syntax: BinOp"),
        ("x + 1", "unsupported syntax: Name"),
        ("[1, 2]", "unsupported syntax: List"),
        ("1.5 + 2", "only integers"),
        ("True + 1", "only integers"),
        ("'a' * 3", "only integers"),
        ("1 +", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("5 / (3 - 3)", "division by zero"),
        ("5 // 0", "division by zero"),
        ("9" * 19, "value too large"),
        ("999999999 * 999999999 * 999", "value too large"),
        ("1+" * 150 + "1", "longer than 200"),
        ("+".join(["1"] * 60), "more than 100 parts"),
    ],
)
def test_refusals(expr, why):
    with pytest.raises(CalcError, match=why.replace("*", r"\*").replace("(", r"\(")):
        evaluate(expr)


# ---------------------------------------------------------------------- the environment
def test_reset_gives_the_prompt_and_tools_follow_announce_tools():
    env = Calculator()
    assert env.reset({"prompt": "What is 2 + 2?", "answer": "4"}) == [
        {"role": "user", "content": "What is 2 + 2?"}
    ]
    assert [t["function"]["name"] for t in env.tools] == ["calc"]
    assert Calculator(announce_tools=False).tools is None
    with pytest.raises(ValueError, match="'prompt'"):
        env.reset({"question": "What is 2 + 2?"})


def test_each_call_is_answered_in_order_and_a_plain_turn_ends():
    env = Calculator()
    env.reset({"prompt": "What is 23 + 45?"})
    out = env.step(_turn(_call(expr="23 + 45"), _call(expr="68 * 2")))
    assert out == StepResult(
        [{"role": "tool", "content": "68"}, {"role": "tool", "content": "136"}], 0.0, False
    )
    out = env.step(_turn(content="The answer is 68."))
    assert out == StepResult(None, 0.0, True)


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        (_call(expr="1 / 0"), "error: division by zero"),
        (
            _call("python", code="print(1)"),
            "error: unknown tool 'python' (the only tool is 'calc')",
        ),
        (_call(expression="1 + 1"), 'error: arguments must be {"expr": "<expression>"}'),
        (_call(expr="1", extra="2"), 'error: arguments must be {"expr": "<expression>"}'),
        (_call(expr=12), "error: expr must be a string, got int"),
    ],
)
def test_bad_calls_get_an_error_text_not_an_exception(call, answer):
    env = Calculator()
    env.reset({"prompt": "What is 1 + 1?"})
    assert env.step(_turn(call)) == StepResult([{"role": "tool", "content": answer}], 0.0, False)


def test_max_calls_ends_the_episode_when_exceeded():
    env = Calculator(max_calls=2)
    env.reset({"prompt": "What is 1 + 1?"})
    assert not env.step(_turn(_call(expr="1 + 1"))).done
    assert not env.step(_turn(_call(expr="2 + 2"))).done
    assert env.step(_turn(_call(expr="3 + 3"))) == StepResult(None, 0.0, True)
    env.reset({"prompt": "What is 1 + 1?"})  # a new episode counts from zero
    assert not env.step(_turn(_call(expr="1 + 1"), _call(expr="1 + 2"))).done


@pytest.mark.parametrize(
    ("option", "value"), [("announce_tools", "yes"), ("max_calls", -1), ("max_calls", True)]
)
def test_bad_options_name_the_field(option, value):
    with pytest.raises(ValueError, match=option):
        Calculator(**{option: value})


# ---------------------------------------------------------------------- code
HUMANEVAL = {
    "task_id": "t/0",
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
MBPP = {
    "text": "Write a function to double a number.",
    "test_list": ["assert double(2) == 4", "assert double(-3) == -6"],
}
GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
BAD = "```python\ndef add(a, b):\n    return a - b\n```"


def _reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "..."}, {"role": "assistant", "content": text}]


def test_humaneval_pass_ends_with_reward_one():
    env = CodeRepair()
    (message,) = env.reset(HUMANEVAL)
    assert message["role"] == "user" and HUMANEVAL["prompt"] in message["content"]
    assert env.step(_reply(GOOD)) == StepResult(None, 1.0, True)


def test_failure_shows_the_error_then_the_second_attempt_counts():
    env = CodeRepair(max_attempts=2)
    env.reset(HUMANEVAL)
    observation, reward, done = env.step(_reply(BAD))
    assert (reward, done) == (0.0, False)
    (feedback,) = observation
    assert feedback["role"] == "user"
    text = feedback["content"]
    assert "failed (exit status 1)" in text and "AssertionError" in text
    assert 'File "program.py"' in text and "astrai-sandbox" not in text  # no temp dir named
    assert text.endswith(
        "Fix it and reply with the whole corrected program in a ```python code block."
    )
    assert env.step(_reply(GOOD)) == StepResult(None, 1.0, True)  # the retry passes


def test_last_failed_attempt_ends_with_zero_and_feedback_is_truncated():
    env = CodeRepair(max_attempts=2, feedback_chars=20)
    env.reset(HUMANEVAL)
    (feedback,) = env.step(_reply(BAD)).observation
    shown = re.search(r"\n```\n(.*)\n```\n", feedback["content"], re.S).group(1)
    assert shown.startswith("...") and len(shown) == 3 + 20 and shown.endswith("AssertionError")
    assert env.step(_reply(BAD)) == StepResult(None, 0.0, True)
    single = CodeRepair(max_attempts=1)
    single.reset(HUMANEVAL)
    assert single.step(_reply(BAD)) == StepResult(None, 0.0, True)


def test_mbpp_records_show_their_tests_and_run_them():
    env = CodeRepair()
    (message,) = env.reset(MBPP)
    assert MBPP["text"] in message["content"] and "assert double(-3) == -6" in message["content"]
    assert env.step(_reply("def double(x):\n    return 2 * x\n")).reward == 1.0
    env.reset(MBPP)
    out = env.step(_reply("def double(x):\n    return x + 2\n"))
    assert not out.done and "assert double(-3) == -6" in out.observation[0]["content"]


def test_a_timeout_is_reported_as_such():
    env = CodeRepair(timeout=1.0)
    env.reset(MBPP)
    (feedback,) = env.step(_reply("while True:\n    pass\n")).observation
    assert feedback["content"].startswith("Your program did not finish within 1 s.")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"prompt": "def f():\n", "test": "def check(c): pass\n"}, "missing \\['entry_point'\\]"),
        ({"text": "x"}, "missing"),
        ({**HUMANEVAL, "entry_point": "add); import os; (x"}, "entry_point"),
        ({**MBPP, "test_list": "assert double(2) == 4"}, "test_list"),
    ],
)
def test_malformed_records_raise_at_reset(record, match):
    with pytest.raises((KeyError, ValueError), match=match):
        CodeRepair().reset(record)


@pytest.mark.parametrize(("option", "value"), [("max_attempts", 0), ("feedback_chars", -1)])
def test_bad_code_options_name_the_field(option, value):
    with pytest.raises(ValueError, match=option):
        CodeRepair(**{option: value})


def test_an_environments_tool_parser_is_checked_when_it_is_built():
    assert Calculator().tool_parser == "auto" and CodeRepair().tool_parser == "auto"
    assert Calculator(tool_parser="llama3_json").tool_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_parser must be one of hermes, llama3_json"):
        Calculator(tool_parser="hermes2")
    with pytest.raises(ValueError, match="tool_parser"):
        CodeRepair(tool_parser="bogus")
