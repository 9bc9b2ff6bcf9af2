"""The code_tests reward: programs built like the code suite's, run in the sandbox, scored
1/0; what a program does never raises, a record of neither shape does."""

import subprocess
import sys

import pytest

from astrai.data.rewards import get_reward
from astrai.eval.code import HUMANEVAL_STOP, program_of, truncate
from astrai.eval.code_reward import CodeTests, code_of

HUMANEVAL = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
MBPP = {
    "prompt": "Write a function double(x) that returns twice x, times SCALE.",
    "test_setup_code": "SCALE = 1",
    "test_list": ["assert double(2) == 4 * SCALE", "assert double(-3) == -6"],
}

HE_RIGHT = "    return a + b\n\ndef unused():\n    return 1 / 0\n"  # cut at "\ndef"
HE_WRONG = "    return a - b\n"
HE_LOOP = "    while True:\n        pass\n"
HE_SYNTAX = "    return a +\n"
MBPP_RIGHT = "Here you go:\n```python\ndef double(x):\n    return 2 * x\n```\nDone."
MBPP_WRONG = "def double(x):\n    return x + 2\n"  # no fence: the whole completion
MBPP_LOOP = "```python\ndef double(x):\n    while True:\n        pass\n```"
MBPP_CRASH = "```python\ndef double(x):\n    raise RuntimeError('no')\n```"


def test_each_shape_scores_right_wrong_and_endless_programs():
    reward = CodeTests(timeout=1.0, memory_mb=256, workers=4)
    records = [HUMANEVAL] * 4 + [MBPP] * 4
    completions = [HE_RIGHT, HE_WRONG, HE_LOOP, HE_SYNTAX]
    completions += [MBPP_RIGHT, MBPP_WRONG, MBPP_LOOP, MBPP_CRASH]
    assert reward.batch(records, completions) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert reward(HUMANEVAL, HE_RIGHT) == 1.0  # one at a time, too
    assert reward(MBPP, MBPP_WRONG) == 0.0


def test_humaneval_program_is_the_code_suites():
    expected = program_of(HUMANEVAL, truncate(HE_RIGHT, HUMANEVAL_STOP))
    assert CodeTests().program(HUMANEVAL, HE_RIGHT) == expected
    assert "1 / 0" not in expected  # the stop sequence cut the second function


def test_mbpp_program_is_code_then_setup_then_asserts():
    program = CodeTests().program(MBPP, MBPP_RIGHT)
    code, setup, asserts = (program.index(s) for s in ("def double", "SCALE = 1", "assert"))
    assert code < setup < asserts
    assert "Here you go" not in program and "Done." not in program
    assert program.endswith("assert double(-3) == -6\n")


@pytest.mark.parametrize(
    ("completion", "code"),
    [
        ("```python\na = 1\n```\n```python\nb = 2\n```", "a = 1\n"),  # the first block
        ("```\nu = 0\n```\n```py\np = 1\n```", "p = 1\n"),  # a tagged one before an untagged
        ("```\nu = 0\n```", "u = 0\n"),
        ("text\n```Python\nx = 1\n", "x = 1\n"),  # unclosed: runs to the end
        ("x = 1\n", "x = 1\n"),  # no fence: the whole completion
    ],
)
def test_code_of(completion, code):
    assert code_of(completion) == code


def test_records_of_neither_shape_raise_naming_the_fields():
    reward = CodeTests(timeout=1.0)
    with pytest.raises(KeyError, match="'test_list'") as err:
        reward({"prompt": "p", "answer": "5"}, "x = 1")
    assert "entry_point" in str(err.value)
    with pytest.raises(KeyError, match=r"missing \['test'\]"):
        reward({"prompt": "p", "entry_point": "f"}, "x = 1")
    with pytest.raises(ValueError, match="test_list"):
        reward({"test_list": "assert True"}, "x = 1")
    with pytest.raises(KeyError, match="record 1"):  # batch: checked before anything runs
        reward.batch([MBPP, {"prompt": "p"}], [MBPP_RIGHT, "x"])
    with pytest.raises(ValueError, match="timeout"):
        CodeTests(timeout=0)


def test_registered_by_path_without_data_importing_eval():
    code = (
        "import sys\nimport astrai.data.rewards as r\n"
        "assert not any(m.startswith('astrai.eval') for m in sys.modules), 'eval imported'\n"
        "print(type(r.get_reward('code_tests')).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "astrai.eval.code_reward"
    assert isinstance(get_reward("code_tests"), CodeTests)
